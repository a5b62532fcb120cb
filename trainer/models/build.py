"""Build a model of any family from its `MoEModelArgs`, and give it random weights.

`build_model` builds the class the model's family names in the family table
(`agentrl.trainer.models.families`); `state_dict.load_hf_weights` fills it from a Hugging Face
folder, `init_weights` draws random weights (tests, benchmarks, a run without a checkpoint).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.families import family_of

__all__ = ["build_model", "init_weights"]


def build_model(
    args: MoEModelArgs, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """An uninitialised (random) model of ``args.model_type``'s family.

    Load weights with `state_dict.load_hf_weights`.
    """
    decoder = family_of(args.model_type).decoder_class()
    with torch.device(device):
        model = decoder(args)
    return model.to(dtype=dtype)


def init_weights(model: nn.Module, *, std: float = 0.02, seed: int = 0) -> None:
    """Random initialisation (normal(0, std) matrices, zero biases and correction bias, unit norms).

    Works on plain and on sharded (FSDP DTensor) parameters; each rank draws its own shard.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if param.dim() >= 2:
                rank_offset = torch.distributed.get_rank() if isinstance(param, DTensor) else 0
                generator = torch.Generator(device=local.device).manual_seed(
                    seed * 1_000_003 + zlib.crc32(name.encode()) + 7919 * rank_offset)
                local.normal_(0.0, std, generator=generator)
            elif name.endswith("bias"):
                local.zero_()
            else:
                local.fill_(1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.zero_()
