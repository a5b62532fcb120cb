"""The trainer's tensors in the layout vLLM serves them in ("kernel format"), for weight updates that copy.

A checkpoint-format update hands vLLM one tensor per checkpoint name (for a deep MoE, 128 experts x 3 matrices a
layer: glm-air-deep sends 17,925 tensors) and vLLM's `load_weights` places each into its fused parameter, layer by
layer; that placing is most of an update's time. vLLM 0.24's weight-transfer engines also take tensors already in
the served layout (`/start_weight_update` with `is_checkpoint_format=false`), which each worker copies straight in
(`param.copy_(tensor)`). `KernelLayout` says how every served parameter is made from the trainer's tensors,
following vLLM's own fusion (the names `weight_check.served_group` maps):

- `qkv_proj` = q, k, v (weights and biases) and `gate_up_proj` = gate, up, concatenated on the first dimension;
- routed experts: `w13_weight` (experts, 2 x intermediate, hidden) = each expert's gate over its up, stacked;
  `w2_weight` (experts, hidden, intermediate) = each expert's down, stacked;
- every other parameter as it is.

The layout is made once from the served parameters' names and element counts (the weight check's digest) and the
trainer's tensor names; a served parameter no tensor makes, or a tensor that fits no parameter, is refused in one
line. Unquantized bf16/fp32 servers only: an FP8 server re-quantizes after an update, which a copy does not.
torch is imported by `pack` alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from agentrl.errors import WeightUpdateError
from agentrl.inference.weight_check import group_by_served

__all__ = ["KernelLayout", "PackedTensors", "kernel_layout"]

_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_ORDER = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}


@dataclass(frozen=True)
class _Part:
    served: str
    kind: str
    """"same", "cat" (concatenated on dim 0), "w13" or "w2" (stacked experts)."""
    sources: tuple[str, ...]
    """Trainer tensor names, in the order they are joined (experts: by index; w13: gate, up per expert)."""


class KernelLayout:
    """How each served parameter is made from the trainer's tensors (see the module docstring)."""

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return len(self.parts)

    def pack(self, tensors: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        """(served name, tensor) for every served parameter, made from `tensors` (the trainer's, by name)."""
        for part in self.parts:
            yield part.served, _packed(part, tensors)

    def tensors(self, tensors: Mapping[str, Any], *, wire_dtype: Callable[[Any], Any] | None = None) -> PackedTensors:
        """The served parameters as a mapping that packs each one only when it is read (one at a time in memory);
        with `wire_dtype` (tensor -> dtype), a fused tensor is made in that dtype straight from the sources (a layer's
        experts are gigabytes: no full-precision copy of them is made on the way)."""
        return PackedTensors(self, tensors, wire_dtype=wire_dtype)


def _packed(part: _Part, tensors: Mapping[str, Any], *, wire_dtype: Callable[[Any], Any] | None = None) -> Any:
    """One served parameter from its sources, written into one new tensor (in `wire_dtype`'s dtype if given)."""
    import torch

    sources = [tensors[name] for name in part.sources]
    if part.kind == "same":
        return sources[0]
    if part.kind == "cat":
        shape = (sum(source.shape[0] for source in sources), *sources[0].shape[1:])
    elif part.kind == "w13":
        shape = (len(sources) // 2, 2 * sources[0].shape[0], *sources[0].shape[1:])
    else:  # w2
        shape = (len(sources), *sources[0].shape)
    dtype = wire_dtype(sources[0]) if wire_dtype is not None else sources[0].dtype
    out = torch.empty(shape, dtype=dtype, device=sources[0].device)
    if part.kind == "cat":
        torch.cat(sources, dim=0, out=out) if dtype == sources[0].dtype else _fill_rows(out, sources)
    elif part.kind == "w13":
        rows = sources[0].shape[0]
        for expert, (gate, up) in enumerate(zip(sources[0::2], sources[1::2], strict=True)):
            out[expert, :rows].copy_(gate)
            out[expert, rows:].copy_(up)
    else:
        for expert, down in enumerate(sources):
            out[expert].copy_(down)
    return out


def _fill_rows(out: Any, sources: list[Any]) -> None:
    start = 0
    for source in sources:
        out[start: start + source.shape[0]].copy_(source)
        start += source.shape[0]


class PackedTensors(Mapping):
    """{served name: tensor}, each packed from the trainer's tensors when it is read; `numel_and_dims` without
    packing (what a transport sizes its buffers by)."""

    def __init__(self, layout: KernelLayout, tensors: Mapping[str, Any], *,
                 wire_dtype: Callable[[Any], Any] | None = None) -> None:
        self._parts = {part.served: part for part in layout.parts}
        self._tensors = tensors
        self._wire_dtype = wire_dtype

    def __getitem__(self, name: str) -> Any:
        return _packed(self._parts[name], self._tensors, wire_dtype=self._wire_dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)

    def numel_and_dims(self) -> Iterator[tuple[int, int]]:
        """(elements, dimensions) of each packed tensor, in order."""
        for part in self._parts.values():
            sources = [self._tensors[name] for name in part.sources]
            dims = sources[0].dim() + (1 if part.kind in ("w13", "w2") else 0)
            yield sum(source.numel() for source in sources), dims


def _order(name: str) -> tuple[int, int]:
    expert = _EXPERT.search(name)
    if expert:
        return int(expert.group(1)), _ORDER.get(expert.group(2), 0)
    last = name.rsplit(".", 2)[-2]
    return 0, _ORDER.get(last, 0)


def kernel_layout(trainer_names: list[str], served: Mapping[str, list[Any]]) -> KernelLayout:
    """The layout for a server whose parameters are `served` ({name: [dtype, numel, ...]}, the weight check's
    digest) and a trainer that sends `trainer_names` (checkpoint names)."""
    groups, unplaced = group_by_served(trainer_names, served)
    missing = [name for name in served if name not in groups]
    if missing:
        raise WeightUpdateError(f"kernel-format weights: no trainer tensor makes the served parameter {missing[0]}"
                                f" ({len(missing)} such); use the checkpoint format (inference.weight_format)")
    if unplaced:
        raise WeightUpdateError(f"kernel-format weights: the trainer tensor {unplaced[0]} fits no served parameter"
                                f" ({len(unplaced)} such); use the checkpoint format (inference.weight_format)")
    parts = []
    for served_name, names in groups.items():
        names = sorted(names, key=_order)
        if served_name.endswith("w13_weight"):
            kinds = [_EXPERT.search(name).group(2) for name in names]
            if len(names) % 2 or any(kind not in ("gate_proj", "w1") for kind in kinds[0::2]) or \
                    any(kind not in ("up_proj", "w3") for kind in kinds[1::2]):
                raise WeightUpdateError(f"kernel-format weights: {served_name} needs each expert's gate and up "
                                        f"projections, got {len(names)} tensors ({names[0]} ..)")
            parts.append(_Part(served_name, "w13", tuple(names)))
        elif served_name.endswith("w2_weight"):
            parts.append(_Part(served_name, "w2", tuple(names)))
        elif len(names) > 1:
            parts.append(_Part(served_name, "cat", tuple(names)))
        else:
            parts.append(_Part(served_name, "same", (names[0],)))
    return KernelLayout(parts)
