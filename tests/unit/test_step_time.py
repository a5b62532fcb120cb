"""The planner's step-time model: its numbers follow from its inputs, and bad sizes are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.errors import AgentrlError
from agentrl.rl.config import load_run_config
from agentrl.rl.decode_model import EngineShape, predict_generation
from agentrl.rl.plan import plan_run, trainer_plan
from agentrl.rl.step_time import PlanSection, loop_step_s, predict_run, predict_trainer, weight_sync_s
from agentrl.trainer.layout import plan_layout
from agentrl.trainer.models.args import MoEModelArgs

ROOT = Path(__file__).resolve().parents[2]
AIR_512 = ["launch.gpus=512", "model.max_seq_len=131072"]


def _air(**overrides):
    args = MoEModelArgs.for_model("glm-4.5-air")
    plan = plan_layout(args, world=64, row_tokens=65536, ep=64, cp=2, gpu_memory_bytes=1e15)
    return predict_trainer(
        args, plan, PlanSection(**overrides), tokens_per_step=256 * 32768, mean_sample_tokens=32768
    )


@pytest.mark.parametrize(
    "rate, term",
    [
        ("dense_gemm_tflops", "dense_gemm_s"),
        ("grouped_gemm_tflops", "grouped_gemm_s"),
        ("cp_attention_tflops", "attention_s"),
    ],
)
def test_doubling_a_compute_rate_halves_its_term(rate, term):
    base, fast = _air(), _air(**{rate: 2 * getattr(PlanSection(), rate)})
    assert fast.terms[term] == pytest.approx(base.terms[term] / 2)
    assert fast.total_s < base.total_s
    others = {k for k in ("dense_gemm_s", "grouped_gemm_s", "attention_s") if k != term}
    assert all(fast.terms[k] == pytest.approx(base.terms[k]) for k in others)


def test_halving_a_bandwidth_doubles_the_comms_it_carries():
    base = _air()
    slow_ib = _air(infiniband_gbs=25.0)
    # EP=64 spans 8 nodes: the all-to-all is bound by InfiniBand, FSDP over 64 ranks too; CP=2 is on NVLink.
    assert slow_ib.terms["ep_all_to_all_s"] == pytest.approx(2 * base.terms["ep_all_to_all_s"])
    assert slow_ib.terms["fsdp_s"] == pytest.approx(2 * base.terms["fsdp_s"])
    assert slow_ib.terms["cp_all_gather_s"] == pytest.approx(base.terms["cp_all_gather_s"])
    slow_nvlink = _air(nvlink_gbs=225.0)
    assert slow_nvlink.terms["cp_all_gather_s"] == pytest.approx(2 * base.terms["cp_all_gather_s"])
    assert base.terms["cp_all_gather_s"] > 0 and base.terms["ep_all_to_all_s"] > 0


def test_one_node_uses_nvlink_and_one_gpu_has_no_comms():
    args = MoEModelArgs.for_model("glm-4.5-air")
    inputs = PlanSection()
    one = predict_trainer(
        args,
        plan_layout(args, world=1, row_tokens=8192, gpu_memory_bytes=1e15),
        inputs,
        tokens_per_step=8192,
        mean_sample_tokens=8192,
    )
    assert one.terms["fsdp_s"] == one.terms["ep_all_to_all_s"] == one.terms["cp_all_gather_s"] == 0
    node = plan_layout(args, world=8, row_tokens=8192, gpu_memory_bytes=1e15)
    fast = predict_trainer(args, node, inputs, tokens_per_step=8 * 8192, mean_sample_tokens=8192)
    slow = predict_trainer(
        args, node, PlanSection(nvlink_gbs=225.0), tokens_per_step=8 * 8192, mean_sample_tokens=8192
    )
    assert fast.terms["ep_all_to_all_s"] > 0
    assert slow.terms["ep_all_to_all_s"] == pytest.approx(2 * fast.terms["ep_all_to_all_s"])


def test_more_inference_gpus_generate_faster_and_sync_follows_bandwidth():
    args = MoEModelArgs.for_model("glm-4.5-air")
    inputs = PlanSection()
    times = [
        predict_generation(
            args,
            EngineShape(engines=engines, gpus_per_engine=2, fp8=True),
            inputs,
            samples=256,
            mean_sample_tokens=16384,
            concurrency=4096,
        )["generation_s"]
        for engines in (8, 16, 32)
    ]
    assert times[0] > times[1] > times[2]
    total = args.param_counts()["total"]
    assert weight_sync_s(total, PlanSection(infiniband_gbs=100.0)) == pytest.approx(
        weight_sync_s(total, inputs) / 2
    )
    assert weight_sync_s(total, PlanSection(weight_sync_gbs=10.0)) == pytest.approx(total * 2 / 10e9)


def test_loop_overlaps_only_when_off_policy_steps_are_allowed():
    assert loop_step_s(trainer_s=10, generation_s=30, sync_s=2, max_off_policy_steps=1) == 32
    assert loop_step_s(trainer_s=10, generation_s=30, sync_s=2, max_off_policy_steps=0) == 42


def test_plan_prediction_moves_with_a_set_override():
    config = load_run_config(None, overrides=AIR_512, env="swe", model="glm-4.5-air")
    layout = trainer_plan(config)
    base = predict_run(config, layout)
    faster = load_run_config(
        None, overrides=AIR_512 + ["plan.grouped_gemm_tflops=311"], env="swe", model="glm-4.5-air"
    )
    moved = predict_run(faster, trainer_plan(faster))
    assert moved.trainer.terms["grouped_gemm_s"] < base.trainer.terms["grouped_gemm_s"]
    text = plan_run(config)
    for needle in (
        "# split:",
        "ep=",
        "cp=",
        "memory per GPU",
        "# predicted step:",
        "# reported: 280 s",
        "grouped_gemm_tflops=155.5",
        "extrapolated",
    ):
        assert needle in text


def test_kimi_k2_plans_on_its_smallest_cluster_only():
    config = load_run_config(
        None, overrides=["launch.gpus=144", "model.max_seq_len=131072"], env="swe", model="kimi-k2"
    )
    assert (config.launch.trainer_gpus, config.launch.inference_gpus) == (128, 16)
    assert config.inference.kind == "wide_ep"
    counts = MoEModelArgs.for_model("kimi-k2").param_counts()
    assert 1.0e12 < counts["total"] < 1.05e12 and 30e9 < counts["active"] < 34e9
    with pytest.raises(AgentrlError, match="no split fits kimi-k2"):
        load_run_config(
            None, overrides=["launch.gpus=136", "model.max_seq_len=131072"], env="swe", model="kimi-k2"
        )


def test_defaults_reproduce_the_held_out_h200_rows():
    """The rates were fitted to the 1-GPU rows and the 65k CP row; the other rows are predictions."""
    sys.path.insert(0, str(ROOT / "bench"))
    from trainer_mfu import air_args

    args = air_args(2)
    for row in json.loads((ROOT / "bench" / "results" / "trainer_mfu.json").read_text())["runs"]:
        if (row["gpus"], row["cp"]) == (1, 1) or row["seq"] <= 8192 or row["seq"] == 65536:
            continue
        plan = plan_layout(
            args, world=row["gpus"], row_tokens=row["seq"], cp=row["cp"], gpu_memory_bytes=1e15
        )
        predicted = predict_trainer(
            args,
            plan,
            PlanSection(dense_gemm_tflops=row["matmul_tflops"]),
            tokens_per_step=row["seq"] * row["gpus"] // row["cp"],
            mean_sample_tokens=row["seq"],
        ).total_s
        assert predicted == pytest.approx(row["step_s"], rel=0.15), row


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "--env", "swe", *args, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "glm-4.5-air", "--gpus", "100"], "launch.gpus=100: plan whole nodes"),
        (["--model", "tiny-moe", "--gpus", "16"], "for GPU-sized presets only"),
        (["--model", "glm-4.5-air", "--seq-len", "0"], "model.max_seq_len"),
        (["--model", "glm-4.5-air", "--gpus", "64", "--set", "launch.trainer_gpus=8"], "are both set and trainer_gpus + inference_gpus = 8"),
        (
            ["--model", "glm-4.5-air", "--seq-len", "131072", "--set", "trainer.row_tokens=4096"],
            "a sample must fit",
        ),
    ],
)
def test_bad_sizes_are_one_line_errors(args, message):
    result = _cli(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    error = (result.stderr or result.stdout).strip()
    assert message in error and len(error.splitlines()) == 1 and "Traceback" not in error


def test_gpus_keeps_the_rest_of_launch():
    config = load_run_config(None, overrides=AIR_512 + ['launch.ray_address="10.0.0.1:6379"'], env="swe",
                             model="glm-4.5-air")
    assert config.launch.ray_address == "10.0.0.1:6379"
    assert config.launch.trainer_gpus + config.launch.inference_gpus == 512
    assert config.inference.replicas * config.inference.tensor_parallel_size == config.launch.inference_gpus


def test_doubling_every_compute_rate_halves_the_compute_time():
    rates = ("dense_gemm_tflops", "grouped_gemm_tflops", "attention_tflops", "cp_attention_tflops")
    base = _air(step_overhead_s=0.0)
    fast = _air(step_overhead_s=0.0, **{rate: 2 * getattr(PlanSection(), rate) for rate in rates})
    assert fast.terms["compute_s"] == pytest.approx(base.terms["compute_s"] / 2)
    assert fast.terms["fsdp_s"] == pytest.approx(base.terms["fsdp_s"])  # comms do not move with the rates


def test_a_planned_run_config_reloads_as_it_was(tmp_path):
    from agentrl.config import dump_config

    config = load_run_config(None, overrides=AIR_512, env="swe", model="glm-4.5-air")
    saved = tmp_path / "config.toml"  # what a run folder keeps (and --resume reads)
    saved.write_text(dump_config(config))
    again = load_run_config(saved)
    assert again.launch == config.launch and again.inference == config.inference
    assert again.trainer.row_tokens == 131072 and again.orchestrator == config.orchestrator


def test_mla_attention_is_counted_from_its_ranks():
    args = MoEModelArgs.for_model("kimi-k2")
    D, H = 7168, 64
    by_hand = (D * 1536 + 1536 * H * (128 + 64)  # q: down to the q rank, up to every head's nope + rope dims
               + D * (512 + 64) + 512 * H * (128 + 128)  # kv: the latent + shared rope key, up to k_nope and v
               + H * 128 * D + 1536 + 512 + 2 * D)  # output projection; q/kv latent norms and the two RMSNorms
    assert args.attention_params() == by_hand
    flops = args.training_flops_per_token(mean_context=1000) - args.training_flops_per_token(mean_context=0)
    assert flops == 6 * 61 * H * (192 + 128) * 1000
