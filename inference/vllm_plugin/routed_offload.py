"""Router Replay through KV-cache offload on CUDA vLLM 0.24 (agentrl's vLLM plugin, `AGENTRL_ROUTED_OFFLOAD=1`).

CUDA vLLM records the routed experts of every token it computes into a scheduler-side buffer indexed by
KV slot (`RoutedExpertsManager.routed_experts_by_slot`) and, when a request's prefill completes, reads
the prompt's rows from the slots of the request's blocks. A local prefix-cache hit reuses the physical
block, whose slots still hold the rows of the request that computed it. A block a KV connector loads
(vLLM's native CPU offload, the Mooncake store) lands in whatever block the pool hands out, whose slots
hold an earlier occupant's rows: that is why vLLM refuses `--enable-return-routed-experts` with any KV
connector. This module lifts the refusal for a connector of role `kv_both` on one server (offload) and for
the P/D connectors of a pair on one node, vLLM's `NixlConnector` and agentrl's `FolderPDConnector`
(`kv_producer`/`kv_consumer`: the decode server's rows of the prompt tokens it loads come out unknown, and the
token client fills them from the prefill answer, `sdk/clients/prefill_decode.py`; other P/D connectors stay
refused), and returns rows that are true:

- after each step, the rows of every full block a request has computed are kept by block hash
  (`routed_prefix.CachedBlockRows`, the CPU plugin's store): a block hash covers the tokens from the
  sequence's start through the block, so an equal hash means equal tokens;
- when a request is scheduled with N tokens it does not compute (local hits and blocks the connector
  loads), the rows of those N tokens are looked up there when its prefill completes (not when it is
  scheduled: a request hits blocks another one computes in the same step, whose rows are kept only after
  it), and they replace those rows in the prompt's routing vLLM returns; a block the store does not hold
  gives rows of -1 (unknown: Router Replay routes those tokens live), and the array is then int16;
- a prefix-cache reset (every weight update; agentrl also resets the connector's cache) forgets them all;
- the decode side of a P/D pair keeps no rows (it keeps its cache across updates, without a prefix cache): every
  prompt row it loads comes out unknown, for the token client to take from the prefill answer.

`OffloadRouting` is that bookkeeping, on numpy arrays; `install` wires it into vLLM's `VllmConfig` and
`Scheduler` (0.24's names; a vLLM without them is refused in one line at start-up).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from agentrl import env_vars
from agentrl.inference.vllm_plugin.routed_prefix import CachedBlockRows

__all__ = ["OffloadRouting", "install"]

logger = logging.getLogger("agentrl.routed_offload")
_INSTALLED = False
#: P/D connectors whose decode side leaves the loaded prompt's rows unknown for the token client to stitch.
_PAIR_CONNECTORS = ("NixlConnector", "FolderPDConnector")


class OffloadRouting:
    """Rows of computed blocks by hash, and the rows owed to requests scheduled with tokens they do not compute."""

    def __init__(self, *, block_size: int, max_blocks: int, layers: int, top_k: int, keeps_rows: bool = True) -> None:
        self.block_size = block_size
        self.keeps_rows = keeps_rows
        """False on the decode side of a P/D pair: every prompt row it loads is left unknown for the token client to
        take from the prefill answer, whose server computed the KV this one reads. Rows this server kept of its own
        earlier completions would be of the weights then; it keeps its cache across updates (`weights`)."""
        self.rows = CachedBlockRows(block_size=block_size, max_blocks=max_blocks)
        self._like = np.zeros((1, layers, top_k), dtype=np.int16)
        self._owed: dict[str, tuple[list[Any], int]] = {}
        """Per request scheduled with tokens it does not compute: the hashes of their blocks, and their count."""
        self._registered: dict[str, int] = {}
        self.replaced_tokens = 0
        """Prompt tokens whose rows came from the store instead of the slot buffer."""

    def on_schedule(self, request_id: str, block_hashes: list[Any], computed_tokens: int) -> None:
        """A request scheduled (new, or resumed before any output) with `computed_tokens` tokens not computed now.
        All of them are owed rows, the part of a block too: a P/D decode server given a whole prompt of full
        blocks recomputes its last token alone, and the slots of the rest of that block hold whatever the block's
        earlier occupant left (seen on an H100: 15 such rows in a 320-token prompt). A block not wholly computed
        here is never kept from its slots. The rows are looked up in `stitch`: eight requests of one prompt
        scheduled together hit the blocks the first computes in that step (seen on an H100: 6,000 prompt tokens
        of 64 such requests a step came back unknown while the rows were looked up here)."""
        if computed_tokens:
            self._owed[request_id] = (list(block_hashes[: -(-computed_tokens // self.block_size)]), computed_tokens)
        self._registered[request_id] = min(-(-computed_tokens // self.block_size), len(block_hashes))

    def on_computed(self, request_id: str, block_hashes: list[Any], block_ids: list[int], stored_tokens: int,
                    slot_rows: np.ndarray) -> None:
        """Keep the rows of the request's full blocks whose every token's row is in `slot_rows` (the first
        `stored_tokens`), except the blocks it did not compute. Nothing is kept without `keeps_rows`."""
        if not self.keeps_rows:
            return
        full = min(len(block_hashes), len(block_ids), stored_tokens // self.block_size)
        start = self._registered.get(request_id, 0)
        for index in range(start, full):
            first = block_ids[index] * self.block_size
            self.rows.put(block_hashes[index], slot_rows[first: first + self.block_size])
        self._registered[request_id] = max(start, full)

    def stitch(self, request_id: str, routed: np.ndarray, *, prompt_start: int = 0) -> np.ndarray:
        """The prompt's rows vLLM read at the end of the prefill (from token `prompt_start`), with the rows owed
        to this request in place of the slots' (the first call for a request only)."""
        pending = self._owed.pop(request_id, None)
        if pending is None or pending[1] <= prompt_start:
            return routed
        owed = self.rows.lookup(pending[0], pending[1], like=self._like)
        count = min(len(owed) - prompt_start, len(routed))
        out = routed.astype(np.int16)
        out[:count] = owed[prompt_start: prompt_start + count]
        self.replaced_tokens += count
        return out

    def forget(self, request_id: str) -> None:
        """A finished request: nothing more is owed to it or kept for it."""
        self._owed.pop(request_id, None)
        self._registered.pop(request_id, None)

    def reset(self) -> None:
        """The prefix cache was reset (new weights): every request recomputes what it has not sampled yet."""
        self.rows.clear()
        self._owed.clear()
        self._registered.clear()


