"""Build a model of any family from its `MoEModelArgs`, give it random weights, or train its GEMMs in FP8.

`build_model` builds the class the model's family names in the family table
(`agentrl.trainer.models.families`); `state_dict.load_hf_weights` fills it from a Hugging Face
folder, `init_weights` draws random weights (tests, benchmarks, a run without a checkpoint).
`train_in_float8` swaps the projections for torchao's row-wise FP8 training (`trainer.fp8`).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.families import family_of

__all__ = ["build_model", "init_weights", "train_in_float8"]


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


def train_in_float8(model: nn.Module, *, experts: bool, device_type: str) -> int:
    """torchao's FP8 training, row-wise scales (`trainer.fp8`): the attention projections and the dense and shared
    MLPs become `Float8Linear` (bf16 or float32 master weights; inputs, weights and gradients cast to FP8 per row
    for each GEMM); with `experts`, the routed experts' grouped GEMMs too (torchao's `Float8TrainingOpConfig`:
    `torch._scaled_grouped_mm`, CUDA only). The routers (float32 routing) and the output head stay as they are, and
    so does a layer whose sizes are not multiples of 16 (FP8 GEMMs need them). Call before loading weights and
    sharding: parameter names do not change. Returns the number of projections swapped."""
    from agentrl.errors import ConfigError

    if experts and device_type != "cuda":
        raise ConfigError("trainer.fp8='all': the routed experts' FP8 grouped GEMMs run on CUDA only; on the CPU set"
                          " trainer.fp8='linears' (the projections) or 'off'")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError("trainer.fp8 needs torchao; install the train extra: pip install 'agentrl[train]'") from None

    swapped = []

    def chosen(module: nn.Module, name: str) -> bool:
        keep = (isinstance(module, nn.Linear) and not name.endswith((".gate", "lm_head", "output"))
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if keep:
            swapped.append(name)
        return keep

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"), module_filter_fn=chosen)
    if experts:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_

        quantize_(model, config=Float8TrainingOpConfig(), filter_fn=lambda module, name: name.endswith(".experts"))
    return len(swapped)
