"""One model family as data: what the trainer needs to read, build and save a model of one architecture.

A `Family` is a row of the family table (`agentrl.trainer.models.families`), keyed by its
``model_type``:

* ``args_from_hf``: a Hugging Face ``config.json`` dict -> the `MoEModelArgs` fields (torch-free, so
  the layout planner reads configs without torch);
* ``decoder``: the ``torch.nn.Module`` class `build.build_model` builds (``"module:Class"``, imported
  only when a model is built, or the class itself);
* ``weights``: the state-dict adapter (`StateDictAdapter`): HF tensor names <-> the trainer's, both
  ways, and one trainer tensor read lazily from a checkpoint (``"module"`` or the adapter itself).

The torch parts are named by import path, as vLLM's model registry names its model classes, so the
table and everything that plans from it import without torch. `transformer_fields` holds the
``config.json`` keys the transformer families spell alike.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from agentrl.trainer.models.args import MoEModelArgs

__all__ = ["Family", "StateDictAdapter", "CheckpointTensors", "transformer_fields"]


class CheckpointTensors(Protocol):
    """A checkpoint's tensors by HF name, read one at a time (`state_dict.HFCheckpointReader`)."""

    def __contains__(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def get(self, key: str) -> torch.Tensor: ...


class StateDictAdapter(Protocol):
    """HF names and layouts <-> the trainer's, for one family (lossless both ways)."""

    def hf_to_native(self, hf: Mapping[str, torch.Tensor], args: MoEModelArgs) -> dict[str, torch.Tensor]:
        """The trainer's state dict from HF tensors; raises on a tensor the family does not have."""
        ...

    def native_to_hf(self, native: Mapping[str, torch.Tensor], args: MoEModelArgs, *,
                     contiguous: bool = True) -> dict[str, torch.Tensor]:
        """HF hub names of the trainer's tensors (per-expert tensors: copies, or views without `contiguous`)."""
        ...

    def read_native(self, checkpoint: CheckpointTensors, name: str, args: MoEModelArgs, *,
                    expert_range: tuple[int, int] | None = None) -> torch.Tensor:
        """The trainer tensor ``name`` read from ``checkpoint`` (stacked experts: only ``expert_range``)."""
        ...


def _resolve(target: Any) -> Any:
    """``"module:attr"`` -> that attribute, ``"module"`` -> that module, anything else as it is."""
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded


@dataclass(frozen=True, kw_only=True)
class Family:
    """One row of the family table (see the module docstring)."""

    model_type: str
    """The family's name: a ``config.json`` ``model_type`` and `MoEModelArgs.model_type` of its models."""
    args_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    """``config.json`` dict -> `MoEModelArgs` keyword arguments (``model_type`` included); torch-free."""
    decoder: str | type
    """The model class (``"module:Class"`` or the class); it is called with the `MoEModelArgs`."""
    weights: str | StateDictAdapter
    """The state-dict adapter (a module path, or an object with the `StateDictAdapter` methods)."""
    config_types: tuple[str, ...] = ()
    """Other ``config.json`` ``model_type`` values read as this family (Kimi-K2's ``kimi_k2``)."""
    architectures: tuple[str, ...] = ()
    """``config.json`` ``architectures`` entries that select this family whatever the model_type says."""

    def decoder_class(self) -> type:
        """The model class (imports torch)."""
        return _resolve(self.decoder)

    def adapter(self) -> StateDictAdapter:
        """The state-dict adapter (imports torch)."""
        return _resolve(self.weights)


def transformer_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The `MoEModelArgs` fields the transformer families (GLM-4.5, Qwen3-MoE, DeepSeek-V3) read alike."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    rope = config.get("rope_parameters") or {}
    return {
        "vocab_size": int(config["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(config.get("intermediate_size", 0)),
        "moe_intermediate_size": int(config["moe_intermediate_size"]),
        "num_hidden_layers": int(config["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "top_k": int(config["num_experts_per_tok"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "attention_bias": bool(config.get("attention_bias", False)),
    }


def partial_rotary_factor(config: dict[str, Any]) -> float:
    """The share of each head RoPE rotates (``partial_rotary_factor``, 1.0 when absent)."""
    rope = config.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