def _lift_connector_check(vllm_config_class: Any) -> None:
    """Let `--enable-return-routed-experts` start with a `kv_both` connector; P/D and PP > 1 stay refused."""
    original = vllm_config_class.__post_init__

    def __post_init__(self) -> None:
        model = self.model_config
        asked = model is not None and model.enable_return_routed_experts
        if asked:
            model.enable_return_routed_experts = False
        try:
            original(self)
        finally:
            if asked:
                model.enable_return_routed_experts = True
        if not asked:
            return
        if self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("--enable-return-routed-experts is incompatible with pipeline parallelism (PP > 1).")
        transfer = self.kv_transfer_config
        if (transfer is not None and transfer.is_kv_transfer_instance and transfer.kv_role != "kv_both"
                and getattr(transfer, "kv_connector", None) not in _PAIR_CONNECTORS):
            raise ValueError(f"--enable-return-routed-experts: agentrl's plugin stitches routing through KV offload "
                             f"(kv_role 'kv_both') and the P/D connectors {', '.join(_PAIR_CONNECTORS)} only, not "
                             f"kv_role {transfer.kv_role!r} of {getattr(transfer, 'kv_connector', None)!r}")

    vllm_config_class.__post_init__ = __post_init__


def _routing(scheduler: Any) -> OffloadRouting | None:
    routing = getattr(scheduler, "_agentrl_offload_routing", None)
    if routing is None and scheduler.enable_return_routed_experts:
        manager = scheduler.routed_experts_mgr
        slots = manager.routed_experts_by_slot
        bound = int(os.environ.get(env_vars.ROUTED_OFFLOAD_BLOCKS.name, 4 * (len(slots) // manager.block_size)))
        transfer = scheduler.vllm_config.kv_transfer_config
        routing = OffloadRouting(block_size=manager.block_size, max_blocks=bound, layers=slots.shape[1],
                                 top_k=slots.shape[2],
                                 keeps_rows=getattr(transfer, "kv_role", None) != "kv_consumer")
        scheduler._agentrl_offload_routing = routing
    return routing


def _computed_before(scheduler_output: Any) -> dict[str, int]:
    """Each scheduled request's computed tokens when it was scheduled (new and already running ones)."""
    starts = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    return starts


def _patch_scheduler(scheduler_class: Any) -> None:
    from vllm.v1.request import RequestStatus

    after_schedule = scheduler_class._update_after_schedule
    update_from_output = scheduler_class.update_from_output
    reset_prefix_cache = scheduler_class.reset_prefix_cache

    def _update_after_schedule(self, scheduler_output):
        routing = _routing(self)
        if routing is not None:
            for new in scheduler_output.scheduled_new_reqs:
                request = self.requests.get(new.req_id)
                if request is not None:
                    routing.on_schedule(new.req_id, request.block_hashes, new.num_computed_tokens)
            cached = scheduler_output.scheduled_cached_reqs
            for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
                request = self.requests.get(req_id)
                if req_id in cached.resumed_req_ids and request is not None and request.num_output_tokens == 0:
                    routing.on_schedule(req_id, request.block_hashes, computed)
        return after_schedule(self, scheduler_output)

    def _update_from_output(self, scheduler_output, model_runner_output):
        routing = _routing(self)
        if routing is None:
            return update_from_output(self, scheduler_output, model_runner_output)
        starts = _computed_before(scheduler_output)
        seen = {}  # the block ids of the schedule snapshot vLLM itself reads (taken before any later preemption)
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None and req_id in starts:
                seen[req_id] = (request, list(self._re_block_ids.get(req_id, [])), starts[req_id] + count)
        outputs = update_from_output(self, scheduler_output, model_runner_output)
        if model_runner_output.routed_experts is not None:
            slot_rows = self.routed_experts_mgr.routed_experts_by_slot
            for req_id, (request, block_ids, stored) in seen.items():
                if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                    routing.on_computed(req_id, request.block_hashes, block_ids, stored, slot_rows)
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.routed_experts is None or output.request_id not in seen:
                    continue
                params = seen[output.request_id][0].sampling_params
                start = (params.routed_experts_prompt_start or 0) if params is not None else 0
                output.routed_experts = routing.stitch(output.request_id, output.routed_experts, prompt_start=start)
        for req_id, (request, _, _) in seen.items():
            if request.is_finished():
                routing.forget(req_id)
        return outputs

    def _reset_prefix_cache(self, *args, **kwargs):
        done = reset_prefix_cache(self, *args, **kwargs)
        routing = getattr(self, "_agentrl_offload_routing", None)
        if done and routing is not None:
            routing.reset()
        return done

    scheduler_class._update_after_schedule = _update_after_schedule
    scheduler_class.update_from_output = _update_from_output
    scheduler_class.reset_prefix_cache = _reset_prefix_cache


def install() -> None:
    """Patch vLLM's config check and scheduler (idempotent; called by the plugin hook in every vLLM process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    missing = [name for name in ("_update_after_schedule", "update_from_output", "reset_prefix_cache")
               if not hasattr(Scheduler, name)]
    if missing:
        raise RuntimeError(f"agentrl's routed-offload plugin was written for vLLM 0.24's scheduler; this vLLM lacks "
                           f"Scheduler.{', '.join(missing)}: serve without inference.kv_offload or without routed "
                           "experts")
    _lift_connector_check(VllmConfig)
    _patch_scheduler(Scheduler)
    logger.info("agentrl: routed experts stitched through KV offload (blocks kept by hash)")
