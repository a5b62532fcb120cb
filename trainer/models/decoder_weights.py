"""Hugging Face <-> trainer names for `common.MoEDecoder` and `mla.MLADecoder` (GLM-4.5, Qwen3-MoE, DeepSeek-V3).

The state-dict adapter (`family.StateDictAdapter`) of the transformer families, lossless both
ways: HF names are ``model.layers.N.<module>``; the trainer's drop the ``model.`` prefix, name the
router ``mlp.router.gate`` and its correction bias ``mlp.expert_bias``, name the SwiGLU matrices
``w1`` (gate_proj), ``w3`` (up_proj), ``w2`` (down_proj), and stack the per-expert matrices into
torchtitan's grouped layout (``w1_EFD``, ``w3_EFD``, ``w2_EDF``). The fused in-memory layout of
transformers 5 (``experts.gate_up_proj``) is read too. Extra layers past ``num_hidden_layers``
(GLM-4.5's multi-token-prediction layer) are skipped on load. `stack_experts` and `split_experts`
serve the other adapters as well.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from agentrl.errors import AgentrlError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.family import CheckpointTensors

__all__ = ["hf_to_native", "native_to_hf", "read_native", "stack_experts", "split_experts"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_DENSE_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_PARAM = {"gate_proj": "w1_EFD", "up_proj": "w3_EFD", "down_proj": "w2_EDF"}


def hf_to_native(hf: Mapping[str, torch.Tensor], args: MoEModelArgs) -> dict[str, torch.Tensor]:
    """Map HF names/layouts to the trainer's; raises on missing or unexpected tensors."""
    native: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    moe_layers = set(args.moe_layers)
    for key, tensor in hf.items():
        if key == "model.embed_tokens.weight":
            native["embed_tokens.weight"] = tensor
        elif key == "model.norm.weight":
            native["norm.weight"] = tensor
        elif key == "lm_head.weight":
            if not args.tie_word_embeddings:
                native["lm_head.weight"] = tensor
        elif match := _LAYER.match(key):
            layer, rest = int(match.group(1)), match.group(2)
            if layer >= args.num_hidden_layers:
                continue  # multi-token-prediction layers are not trained here
            prefix = f"layers.{layer}."
            if rest.startswith(("self_attn.", "input_layernorm.", "post_attention_layernorm.")):
                native[prefix + rest] = tensor
            elif expert := _EXPERT.match(rest):
                experts.setdefault((layer, expert.group(2)), {})[int(expert.group(1))] = tensor
            elif rest == "mlp.experts.gate_up_proj":  # transformers 5 fused layout (E, 2F, D)
                gate, up = tensor.chunk(2, dim=1)
                native[prefix + "mlp.experts.w1_EFD"], native[prefix + "mlp.experts.w3_EFD"] = gate, up
            elif rest == "mlp.experts.down_proj":
                native[prefix + "mlp.experts.w2_EDF"] = tensor
            elif rest == "mlp.gate.weight":
                native[prefix + "mlp.router.gate.weight"] = tensor
            elif rest == "mlp.gate.e_score_correction_bias":
                native[prefix + "mlp.expert_bias"] = tensor
            elif rest.startswith("mlp.shared_experts.") or (layer not in moe_layers and rest.startswith("mlp.")):
                parts = rest.split(".")  # mlp[.shared_experts].<proj>.weight
                native[prefix + ".".join(parts[:-2] + [_DENSE_MLP[parts[-2]], parts[-1]])] = tensor
            else:
                raise AgentrlError(f"HF tensor {key!r} is not part of a {args.model_type} model; check config.json")
        else:
            raise AgentrlError(f"HF tensor {key!r} is not part of a {args.model_type} model; check config.json")
    stack_experts(native, experts, args, lambda layer, proj: f"layers.{layer}.mlp.experts.{_EXPERT_PARAM[proj]}")
    return native


