"""Every MoE gate of the served model in float32 (agentrl's vLLM plugin, `AGENTRL_ROUTER_FLOAT32=1`).

vLLM computes GLM-4.5's and DeepSeek's router gate (`x W^T`) in float32, but Qwen3-MoE's in the model's dtype:
in 0.24 a plain bf16 `ReplicatedLinear`, in 0.32 a `GateLinear` left in the model's dtype. The trainer computes
its gates in float32 (`trainer.router_float32`, the default), so in a bf16 run the two sides can route a token
differently only because of the gate's rounding. With `inference.router_float32 = true` this module makes every
layer built as `<...>.mlp.gate` (the MoE gates of these families) keep its weight in float32 and take its input in
float32, so its logits are float32: construction passes `params_dtype = float32` (weight loads and in-place
updates then copy into float32), and a forward pre-hook widens the input. `GateLinear` (0.32) also gets
`out_dtype = float32`. Layers that are float32 already are left as they are.
"""

from __future__ import annotations

import logging

__all__ = ["install"]

logger = logging.getLogger("agentrl.router_float32")
_INSTALLED = False


def _is_moe_gate(prefix: str) -> bool:
    return prefix.endswith(".mlp.gate")


def _widen_input(module, args):
    import torch

    if args and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.float32:
        return (args[0].float(), *args[1:])
    return None


def install() -> None:
    """Patch `ReplicatedLinear` (and through it `GateLinear`) construction (idempotent; the plugin hook calls it)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    import torch
    from vllm.model_executor.layers.linear import ReplicatedLinear

    original = ReplicatedLinear.__init__

    def __init__(self, *args, **kwargs):
        prefix = kwargs.get("prefix", "")
        gate = _is_moe_gate(prefix)
        if gate and kwargs.get("params_dtype") is None:
            kwargs["params_dtype"] = torch.float32
        original(self, *args, **kwargs)
        if gate and getattr(self, "weight", None) is not None and self.weight.dtype == torch.float32:
            if hasattr(self, "out_dtype") and self.out_dtype is None:
                self.out_dtype = torch.float32
            self.register_forward_pre_hook(_widen_input)

    ReplicatedLinear.__init__ = __init__
    logger.info("agentrl: MoE gates (*.mlp.gate) in float32")
