"""Staging a policy's weights for a server: HF-named tensors written as one safetensors folder, atomically,
and the names and shapes of an update checked against the served checkpoint before any server is touched."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentrl.errors import WeightUpdateError, require


def save_state_dict(state_dict: Mapping[str, Any], folder: Path) -> Path:
    """Write HF-named tensors as `folder/model.safetensors` atomically; return the folder."""
    require("torch", "cpu")
    from safetensors.torch import save_file

    if not state_dict:
        raise WeightUpdateError("publish: the state dict is empty; pass the model's HF-named tensors")
    tensors = {}
    for name, tensor in state_dict.items():
        if not hasattr(tensor, "detach"):
            raise WeightUpdateError(f"publish: state dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        full = getattr(tensor, "full_tensor", None)  # FSDP DTensor shards gather here
        tensors[name] = (full() if callable(full) else tensor).detach().to("cpu").contiguous()
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / "model.safetensors"))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors checkpoint folder (headers only, no data read)."""
    require("safetensors", "cpu")
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def check_weights_match(new: dict[str, tuple[int, ...]], served: dict[str, tuple[int, ...]], *, source: str) -> None:
    """Raise a one-line error when `new` has a name or shape the served checkpoint lacks.

    vLLM loads weights layer by layer in place; a wrong name or shape fails half-way and
    leaves the engine unusable, so mismatches are caught before the server is touched.
    """
    unknown = sorted(set(new) - set(served))
    if unknown:
        raise WeightUpdateError(
            f"publish: {len(unknown)} tensor name(s) from {source} are not in the served model,"
            f" e.g. {unknown[0]!r}; use the HF checkpoint names"
        )
    for name, shape in new.items():
        if tuple(served[name]) != tuple(shape):
            raise WeightUpdateError(
                f"publish: {name!r} from {source} has shape {list(shape)}, the served model has {list(served[name])}"
            )
