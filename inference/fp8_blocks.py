"""Which checkpoints block FP8 can serve, and a padded copy of one it cannot.

Block FP8 (`inference.fp8_scales = "block"`, vLLM's `--quantization fp8_per_block`, DeepSeek-V3's layout) keeps one
scale per 128 x 128 block of a weight and quantizes activations in groups of 128 along each linear layer's input.
A linear layer whose input width is not a multiple of 128 has a ragged last group: vLLM's DeepGEMM path refuses it
and hands it to its Cutlass block kernel. The server then answered NaN logprobs, most likely from that layer
(`--quantization fp8_per_block` on the created glm-air-32e, whose dense MLP is 10,944 wide as GLM-4.5-Air's: an
H100, 2026-12-07, with E8M0 scales off and with the Triton MoE backend too;
`cookbook/gpu-1xh200/results/logs-2026-12-07c-h100`). vLLM checks these widths only under tensor parallelism.

`block_fp8_misfits` names the widths of a HF config that 128 does not divide; the run planner refuses block FP8
for such a model in one line (`rl.plan.check_block_fp8`). `pad_dense_mlp` writes a copy of a checkpoint whose
dense MLP width is padded with zeros to a multiple of 128: gate and up rows of zeros give silu(0) * 0 = 0, and the
down projection's zero columns add nothing, so the copy computes the same function (what the inference-features
bench serves for its block-FP8 row).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

BLOCK = 128
"""The width of block FP8's scale blocks and activation groups."""

_DENSE_MLP = (".mlp.gate_proj.weight", ".mlp.up_proj.weight", ".mlp.down_proj.weight")


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def block_fp8_misfits(config: dict[str, Any], *, block: int = BLOCK) -> list[str]:
    """`name = width` for each linear layer input width of a HF config (its text config) that `block` does not
    divide: the hidden size, the attention output's, the dense MLP's, the routed and shared experts'."""
    text = _text_config(config)
    widths: dict[str, int | None] = {"hidden_size": text.get("hidden_size")}
    heads, head_dim = text.get("num_attention_heads"), text.get("head_dim")
    if heads and head_dim and not text.get("kv_lora_rank"):  # MLA's output width is heads x v_head_dim
        widths["num_attention_heads x head_dim"] = heads * head_dim
    experts = text.get("n_routed_experts") or text.get("num_experts") or 0
    dense_layers = text.get("first_k_dense_replace", 0) if experts else text.get("num_hidden_layers", 1)
    if dense_layers:
        widths["intermediate_size"] = text.get("intermediate_size")
    if experts:
        widths["moe_intermediate_size"] = text.get("moe_intermediate_size")
        shared = text.get("moe_shared_expert_intermediate_size") or (
            (text.get("n_shared_experts") or 0) * (text.get("moe_intermediate_size") or 0))
        if shared:
            widths["shared experts' width"] = shared
    return [f"{name} = {width}" for name, width in widths.items() if width and width % block]


def _padded_width(width: int, block: int) -> int:
    return -(-width // block) * block


def pad_dense_mlp(source: Path, target: Path, *, block: int = BLOCK) -> Path:
    """Write to `target` a copy of the safetensors checkpoint `source` whose dense MLP (`intermediate_size`; not the
    experts) is zero-padded to a multiple of `block`; the same function. Returns `target`."""
    import torch
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    config = json.loads((source / "config.json").read_text())
    text = _text_config(config)
    width = int(text["intermediate_size"])
    padded = _padded_width(width, block)
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copyfile(item, target / item.name)
    text["intermediate_size"] = padded
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for shard in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name, tensor in tensors.items():
            if not name.endswith(_DENSE_MLP) or ".experts." in name or "shared_expert" in name:
                continue
            axis = 1 if name.endswith("down_proj.weight") else 0
            if tensor.shape[axis] != width:
                raise ValueError(f"{shard}: {name} is {tuple(tensor.shape)}, not {width} wide along axis {axis}")
            pad_shape = list(tensor.shape)
            pad_shape[axis] = padded - width
            tensors[name] = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=axis).contiguous()
        save_file(tensors, str(target / shard.name), metadata={"format": "pt"})
    return target
