"""Gate weights beside the routed expert ids out of CUDA vLLM 0.24 (`AGENTRL_ROUTED_WEIGHTS=1` on a GPU server).

CUDA vLLM's `--enable-return-routed-experts` records each MoE layer's top-k expert ids: every router calls
its ``capture_fn(topk_ids)`` inside `BaseRouter.select_experts`, `RoutedExpertsCapturer` writes them into an
int32 device buffer ``(max_num_batched_tokens, layers, top_k)``, the GPU model runner copies the step's rows
to a pinned host buffer shaped like it and sends them to the scheduler, whose `RoutedExpertsManager` keeps
them per KV-cache slot (so prefix-cache hits find them) and hands each request its rows; the generate
endpoint returns them as `.npy`. Nothing on that path looks at the array's dtype or trailing shape.

Router Replay's third arm also needs the gate weights inference applied (`inference.routed_weights`).
With this module installed the same path carries float32 pairs ``(..., top_k, 2)``, ids then weights,
as the CPU runner's rows do (`vllm_plugin.routed_experts`; `agentrl.routed.routing_arrays` splits them):

- `RoutedExpertsCapturer` gets a float32 ``(tokens, layers, top_k, 2)`` device buffer (the runner sizes its
  host buffer from it) and writes the ids into ``[..., 0]``;
- `BaseRouter.select_experts` hands its returned gate weights to ``_agentrl_weights_fn``, bound per MoE
  layer when the runner binds the capturer, which writes them into ``[..., 1]`` of the same rows;
- `RoutedExpertsManager` keeps float32 pairs per slot (ids up to 2^24 are exact in float32).

Every write is a slice assignment into a buffer of fixed address, as vLLM's own capture is, so CUDA graphs
record it. Only one data-parallel rank per engine is handled (the deployment refuses more); EPLB is not
used by agentrl's servers, so the ids after ``select_experts`` are the logical ones vLLM captures.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("agentrl.routed_weights_cuda")

_INSTALLED = False

__all__ = ["install"]


def _patch_capturer() -> None:
    import torch
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    original_init = RoutedExpertsCapturer.__init__

    def __init__(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        ids = self.device_buffer
        self.device_buffer = torch.zeros((*ids.shape, 2), dtype=torch.float32, device=ids.device)

    def capture(self, layer_id: int, topk_ids) -> None:
        if get_forward_context().dp_metadata is not None:
            raise RuntimeError("AGENTRL_ROUTED_WEIGHTS=1 records one data-parallel rank per engine")
        if layer_id < self.device_buffer.shape[1]:
            self.device_buffer[: topk_ids.shape[0], layer_id, :, 0] = topk_ids

    def capture_weights(self, layer_id: int, topk_weights) -> None:
        if layer_id < self.device_buffer.shape[1]:
            self.device_buffer[: topk_weights.shape[0], layer_id, :, 1] = topk_weights

    RoutedExpertsCapturer.__init__ = __init__
    RoutedExpertsCapturer.capture = capture
    RoutedExpertsCapturer.agentrl_capture_weights = capture_weights


def _patch_manager() -> None:
    import numpy as np
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsManager

    original_init = RoutedExpertsManager.__init__

    def __init__(self, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        ids = self.routed_experts_by_slot
        self.routed_experts_by_slot = np.zeros((*ids.shape, 2), dtype=np.float32)
        logger.info("agentrl: routed experts with gate weights, %.2f GB per-slot buffer (float32 pairs)",
                    self.routed_experts_by_slot.nbytes / 1e9)

    RoutedExpertsManager.__init__ = __init__


def _patch_routers_and_binding() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from agentrl.inference.vllm_plugin.routed_experts import bind_gate_weights, hand_gate_weights_out

    original_bind = GPUModelRunner._bind_routed_experts_capturer

    def _bind_routed_experts_capturer(self, capturer) -> None:
        original_bind(self, capturer)
        bound = bind_gate_weights(self.compilation_config.static_forward_context.values(),
                                  capturer.agentrl_capture_weights)
        logger.info("agentrl: gate weights recorded for %d MoE layers", bound)

    hand_gate_weights_out("select_experts")
    GPUModelRunner._bind_routed_experts_capturer = _bind_routed_experts_capturer


def install() -> None:
    """Patch vLLM's capturer, slot manager, routers and runner binding (idempotent; in every vLLM process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _patch_capturer()
    _patch_manager()
    _patch_routers_and_binding()
    logger.info("agentrl: routed experts carry their gate weights (float32 pairs)")
