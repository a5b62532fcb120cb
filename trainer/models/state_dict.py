"""Hugging Face safetensors <-> trainer state-dict adapter (lossless both ways).

Reads a HF model folder (``model.safetensors`` or sharded ``model-XXXXX-of-YYYYY`` with
``model.safetensors.index.json``), maps names and stacks the per-expert matrices into
torchtitan's grouped layout (``w1_EFD`` = gate_proj, ``w3_EFD`` = up_proj, ``w2_EDF`` =
down_proj); writes the reverse in the Hugging Face hub layout vLLM and transformers load
(per-expert tensors, sharded with an index, config and tokenizer files copied beside).
The fused in-memory layout of transformers 5 (``experts.gate_up_proj``) is also read.
Extra layers past ``num_hidden_layers`` (GLM-4.5's multi-token-prediction layer) are
skipped on load. ``nemotron_h`` checkpoints map through `nemotron_h_weights`.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.trainer.models.args import MoEModelArgs

__all__ = ["hf_to_native", "native_to_hf", "read_hf_state", "load_hf_weights", "load_hf_weights_sharded",
           "HFCheckpointReader", "save_hf_weights"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_DENSE_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_PARAM = {"gate_proj": "w1_EFD", "up_proj": "w3_EFD", "down_proj": "w2_EDF"}
_COPY_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json",
)


def _safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise NotFoundError(f"{model_dir}: no *.safetensors files; pass a Hugging Face model folder with weights")
    return files


def read_hf_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF folder's safetensors, by HF name (shards merged)."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in _safetensor_files(Path(model_dir)):
        if not path.is_file():
            raise NotFoundError(f"{path}: listed in the safetensors index but missing")
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                state[key] = handle.get_tensor(key)
    return state


def hf_to_native(hf: Mapping[str, torch.Tensor], args: MoEModelArgs) -> dict[str, torch.Tensor]:
    """Map HF names/layouts to the trainer's; raises on missing or unexpected tensors."""
    if args.model_type == "nemotron_h":
        from agentrl.trainer.models import nemotron_h_weights

        return nemotron_h_weights.hf_to_native(hf, args)
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
                f"layer {layer} {proj}: found experts {len(by_index)} of {args.num_experts}; the checkpoint is incomplete"
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
    if args.model_type == "nemotron_h":
        from agentrl.trainer.models import nemotron_h_weights

        return nemotron_h_weights.native_to_hf(native, args, contiguous=contiguous)
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
                split_experts(hf, tensor, lambda index: f"{prefix}mlp.experts.{index}.{proj}.weight",
                              contiguous=contiguous)
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