def stack_experts(native: dict[str, torch.Tensor], experts: Mapping[tuple[int, str], Mapping[int, torch.Tensor]],
                  args: MoEModelArgs, name_of) -> None:
    """Stack per-expert HF tensors ``experts[(layer, proj)][index]`` into ``native[name_of(layer, proj)]``."""
    for (layer, proj), by_index in experts.items():
        if sorted(by_index) != list(range(args.num_experts)):
            raise AgentrlError(
                f"layer {layer} {proj}: found experts {len(by_index)} of {args.num_experts}; "
                "the checkpoint is incomplete"
            )
        native[name_of(layer, proj)] = torch.stack([by_index[i] for i in range(args.num_experts)])


def split_experts(hf: dict[str, torch.Tensor], tensor: torch.Tensor, key_of, *, contiguous: bool) -> None:
    """One HF tensor per expert of a stacked ``(E, ...)`` tensor, named ``key_of(index)`` (copies or views)."""
    for index in range(tensor.shape[0]):
        view = tensor[index]
        hf[key_of(index)] = view.contiguous() if contiguous else view


def native_to_hf(native: Mapping[str, torch.Tensor], args: MoEModelArgs, *,
                 contiguous: bool = True) -> dict[str, torch.Tensor]:
    """Map the trainer's state dict to HF hub names (per-expert tensors: copies, or views without `contiguous`)."""
    inverse_dense = {v: k for k, v in _DENSE_MLP.items()}
    inverse_expert = {v: k for k, v in _EXPERT_PARAM.items()}
    hf: dict[str, torch.Tensor] = {}
    for key, tensor in native.items():
        if key == "embed_tokens.weight":
            hf["model.embed_tokens.weight"] = tensor
        elif key == "norm.weight":
            hf["model.norm.weight"] = tensor
        elif key == "lm_head.weight":
            if not args.tie_word_embeddings:
                hf["lm_head.weight"] = tensor
        elif key.startswith("layers."):
            _, layer, rest = key.split(".", 2)
            prefix = f"model.layers.{layer}."
            if rest.startswith("mlp.experts."):
                proj = inverse_expert[rest.rsplit(".", 1)[1]]
                split_experts(
                    hf,
                    tensor,
                    lambda index, prefix=prefix, proj=proj: f"{prefix}mlp.experts.{index}.{proj}.weight",
                    contiguous=contiguous,
                )
            elif rest == "mlp.router.gate.weight":
                hf[prefix + "mlp.gate.weight"] = tensor
            elif rest == "mlp.expert_bias":
                hf[prefix + "mlp.gate.e_score_correction_bias"] = tensor.float()
            elif rest.startswith("mlp.") and rest.split(".")[-2] in inverse_dense:
                parts = rest.split(".")
                hf[prefix + ".".join(parts[:-2] + [inverse_dense[parts[-2]], parts[-1]])] = tensor
            else:
                hf[prefix + rest] = tensor
        else:
            raise AgentrlError(f"trainer tensor {key!r} has no Hugging Face name")
    return hf


def read_native(checkpoint: CheckpointTensors, name: str, args: MoEModelArgs, *,
                expert_range: tuple[int, int] | None = None) -> torch.Tensor:
    """The trainer tensor ``name`` from a checkpoint (experts: only ``expert_range``, stacked)."""
    if ".mlp.experts.w" in name:
        _, layer, _ = name.split(".", 2)
        param = name.rsplit(".", 1)[1]
        lo, hi = expert_range or (0, args.num_experts)
        proj = {v: k for k, v in _EXPERT_PARAM.items()}[param]
        if f"model.layers.{layer}.mlp.experts.{lo}.{proj}.weight" in checkpoint:
            return torch.stack([checkpoint.get(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight")
                                for e in range(lo, hi)])
        if proj == "down_proj":
            return checkpoint.get(f"model.layers.{layer}.mlp.experts.down_proj")[lo:hi]
        gate, up = checkpoint.get(f"model.layers.{layer}.mlp.experts.gate_up_proj")[lo:hi].chunk(2, dim=1)
        return gate if proj == "gate_proj" else up
    (hf_name,) = native_to_hf({name: torch.empty(0)}, args).keys()
    return checkpoint.get(hf_name)
