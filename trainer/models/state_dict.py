"""Hugging Face safetensors in and out of the trainer, for every model family (lossless both ways).

Reads a HF model folder (``model.safetensors`` or sharded ``model-XXXXX-of-YYYYY`` with
``model.safetensors.index.json``) whole (`read_hf_state`, `load_hf_weights`) or one tensor at a
time per rank (`HFCheckpointReader`, `load_hf_weights_sharded`); writes the Hugging Face hub
layout vLLM and transformers load (per-expert tensors, sharded with an index, config and
tokenizer files copied beside: `save_hf_weights`). The names and layouts are the family's
business: `hf_to_native`, `native_to_hf` and the reader go through the state-dict adapter the
family table names (`decoder_weights` for the transformer families, `nemotron_h_weights`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.families import family_of
from agentrl.trainer.models.lora_layers import is_adapter

__all__ = ["hf_to_native", "native_to_hf", "read_hf_state", "load_hf_weights", "load_hf_weights_sharded",
           "HFCheckpointReader", "save_hf_weights", "copy_into_shard", "replace_folder"]

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
    """Map HF names/layouts to the trainer's (the family's adapter); raises on missing or unexpected tensors."""
    return family_of(args.model_type).adapter().hf_to_native(hf, args)


def native_to_hf(native: Mapping[str, torch.Tensor], args: MoEModelArgs, *,
                 contiguous: bool = True) -> dict[str, torch.Tensor]:
    """Map the trainer's state dict to HF hub names (per-expert tensors: copies, or views without `contiguous`)."""
    return family_of(args.model_type).adapter().native_to_hf(native, args, contiguous=contiguous)


def load_hf_weights(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Load a HF folder's weights into a freshly built (unsharded) `MoEDecoder`."""
    args: MoEModelArgs = model.args  # type: ignore[assignment]
    native = hf_to_native(read_hf_state(model_dir), args)
    expected = {name for name in model.state_dict() if not is_adapter(name)}
    missing = sorted(expected - set(native))
    if missing:
        raise AgentrlError(f"{model_dir}: weights missing for {missing[0]} (and {len(missing) - 1} more)")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in expected:
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

    def keys(self) -> list[str]:
        return list(self._where)

    def native(self, name: str, args: MoEModelArgs, *, expert_range: tuple[int, int] | None = None) -> torch.Tensor:
        """The trainer tensor ``name`` (experts: only ``expert_range``, stacked), as the family's adapter reads it."""
        return family_of(args.model_type).adapter().read_native(self, name, args, expert_range=expert_range)


def load_hf_weights_sharded(model: torch.nn.Module, model_dir: str | Path) -> None:
    """Fill a parallelised model (FSDP DTensors, EP-sliced experts) from a HF folder.

    Each rank reads only the tensors it holds a part of, one at a time, and copies its
    FSDP shard (dim-0 chunk, as ``fully_shard`` lays it out); experts are read for the
    rank's own expert range only. Use after ``fully_shard`` on a meta-device model and
    ``model.to_empty(device=...)``.
    """

    args: MoEModelArgs = model.args  # type: ignore[assignment]
    reader = HFCheckpointReader(model_dir)
    ranges = {}
    for name, module in model.named_modules():
        if hasattr(module, "expert_range"):
            ranges[_clean(name)] = module.expert_range
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            clean = _clean(name)
            if (args.tie_word_embeddings and clean == "lm_head.weight") or is_adapter(clean):
                continue  # adapters: `lora.init_adapters`
            block = clean.rsplit(".experts.", 1)[0] if ".experts." in clean else None
            full = reader.native(clean, args, expert_range=ranges.get(block))
            copy_into_shard(tensor, full, name=clean, source=model_dir)


def copy_into_shard(tensor: torch.Tensor, full: torch.Tensor, *, name: str, source: str | Path = "") -> None:
    """Copy this rank's part of the full tensor ``full`` into ``tensor``: its FSDP shard (dim-0 chunk, as
    ``fully_shard`` lays it out) for a DTensor, all of it otherwise."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        mesh = tensor.device_mesh
        (placement,) = tensor.placements
        if not isinstance(placement, Shard) or placement.dim != 0:
            raise AgentrlError(f"{name}: unexpected placement {placement}; expected FSDP's Shard(0)")
        chunks = full.chunk(mesh.size(), dim=0)
        index = mesh.get_local_rank()
        part = chunks[index] if index < len(chunks) else full[:0]
    else:
        local, part = tensor, full
    if tuple(part.shape) != tuple(local.shape):
        raise AgentrlError(f"{source}: {name} has shape {tuple(full.shape)}, which does not fit "
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
            weight_map.update(dict.fromkeys(shard, name))
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
    return replace_folder(tmp, out)


def replace_folder(written: Path, out: Path) -> Path:
    """Put the complete folder ``written`` at ``out`` by renames, replacing what was there (never half of either)."""
    if out.exists():
        old = out.with_name(out.name + ".old-export")
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        written.rename(out)
        shutil.rmtree(old)
    else:
        written.rename(out)
    return out