def load_hf_weights(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Load a HF folder's weights into a freshly built (unsharded) `MoEDecoder`."""
    args: MoEModelArgs = model.args  # type: ignore[assignment]
    native = hf_to_native(read_hf_state(model_dir), args)
    expected = set(model.state_dict())
    missing = sorted(expected - set(native))
    if missing:
        raise AgentrlError(f"{model_dir}: weights missing for {missing[0]} (and {len(missing) - 1} more)")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(native[name].to(tensor.dtype))


class HFCheckpointReader:
    """Lazy access to a HF folder's tensors by HF name (only what is asked for is read)."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        self.model_dir = Path(model_dir)
        self._handles = []
        self._where: dict[str, object] = {}
        for path in _safetensor_files(self.model_dir):
            if not path.is_file():
                raise NotFoundError(f"{path}: listed in the safetensors index but missing")
            handle = safe_open(str(path), framework="pt")
            self._handles.append(handle)
            for key in handle.keys():
                self._where[key] = handle

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        handle = self._where.get(key)
        if handle is None:
            raise AgentrlError(f"{self.model_dir}: tensor {key!r} is missing from the checkpoint")
        return handle.get_tensor(key)  # type: ignore[attr-defined]

    def native(self, name: str, args: MoEModelArgs, *, expert_range: tuple[int, int] | None = None) -> torch.Tensor:
        """The trainer tensor ``name`` (experts: only ``expert_range``, stacked)."""
        if args.model_type == "nemotron_h" and ".mixer.experts.w" in name:
            return self._nemotron_experts(name, args, expert_range)
        if ".mlp.experts.w" in name:
            _, layer, _ = name.split(".", 2)
            param = name.rsplit(".", 1)[1]
            lo, hi = expert_range or (0, args.num_experts)
            proj = {v: k for k, v in _EXPERT_PARAM.items()}[param]
            per_expert = f"model.layers.{layer}.mlp.experts.{lo}.{proj}.weight"
            if per_expert in self:
                return torch.stack([self.get(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight") for e in range(lo, hi)])
            if proj == "down_proj":
                return self.get(f"model.layers.{layer}.mlp.experts.down_proj")[lo:hi]
            gate, up = self.get(f"model.layers.{layer}.mlp.experts.gate_up_proj")[lo:hi].chunk(2, dim=1)
            return gate if proj == "gate_proj" else up
        (hf_name,) = native_to_hf({name: torch.empty(0)}, args).keys()
        if args.model_type == "nemotron_h" and hf_name not in self:
            from agentrl.trainer.models.nemotron_h_weights import hf_prefix

            hf_name = hf_prefix(self._where) + hf_name.split(".", 1)[1]  # transformers' names
        return self.get(hf_name)

    def _nemotron_experts(self, name: str, args: MoEModelArgs, expert_range: tuple[int, int] | None) -> torch.Tensor:
        from agentrl.trainer.models import nemotron_h_weights

        _, layer, _ = name.split(".", 2)
        lo, hi = expert_range or (0, args.num_experts)
        proj = "up_proj" if name.endswith("w1_EFD") else "down_proj"
        prefix = nemotron_h_weights.hf_prefix(self._where)
        if nemotron_h_weights.expert_key(prefix, layer, lo, proj) in self:
            return torch.stack([self.get(nemotron_h_weights.expert_key(prefix, layer, e, proj)) for e in range(lo, hi)])
        return self.get(f"{prefix}layers.{layer}.mixer.experts.{proj}")[lo:hi]


def load_hf_weights_sharded(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Fill a parallelised model (FSDP DTensors, EP-sliced experts) from a HF folder.

    Each rank reads only the tensors it holds a part of, one at a time, and copies its
    FSDP shard (dim-0 chunk, as ``fully_shard`` lays it out); experts are read for the
    rank's own expert range only. Use after ``fully_shard`` on a meta-device model and
    ``model.to_empty(device=...)``.
    """
    from torch.distributed.tensor import DTensor, Shard

    args: MoEModelArgs = model.args  # type: ignore[assignment]
    reader = HFCheckpointReader(model_dir)
    ranges = {}
    for name, module in model.named_modules():
        if hasattr(module, "expert_range"):
            ranges[_clean(name)] = module.expert_range
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            clean = _clean(name)
            if args.tie_word_embeddings and clean == "lm_head.weight":
                continue
            block = clean.rsplit(".experts.", 1)[0] if ".experts." in clean else None
            full = reader.native(clean, args, expert_range=ranges.get(block))
            if isinstance(tensor, DTensor):
                local = tensor.to_local()
                mesh = tensor.device_mesh
                (placement,) = tensor.placements
                if not isinstance(placement, Shard) or placement.dim != 0:
                    raise AgentrlError(f"{clean}: unexpected placement {placement}; expected FSDP's Shard(0)")
                chunks = full.chunk(mesh.size(), dim=0)
                index = mesh.get_local_rank()
                part = chunks[index] if index < len(chunks) else full[:0]
            else:
                local, part = tensor, full
            if tuple(part.shape) != tuple(local.shape):
                raise AgentrlError(f"{model_dir}: {clean} has shape {tuple(full.shape)}, which does not fit "
                                   f"this model ({tuple(local.shape)} per rank); check config.json")
            local.copy_(part.to(local.dtype))


def _clean(name: str) -> str:
    for prefix in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def _shards(hf: Mapping[str, torch.Tensor], max_shard_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for key in sorted(hf):
        nbytes = hf[key].numel() * hf[key].element_size()
        if shard and size + nbytes > max_shard_bytes:
            yield shard
            shard, size = {}, 0
        shard[key] = hf[key]
        size += nbytes
    if shard:
        yield shard


def save_hf_weights(
    native: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    args: MoEModelArgs,
    source_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 4 << 30,
    digest: bool = False,
) -> Path:
    """Write HF safetensors (sharded with an index when large) and copy config/tokenizer files.

    Writes into a temporary sibling folder and renames it into place, so an interrupted
    export never leaves a half-written model where inference would load it. With `digest`,
    the written tensors' digest goes beside them (`agentrl.weight_digest.DIGEST_FILE`): a server
    that loads the folder is checked against it.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp-export")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    hf = {k: (v if dtype is None or k.endswith("e_score_correction_bias") else v.to(dtype)).detach().cpu().contiguous()
          for k, v in native_to_hf(native, args).items()}
    shards = list(_shards(hf, max_shard_bytes))
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for index, shard in enumerate(shards, start=1):
            name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
        total = sum(t.numel() * t.element_size() for t in hf.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if digest:
        from agentrl.weight_digest import FOLDER_DTYPES, tensor_digests, write_digest

        write_digest(tmp, tensor_digests(hf, wire=lambda tensor: tensor.dtype, served=FOLDER_DTYPES))
    if source_dir is not None:
        for name in _COPY_FILES:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, tmp / name)
    if out.exists():
        old = out.with_name(out.name + ".old-export")
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    return out
