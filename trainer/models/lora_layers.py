"""LoRA's layers: the adapted linear layer, the grouped experts' adapters and their delta, adapter names.

The pieces the model code itself calls (`moe_block.Experts` runs `grouped_delta` beside its base path;
`state_dict` tells adapters apart with `is_adapter`), kept apart from `lora`, which adds, seeds and merges
adapters over a whole model, so that the model modules and `lora` import each other in one direction only.

`LoraLinear` is ``nn.Linear`` with its ``weight`` and ``bias`` (names, loading and export unchanged) plus
``lora_A (r, in)`` and ``lora_B (out, r)``. Grouped experts get, per stacked weight (``w1_EFD``, ``w3_EFD``,
``w2_EDF``), ``<weight>_lora_A (E, r, in)`` and ``<weight>_lora_B (E, out, r)`` (`add_expert_adapters`);
`grouped_delta` applies all experts' deltas at once: torch's grouped GEMM on CUDA; on the CPU (where the base
loops over experts exactly and torch's grouped GEMM has no backward) one matmul against every expert's ``A``
stacked, each row keeping its own expert's ``r`` columns, then one against every ``B``.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EXPERT_WEIGHTS", "LoraLinear", "add_expert_adapters", "grouped_delta", "is_adapter"]

EXPERT_WEIGHTS = ("w1_EFD", "w3_EFD", "w2_EDF")
"""The grouped experts' stacked weights (``E, out, in``) that get adapters (non-gated experts have no w3)."""

_ADAPTER = re.compile(r"(^|[._])lora_[AB]$")


def is_adapter(name: str) -> bool:
    """Whether a parameter or state-dict name is an adapter's (``...lora_A`` / ``...lora_B``)."""
    return bool(_ADAPTER.search(name))


class LoraLinear(nn.Linear):
    """``nn.Linear`` plus ``scale * B (A (dropout x))``; made from an existing layer by `LoraLinear.wrap`."""

    lora_scale: float
    lora_dropout: nn.Module

    @classmethod
    def wrap(cls, linear: nn.Linear, *, rank: int, scale: float, dropout: float) -> LoraLinear:
        """The layer's own weight and bias, adapters of ``rank`` beside them (float32, ``B`` zero)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight, module.bias = linear.weight, linear.bias
        device = linear.weight.device
        module.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, device=device, dtype=torch.float32))
        module.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=device, dtype=torch.float32))
        module.lora_scale = scale
        module.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        return module

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's output for ``x`` (what `forward` adds to the base's)."""
        a, b = self.lora_A, self.lora_B
        if not torch.is_autocast_enabled(x.device.type):
            a, b = a.to(x.dtype), b.to(x.dtype)
        return F.linear(F.linear(self.lora_dropout(x), a), b) * self.lora_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_delta(x)


def grouped_delta(experts: nn.Module, weight: str, x_RI: torch.Tensor,
                  counts_E: torch.Tensor) -> torch.Tensor | None:
    """``scale * B_e A_e x`` for each row of ``x_RI`` (rows grouped by expert, ``counts_E`` per expert), for the
    stacked ``weight`` of ``experts``; None when that weight has no adapter."""
    a_ErI = getattr(experts, weight + "_lora_A", None)
    if a_ErI is None:
        return None
    b_EOr = getattr(experts, weight + "_lora_B")
    x_RI = experts.lora_dropout(x_RI)
    if x_RI.is_cuda:  # torch's grouped GEMM, in bf16 as the base's
        offsets = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        z = torch._grouped_mm(x_RI.bfloat16(), a_ErI.bfloat16().transpose(-2, -1), offs=offsets)
        out = torch._grouped_mm(z, b_EOr.bfloat16().transpose(-2, -1), offs=offsets)
        return out.type_as(x_RI) * experts.lora_scale
    experts_E, rank, width = a_ErI.shape
    dtype = x_RI.dtype if not torch.is_autocast_enabled(x_RI.device.type) else a_ErI.dtype
    expert_R = torch.repeat_interleave(torch.arange(experts_E, device=x_RI.device), counts_E.to(x_RI.device),
                                       output_size=x_RI.shape[0])
    z_REr = F.linear(x_RI, a_ErI.to(dtype).reshape(experts_E * rank, width)).view(-1, experts_E, rank)
    own_RE = F.one_hot(expert_R, experts_E).to(z_REr.dtype)
    z_RF = (z_REr * own_RE[:, :, None]).reshape(-1, experts_E * rank)  # each row keeps its own expert's r columns
    b_OF = b_EOr.to(dtype).permute(1, 0, 2).reshape(b_EOr.shape[1], experts_E * rank)
    return F.linear(z_RF, b_OF) * experts.lora_scale


def add_expert_adapters(experts: nn.Module, *, rank: int, scale: float, dropout: float) -> None:
    """Adapters of ``rank`` (float32, ``B`` zero) beside each stacked weight of a grouped-experts module."""
    for weight in EXPERT_WEIGHTS:
        base = getattr(experts, weight, None)
        if base is None:
            continue
        count, out, width = base.shape
        setattr(experts, weight + "_lora_A",
                nn.Parameter(torch.empty(count, rank, width, device=base.device, dtype=torch.float32)))
        setattr(experts, weight + "_lora_B",
                nn.Parameter(torch.zeros(count, out, rank, device=base.device, dtype=torch.float32)))
    experts.lora_scale = scale
    experts.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
