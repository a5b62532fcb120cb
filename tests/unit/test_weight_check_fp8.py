"""The weight check of FP8-served parameters: vLLM's online quantizations pass, planted faults do not.

The server side is quantized here as vLLM's online FP8 methods quantize the bf16 weights they receive
(per tensor over a fused parameter, per expert, per 128 x 128 block: scale = largest |value| / 448,
values rounded to float8_e4m3fn) and digested by `fp8_stats`, as `vllm_worker_ext` does; the trainer
side is `tensor_digests` of the HF-named tensors. The GPU test (tests/gpu/test_loop_gpu.py) runs it
against CUDA vLLM's own quantization after real weight updates.
"""

from __future__ import annotations

import pytest

from agentrl.inference.weight_check import WeightMismatchError, compare_digests
from agentrl.weight_digest import float64_sums, fp8_stats, tensor_digests

torch = pytest.importorskip("torch")
FP8 = torch.float8_e4m3fn
ATTN = "model.layers.1.self_attn."
EXPERTS = "model.layers.1.mlp.experts."


def _state(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)

    state = {ATTN + "q_proj.weight": rand(256, 192), ATTN + "k_proj.weight": rand(64, 192),
             ATTN + "v_proj.weight": rand(64, 192), ATTN + "o_proj.weight": rand(192, 256),
             "model.layers.1.input_layernorm.weight": 1 + rand(192)}
    for expert in range(3):
        for name, shape in (("gate_proj", (96, 192)), ("up_proj", (96, 192)), ("down_proj", (192, 96))):
            state[f"{EXPERTS}{expert}.{name}.weight"] = rand(*shape)
    return state


def _per_tensor(weight):
    scale = weight.float().abs().max() / 448.0
    return (weight.float() / scale).clamp(-448, 448).to(FP8), scale.reshape(1)


