"""Hugging Face <-> trainer names for ``nemotron_h`` checkpoints (lossless both ways).

The hub layout (what NVIDIA publishes, what transformers' ``save_pretrained`` writes and vLLM
loads) prefixes everything with ``backbone.``, names the embedding ``embeddings`` and the final
norm ``norm_f``, and stores each routed expert's ``up_proj`` / ``down_proj`` separately; the
router is ``mixer.gate`` (``weight``, ``e_score_correction_bias``). transformers 5's in-memory
layout (``model.`` prefix, experts fused into ``mixer.experts.up_proj`` / ``down_proj`` of shape
(E, F, D) / (E, D, F)) is read too. The trainer keeps the mixer names and stacks experts into
torchtitan's ``w1_EFD`` (up) and ``w2_EDF`` (down). Multi-token-prediction tensors (``mtp.*``)
are not trained here and are skipped on load. The state-dict adapter (`family.StateDictAdapter`)
of the ``nemotron_h`` family (`families.nemotron_h`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from agentrl.errors import AgentrlError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.decoder_weights import split_experts, stack_experts
from agentrl.trainer.models.family import CheckpointTensors

__all__ = ["hf_to_native", "native_to_hf", "read_native", "expert_key", "hf_prefix"]

_LAYER = re.compile(r"^(?:backbone|model)\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mixer\.experts\.(\d+)\.(up_proj|down_proj)\.weight$")
_EXPERT_PARAM = {"up_proj": "w1_EFD", "down_proj": "w2_EDF"}
_ROUTER = {"mixer.gate.weight": "mixer.router.gate.weight", "mixer.gate.e_score_correction_bias": "mixer.expert_bias"}
_TOP = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}


def hf_prefix(keys) -> str:
    """``model.`` for transformers' in-memory names, else the hub's ``backbone.``."""
    return "model." if any(key.startswith("model.") for key in keys) else "backbone."


def expert_key(prefix: str, layer: int | str, expert: int, proj: str) -> str:
    return f"{prefix}layers.{layer}.mixer.experts.{expert}.{proj}.weight"


def hf_to_native(hf: Mapping[str, torch.Tensor], args: MoEModelArgs) -> dict[str, torch.Tensor]:
    """Map HF names/layouts to the trainer's; raises on tensors a nemotron_h model does not have."""
    native: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for key, tensor in hf.items():
        top = key.split(".", 1)[1] if key.startswith(("backbone.", "model.")) else None
        if key == "lm_head.weight":
            if not args.tie_word_embeddings:
                native[key] = tensor
        elif key.startswith("mtp."):
            continue  # multi-token prediction: not trained here
        elif top in _TOP:
            native[_TOP[top]] = tensor
        elif match := _LAYER.match(key):
            layer, rest = int(match.group(1)), match.group(2)
            if layer >= args.num_hidden_layers:
                continue
            prefix = f"layers.{layer}."
            if expert := _EXPERT.match(rest):
                experts.setdefault((layer, expert.group(2)), {})[int(expert.group(1))] = tensor
            elif rest in ("mixer.experts.up_proj", "mixer.experts.down_proj"):  # transformers 5 fused (E, ., .)
                native[prefix + "mixer.experts." + _EXPERT_PARAM[rest.rsplit(".", 1)[1]]] = tensor
            elif rest in _ROUTER:
                native[prefix + _ROUTER[rest]] = tensor
            elif rest == "norm.weight" or rest.startswith("mixer."):
                native[prefix + rest] = tensor
            else:
                raise AgentrlError(f"HF tensor {key!r} is not part of a nemotron_h model; check config.json")
        else:
            raise AgentrlError(f"HF tensor {key!r} is not part of a nemotron_h model; check config.json")
    stack_experts(native, experts, args, lambda layer, proj: f"layers.{layer}.mixer.experts.{_EXPERT_PARAM[proj]}")
    return native


def native_to_hf(native: Mapping[str, torch.Tensor], args: MoEModelArgs, *,
                 contiguous: bool = True) -> dict[str, torch.Tensor]:
    """The trainer's state dict under hub names (per-expert tensors: copies, or views without `contiguous`)."""
    top = {v: k for k, v in _TOP.items()}
    router = {v: k for k, v in _ROUTER.items()}
    proj_of = {v: k for k, v in _EXPERT_PARAM.items()}
    hf: dict[str, torch.Tensor] = {}
    for key, tensor in native.items():
        if key == "lm_head.weight":
            if not args.tie_word_embeddings:
                hf[key] = tensor
        elif key in top:
            hf["backbone." + top[key]] = tensor
        elif key.startswith("layers."):
            _, layer, rest = key.split(".", 2)
            prefix = f"backbone.layers.{layer}."
            if rest.startswith("mixer.experts.w"):
                proj = proj_of[rest.rsplit(".", 1)[1]]
                split_experts(
                    hf,
                    tensor,
                    lambda index, layer=layer, proj=proj: expert_key("backbone.", layer, index, proj),
                    contiguous=contiguous,
                )
            elif rest in router:
                hf[prefix + router[rest]] = tensor.float() if rest == "mixer.expert_bias" else tensor
            else:
                hf[prefix + rest] = tensor
        else:
            raise AgentrlError(f"trainer tensor {key!r} has no Hugging Face name")
    return hf


def read_native(checkpoint: CheckpointTensors, name: str, args: MoEModelArgs, *,
                expert_range: tuple[int, int] | None = None) -> torch.Tensor:
    """The trainer tensor ``name`` from a hub or transformers-layout checkpoint (experts: ``expert_range``)."""
    prefix = hf_prefix(checkpoint.keys())
    if ".mixer.experts.w" in name:
        _, layer, _ = name.split(".", 2)
        lo, hi = expert_range or (0, args.num_experts)
        proj = "up_proj" if name.endswith("w1_EFD") else "down_proj"
        if expert_key(prefix, layer, lo, proj) in checkpoint:
            return torch.stack([checkpoint.get(expert_key(prefix, layer, e, proj)) for e in range(lo, hi)])
        return checkpoint.get(f"{prefix}layers.{layer}.mixer.experts.{proj}")[lo:hi]
    (hf_name,) = native_to_hf({name: torch.empty(0)}, args).keys()
    if hf_name not in checkpoint:
        hf_name = prefix + hf_name.split(".", 1)[1]  # transformers' names
    return checkpoint.get(hf_name)
