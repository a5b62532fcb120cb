"""Checkpoints: DCP save/resume of the full training state, and HF export for inference.

`save_checkpoint` writes model and optimizer state with torch.distributed.checkpoint
(every rank writes its shards; the layout is resharding-friendly across FSDP sizes),
plus each rank's step and RNG states. Under expert parallelism each EP rank's experts
are stored under their own key (``...w1_EFD@ep<r>``), so resuming needs the same EP
degree; the HF export is the layout-free format. A checkpoint is written into
``<path>.tmp`` and renamed into place only when complete, so an interrupted save never
replaces a good checkpoint.

`export_hf` gathers full tensors (FSDP all-gather, then the EP all-gather of experts)
and rank 0 writes Hugging Face safetensors through `models.state_dict.save_hf_weights`.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.trainer.models.state_dict import native_to_hf, save_hf_weights

__all__ = ["save_checkpoint", "load_checkpoint", "full_state_dict", "hf_state_views", "export_hf"]

_EXPERT_KEYS = (".experts.w1_EFD", ".experts.w2_EDF", ".experts.w3_EFD")  # mlp.experts / mixer.experts (nemotron_h)
_CLEAN = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _is_expert(key: str) -> bool:
    return any(key.endswith(suffix) or (suffix + ".") in key for suffix in _EXPERT_KEYS)


def _rename(tree: Any, ep_rank: int | None, *, to_disk: bool) -> Any:
    """Tag (or untag) expert FQNs with their EP rank, recursively through dict keys."""
    if ep_rank is None or not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        new_key = key
        if isinstance(key, str):
            if to_disk and _is_expert(key):
                new_key = key.replace("_EFD", f"_EFD@ep{ep_rank}").replace("_EDF", f"_EDF@ep{ep_rank}")
            elif not to_disk:
                new_key = key.replace(f"@ep{ep_rank}", "")
        out[new_key] = _rename(value, ep_rank, to_disk=to_disk)
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _options(trainer):
    """A LoRA trainer's checkpoint holds the adapters and their optimizer state, not the frozen base (it is
    read from the model folder again)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = trainer.config.lora is not None  # not strict: the base's keys are absent (dcp.load checks the adapters')
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def save_checkpoint(trainer, path: str | Path) -> Path:
    """Write model, optimizer, step and RNG state of every rank under ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_options(trainer))
    ep_rank = trainer.ep_rank
    state = {"model": _rename(model_sd, ep_rank, to_disk=True), "optim": _rename(optim_sd, ep_rank, to_disk=True)}
    dcp.save(state, checkpoint_id=str(tmp))
    extra = {
        "step": trainer.step_count,
        "python_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "loss_scale": trainer.loss_scale.state_dict() if trainer.loss_scale else None,
        "layout": trainer.plan.describe(),
    }
    torch.save(extra, tmp / f"extra_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (tmp / "agentrl_checkpoint.json").write_text(json.dumps({
            "step": trainer.step_count, "world": trainer.plan.world, "ep": trainer.plan.ep, "cp": trainer.plan.cp,
        }))
        if final.exists():
            old = final.with_name(final.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    _barrier()
    return final


def load_checkpoint(trainer, path: str | Path) -> int:
    """Restore a checkpoint written by `save_checkpoint`; returns the step it was taken at."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta_path = path / "agentrl_checkpoint.json"
    if not meta_path.is_file():
        raise NotFoundError(f"{path}: not an agentrl checkpoint (no agentrl_checkpoint.json)")
    meta = json.loads(meta_path.read_text())
    if trainer.plan.ep > 1 and meta.get("ep") != trainer.plan.ep:
        raise AgentrlError(f"{path}: saved with ep={meta.get('ep')}, this trainer uses ep={trainer.plan.ep}; "
                           "resume with the same trainer.parallel.ep or start from an HF export")
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_options(trainer))
    ep_rank = trainer.ep_rank
    state = {"model": _rename(model_sd, ep_rank, to_disk=True), "optim": _rename(optim_sd, ep_rank, to_disk=True)}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(trainer.model, trainer.optimizer,
                   model_state_dict=_rename(state["model"], ep_rank, to_disk=False),
                   optim_state_dict=_rename(state["optim"], ep_rank, to_disk=False), options=_options(trainer))
    extra_path = path / f"extra_rank{_rank()}.pt"
    if not extra_path.is_file():
        raise NotFoundError(f"{extra_path}: missing; the checkpoint was written by a different number of ranks")
    extra = torch.load(extra_path, weights_only=False)
    random.setstate(extra["python_rng"])
    torch.set_rng_state(extra["torch_rng"])
    if extra.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["cuda_rng"])
    if trainer.loss_scale and extra.get("loss_scale"):
        trainer.loss_scale.load_state_dict(extra["loss_scale"])
    trainer.step_count = int(extra["step"])
    return trainer.step_count


def full_state_dict(trainer, *, on_device: bool = False, adapters_only: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded, all experts) float tensors by the model's own names, on CPU (or, with
    `on_device`, where they are: one process shares its parameters without a copy). Collective.

    A LoRA trainer's adapters are merged into the weights they adapt (`lora.merge_adapters`); with
    `adapters_only`, the adapters alone and unmerged, beside the weights they adapt."""
    from torch.distributed.tensor import DTensor

    from agentrl.trainer.models.lora import merge_adapters
    from agentrl.trainer.models.lora_layers import is_adapter

    out: dict[str, torch.Tensor] = {}
    for key, value in trainer.model.state_dict().items():
        for prefix in _CLEAN:
            key = key.replace(prefix, "")
        if adapters_only and not is_adapter(key):
            continue
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        if trainer.plan.ep > 1 and _is_expert(key):
            group = trainer.meshes.ep.get_group()
            parts = [torch.empty_like(tensor) for _ in range(trainer.plan.ep)]
            dist.all_gather(parts, tensor.contiguous(), group=group)
            tensor = torch.cat(parts, dim=0)
        out[key] = tensor.detach() if on_device else tensor.detach().cpu()
    if trainer.config.lora is not None and not adapters_only:
        return merge_adapters(out, scale=trainer.config.lora.scale)
    return out


def hf_state_views(trainer) -> dict[str, torch.Tensor]:
    """The full tensors under HF names where they are, as views of the parameters (not made
    contiguous): what a direct weight push sends, cast and copied chunk by chunk. Collective."""
    return native_to_hf(full_state_dict(trainer, on_device=True), trainer.args, contiguous=False)


def export_hf(trainer, out_dir: str | Path, *, dtype: torch.dtype | None = torch.bfloat16,
              digest: bool = False) -> Path | None:
    """Write the current weights as a Hugging Face folder vLLM loads (rank 0 writes; collective); with `digest`
    the tensors' digest beside them (a server loading the folder is checked against it)."""
    state = full_state_dict(trainer)
    written = None
    if _rank() == 0:
        written = save_hf_weights(state, out_dir, args=trainer.args, source_dir=trainer.model_dir, dtype=dtype,
                                  digest=digest)
    _barrier()
    return written
