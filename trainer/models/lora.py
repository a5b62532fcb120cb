"""LoRA adapters inside the trainer's MoE models: attention, routed experts, shared experts.

`add_adapters(model, rank=..., ...)` adds, in place, a low-rank delta ``scale * B A`` (``scale =
alpha / rank``) beside each targeted weight and freezes every other parameter:

* linear layers (the attention projections, the shared experts' projections) become
  `lora_layers.LoraLinear` (the same ``nn.Linear`` plus ``lora_A`` and ``lora_B``);
* grouped experts (`moe_block.Experts`, `moe_block.ReluSquaredExperts`) get adapters per stacked weight
  (`lora_layers.add_expert_adapters`), applied as the experts run by `lora_layers.grouped_delta`.

``B`` starts at zero, so the adapted model's first forward equals the base's bit for bit; ``A`` is
seeded (`init_adapters`, PEFT's Kaiming-uniform). Adapters are float32 whatever the base's dtype.
Every adapter parameter's name ends in ``lora_A`` or ``lora_B`` (`is_adapter`); `merge_adapters`
folds them into a full state dict (the full-weight export and pushes of a LoRA run).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from agentrl.trainer.models.build import build_model
from agentrl.trainer.models.common import Attention
from agentrl.trainer.models.lora_layers import EXPERT_WEIGHTS, LoraLinear, add_expert_adapters, is_adapter
from agentrl.trainer.models.mla import MLAttention
from agentrl.trainer.models.moe_block import Experts, MoEBlock
from agentrl.trainer.models.state_dict import copy_into_shard

__all__ = ["adapter_param_count", "add_adapters", "adapted_weights", "init_adapters", "merge_adapters"]

def _linear_children(module: nn.Module) -> Iterable[tuple[str, nn.Linear]]:
    return [(name, child) for name, child in module.named_children() if isinstance(child, nn.Linear)]


def add_adapters(model: nn.Module, *, rank: int, alpha: float, dropout: float, targets: Iterable[str]) -> list[str]:
    """Adapters on the ``targets`` ("attention", "experts", "shared_experts") of a decoder, every other parameter
    frozen (see the module docstring); returns the adapted base weights' names. Before FSDP and EP."""

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
            add_expert_adapters(module, rank=rank, scale=scale, dropout=dropout)
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
    model = build_model(args, device="meta")  # type: ignore[arg-type]
    add_adapters(model, rank=rank, alpha=float(rank), dropout=0.0, targets=targets)
    return sum(param.numel() for name, param in model.named_parameters() if is_adapter(name))


def init_adapters(model: nn.Module, *, seed: int) -> None:
    """``A`` Kaiming-uniform (PEFT's default, per expert for stacked ones) from ``seed``, ``B`` zero; the same
    full values on every rank, each rank copying its own shard (FSDP's dim-0 chunks)."""
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
