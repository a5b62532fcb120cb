"""Layout planner: ep=auto, cp=auto from memory, the memory estimate, and one-line errors."""

from __future__ import annotations

import pytest

from agentrl.errors import AgentrlError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.parallel import GIB, estimate_memory, plan_layout


def _air(layers: int = 2) -> MoEModelArgs:
    return MoEModelArgs(
        vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=layers, num_attention_heads=96, num_key_value_heads=8, head_dim=128, rotary_dim=64,
        attention_bias=True, num_experts=128, top_k=8, num_shared_experts=1,
    )


def test_param_counts_by_hand():
    counts = _air(1).param_counts()
    assert counts["experts"] == 128 * 3 * 4096 * 1408
    attention = 4096 * (96 * 128 + 2 * 8 * 128) + 96 * 128 * 4096 + (96 * 128 + 2 * 8 * 128) + 2 * 4096
    dense = 2 * 151552 * 4096 + attention + 3 * 4096 * 1408 + 128 * 4096 + 4096
    assert counts["dense"] == dense
    assert counts["active"] == dense - 151552 * 4096 + 8 * 3 * 4096 * 1408


def test_ep_auto_picks_largest_divisor_of_world_and_experts():
    args = _air()
    assert plan_layout(args, world=8, row_tokens=8192, gpu_memory_bytes=1e15).ep == 8
    assert plan_layout(args, world=6, row_tokens=8192, gpu_memory_bytes=1e15).ep == 2  # 128 % 3 != 0
    assert plan_layout(args, world=1, row_tokens=8192).ep == 1


def test_cp_auto_grows_until_the_estimate_fits():
    args = _air()
    loose = plan_layout(args, world=4, row_tokens=131072, cp="auto", gpu_memory_bytes=1e15)
    assert loose.cp == 1
    budget = plan_layout(args, world=4, row_tokens=131072, cp=2).estimated_bytes
    tight = plan_layout(args, world=4, row_tokens=131072, cp="auto", gpu_memory_bytes=budget + 1)
    assert tight.cp == 2 and tight.estimated_bytes <= budget + 1
    assert "cp=2" in tight.describe() and "GiB/GPU" in tight.describe()


def test_estimate_scales_with_sharding_and_tokens():
    args = _air()
    one = estimate_memory(args, world=1, ep=1, cp=1, row_tokens=8192)
    two = estimate_memory(args, world=2, ep=2, cp=1, row_tokens=8192)
    assert two["states"] == pytest.approx(one["states"] / 2)
    assert one["states"] == pytest.approx(16 * args.param_counts()["total"])
    long = estimate_memory(args, world=1, ep=1, cp=1, row_tokens=32768)
    assert long["activations"] > 2 * one["activations"]
    halved = estimate_memory(args, world=2, ep=2, cp=2, row_tokens=32768)
    assert halved["activations"] < long["activations"]


def test_impossible_layouts_are_one_line_errors():
    args = _air()
    with pytest.raises(AgentrlError, match=r"trainer.parallel.ep=3: must divide the world size \(4\)"):
        plan_layout(args, world=4, row_tokens=8192, ep=3)
    with pytest.raises(AgentrlError, match=r"trainer.parallel.cp=2: .* 2 x cp must divide trainer.row_tokens \(8190\)"):
        plan_layout(args, world=2, row_tokens=8190, cp=2)
    with pytest.raises(AgentrlError, match="no layout fits 1 GiB/GPU"):
        plan_layout(args, world=2, row_tokens=8192, cp="auto", gpu_memory_bytes=1 * GIB)
