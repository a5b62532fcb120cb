"""LoRA adapters inside the trainer's MoE models: attention, routed experts, shared experts.

`add_adapters(model, rank=..., ...)` adds, in place, a low-rank delta ``scale * B A`` (``scale =
alpha / rank``) beside each targeted weight and freezes every other parameter:

* linear layers (the attention projections, the shared experts' projections) become `LoraLinear`:
  the same ``nn.Linear`` with its ``weight`` and ``bias`` (so their names, loading and export are
  unchanged) plus ``lora_A (r, in)`` and ``lora_B (out, r)``;
* grouped experts (`common.Experts`, `common.ReluSquaredExperts`) get, per stacked weight
  (``w1_EFD``, ``w3_EFD``, ``w2_EDF``), ``<weight>_lora_A (E, r, in)`` and ``<weight>_lora_B (E, out, r)``.
  `grouped_delta` applies all experts' deltas at once, beside the base path and as it runs: torch's
  grouped GEMM on CUDA; on the CPU (where the base loops over experts exactly and torch's grouped GEMM
  has no backward) one matmul against every expert's ``A`` stacked, each row keeping its own expert's
  ``r`` columns, then one against every ``B``: no per-expert Python loop.

``B`` starts at zero, so the adapted model's first forward equals the base's bit for bit; ``A`` is
seeded (`init_adapters`, PEFT's Kaiming-uniform). Adapters are float32 whatever the base's dtype.
Every adapter parameter's name ends in ``lora_A`` or ``lora_B`` (`is_adapter`); `merge_adapters`
folds them into a full state dict (the full-weight export and pushes of a LoRA run).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoraLinear", "adapter_param_count", "trainable_param_count", "add_adapters", "adapted_weights",
           "grouped_delta", "init_adapters", "is_adapter", "merge_adapters", "EXPERT_WEIGHTS"]

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


def _add_expert_adapters(experts: nn.Module, *, rank: int, scale: float, dropout: float) -> None:
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


def _linear_children(module: nn.Module) -> Iterable[tuple[str, nn.Linear]]:
    return [(name, child) for name, child in module.named_children() if isinstance(child, nn.Linear)]


def add_adapters(model: nn.Module, *, rank: int, alpha: float, dropout: float, targets: Iterable[str]) -> list[str]:
    """Adapters on the ``targets`` ("attention", "experts", "shared_experts") of a decoder, every other parameter
    frozen (see the module docstring); returns the adapted base weights' names. Before FSDP and EP."""
    from agentrl.trainer.models.common import Attention, Experts, MoEBlock
    from agentrl.trainer.models.mla import MLAttention

    targets = set(targets)
    scale = alpha / rank
    for param in model.parameters():
        param.requires_grad_(False)
    adapted: list[str] = []
    for name, module in list(model.named_modules()):
        linears: list[tuple[str, nn.Linear]] = []
        if "attention" in targets and isinstance(module, (Attention, MLAttention)):
            linears = list(_linear_children(module))
        elif "shared_experts" in targets and isinstance(module, MoEBlock) and module.shared_experts is not None:
            linears = [(f"shared_experts.{child}", layer) for child, layer in _linear_children(module.shared_experts)]
        elif "experts" in targets and isinstance(module, Experts):
            _add_expert_adapters(module, rank=rank, scale=scale, dropout=dropout)
            adapted += [f"{name}.{w}" for w in EXPERT_WEIGHTS if hasattr(module, w)]
        for child, layer in linears:
            parent = module.get_submodule(child.rsplit(".", 1)[0]) if "." in child else module
            setattr(parent, child.rsplit(".", 1)[-1], LoraLinear.wrap(layer, rank=rank, scale=scale, dropout=dropout))
            adapted.append(f"{name}.{child}.weight")
    if not adapted:
        raise ValueError(f"trainer.lora.targets={sorted(targets)}: this model has none of them")
    return adapted


def adapter_param_count(args: object, *, rank: int, targets: Iterable[str]) -> int:
    """Adapter parameters `add_adapters` gives a model of ``args`` (a `MoEModelArgs`): counted on a copy built on
    the meta device (no memory, any size), so the memory planner and the trainer agree by construction."""
    from agentrl.trainer.models.build import build_model

    model = build_model(args, device="meta")  # type: ignore[arg-type]
    add_adapters(model, rank=rank, alpha=float(rank), dropout=0.0, targets=targets)
    return sum(param.numel() for name, param in model.named_parameters() if is_adapter(name))


def trainable_param_count(args: object, lora: object | None) -> int | None:
    """What the memory plan trains: None (every parameter) without ``lora`` (a `LoraConfig`), else its adapters'
    count (`adapter_param_count`)."""
    if lora is None:
        return None
    return adapter_param_count(args, rank=lora.rank, targets=lora.targets)  # type: ignore[attr-defined]


def init_adapters(model: nn.Module, *, seed: int) -> None:
    """``A`` Kaiming-uniform (PEFT's default, per expert for stacked ones) from ``seed``, ``B`` zero; the same
    full values on every rank, each rank copying its own shard (FSDP's dim-0 chunks)."""
    from agentrl.trainer.models.state_dict import copy_into_shard

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter(name):
                continue
            shape = tuple(param.shape)
            full = torch.zeros(shape, dtype=torch.float32)
            if name.endswith("lora_A"):
                bound = 1.0 / math.sqrt(shape[-1])  # kaiming_uniform_(a=sqrt(5)) on an (r, in) matrix
                full.uniform_(-bound, bound, generator=generator)
            copy_into_shard(param, full, name=name)


def adapted_weights(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """Base weight name -> (its ``A`` name, its ``B`` name), for every adapter in a state dict."""
    pairs: dict[str, tuple[str, str]] = {}
    for key in state:
        if key.endswith("lora_A"):
            stem = key[: -len("lora_A")]
            base = stem[:-1] + ".weight" if stem.endswith(".") else stem[:-1]  # "q_proj." / "w1_EFD_"
            pairs[base] = (key, stem + "lora_B")
    return pairs


def merge_adapters(state: Mapping[str, torch.Tensor], *, scale: float) -> dict[str, torch.Tensor]:
    """The state dict with each adapted weight replaced by ``W + scale * B @ A`` (batched over experts, in float32,
    back in ``W``'s dtype) and the adapters left out."""
    merged = {key: value for key, value in state.items() if not is_adapter(key)}
    for base, (a_name, b_name) in adapted_weights(state).items():
        weight = merged[base]
        delta = torch.matmul(state[b_name].float(), state[a_name].float()) * scale
        merged[base] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return merged