def _per_block(weight, block=128):
    rows, cols = weight.shape
    grid = torch.zeros(-(-rows // block), -(-cols // block))
    quantized = torch.empty(rows, cols, dtype=FP8)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            grid[i, j] = tile.abs().max() / 448.0
            quantized[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / grid[i, j]).to(FP8)
    return quantized, grid


def _served(state: dict, *, o_proj_blocks: bool = True) -> dict:
    """The server's digest: qkv per tensor over the fused weight, o_proj per block (or per tensor), the experts
    per expert (w13) and per block per expert (w2), the layer norm in bf16."""
    qkv, qkv_scale = _per_tensor(torch.cat([state[ATTN + f"{p}_proj.weight"] for p in "qkv"]))
    o_proj, o_scale = (_per_block if o_proj_blocks else _per_tensor)(state[ATTN + "o_proj.weight"])
    w13 = [_per_tensor(torch.cat([state[f"{EXPERTS}{e}.{p}_proj.weight"] for p in ("gate", "up")])) for e in range(3)]
    w2 = [_per_block(state[f"{EXPERTS}{e}.down_proj.weight"]) for e in range(3)]
    params = {
        ATTN + "qkv_proj.weight": (qkv.t(), qkv_scale),  # vLLM's per-tensor method keeps the weight transposed
        ATTN + "o_proj.weight": (o_proj, o_scale),
        EXPERTS + "w13_weight": (torch.stack([q for q, _ in w13]), torch.stack([s.reshape(()) for _, s in w13])),
        EXPERTS + "w2_weight": (torch.stack([q for q, _ in w2]), torch.stack([s for _, s in w2])),
    }
    digest = {name: ["float8_e4m3fn", weight.numel(), *fp8_stats(weight, scale).tolist()]
              for name, (weight, scale) in params.items()}
    norm = state["model.layers.1.input_layernorm.weight"]
    digest["model.layers.1.input_layernorm.weight"] = ["bfloat16", norm.numel(), *float64_sums(norm).tolist()]
    return digest


def _expected(state: dict) -> dict:
    return tensor_digests(state, wire=lambda tensor: torch.bfloat16 if tensor.dim() > 1 else torch.float32,
                          served=("bfloat16", "float32"))


def test_vllms_online_fp8_quantizations_pass_and_per_tensor_scales_keep_the_largest_value():
    state = _state()
    check = compare_digests(_expected(state), _served(state), where="v1")
    assert check.checked == 5 and check.fp8_checked == 4 and check.max_error < 1.0
    per_tensor_only = compare_digests(_expected(state), _served(state, o_proj_blocks=False), where="v1")
    assert per_tensor_only.fp8_largest_error < 1e-6  # the largest value maps to 448 x scale, exactly


def test_a_scale_off_by_ten_percent_is_caught():
    state = _state()
    served = _served(state)
    weight, scale = _per_tensor(torch.cat([state[ATTN + f"{p}_proj.weight"] for p in "qkv"]))
    served[ATTN + "qkv_proj.weight"] = ["float8_e4m3fn", weight.numel(), *fp8_stats(weight, scale * 1.1).tolist()]
    with pytest.raises(WeightMismatchError, match=r"v2: .*qkv_proj\.weight \(FP8\) is not the trainer's weights"):
        compare_digests(_expected(state), served, where="v2")


def test_bf16_values_copied_into_fp8_without_quantizing_are_caught():
    state = _state()
    served = _served(state)
    experts = torch.stack([torch.cat([state[f"{EXPERTS}{e}.{p}_proj.weight"] for p in ("gate", "up")]) for e in range(3)])
    raw = experts.to(FP8)  # what a plain copy_ into the FP8 parameter leaves, the old scales kept
    old_scales = torch.full((3,), float(experts.float().abs().max()) / 448.0)
    served[EXPERTS + "w13_weight"] = ["float8_e4m3fn", raw.numel(), *fp8_stats(raw, old_scales).tolist()]
    with pytest.raises(WeightMismatchError, match=r"w13_weight \(FP8\)"):
        compare_digests(_expected(state), served, where="v2")


def test_weights_not_updated_are_caught_when_the_update_moved_their_scale():
    before = _state()
    after = {name: tensor if "layernorm" in name else (tensor.float() * 1.01).to(torch.bfloat16)
             for name, tensor in before.items()}
    with pytest.raises(WeightMismatchError, match=r"\(FP8\) is not the trainer's weights"):
        compare_digests(_expected(after), _served(before), where="v2")


def test_an_fp8_parameter_without_a_readable_scale_is_refused_in_one_line():
    state = _state()
    served = _served(state)
    served[ATTN + "o_proj.weight"][0] = "float8_e4m3fn-unscaled"
    with pytest.raises(WeightMismatchError, match=r"o_proj\.weight is served in float8_e4m3fn with no scale .*"
                                                  r"verify_weights=false"):
        compare_digests(_expected(state), served, where="v1")


def test_fp8_stats_refuses_a_scale_that_does_not_tile_the_weight():
    weight = torch.zeros(300, 200, dtype=FP8)
    with pytest.raises(ValueError, match=r"does not tile the rows"):
        fp8_stats(weight, torch.ones(7, 2))
    with pytest.raises(ValueError, match=r"scale of shape \[2, 3\] for a weight of \[4, 300, 200\]"):
        fp8_stats(torch.zeros(4, 300, 200, dtype=FP8), torch.ones(2, 3))


def test_fp8_stats_equals_the_dequantized_values_in_every_layout():
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(300, 200, generator=generator) * 0.1).to(FP8)
    for scale in (torch.tensor([0.5]), torch.rand(300, generator=generator), torch.rand(200, generator=generator),
                  torch.rand(3, 2, generator=generator)):
        rows = 128 if scale.dim() == 2 else (1 if scale.numel() == 300 else 300)
        grid = scale.reshape(-1, 1) if scale.numel() == 300 else scale.reshape(1, -1) if scale.dim() == 1 else scale
        dense = grid.repeat_interleave(rows if grid.shape[0] > 1 or rows == 300 else 1, 0)[:300]
        dense = dense.repeat_interleave(128 if grid.shape[1] == 2 else 1, 1)[:, :200]
        values = (weight.float() * dense.float()).double()
        want = torch.stack([values.sum(), values.square().sum(), values.abs().max()])
        assert torch.allclose(fp8_stats(weight, scale), want, rtol=1e-9), list(scale.shape)
