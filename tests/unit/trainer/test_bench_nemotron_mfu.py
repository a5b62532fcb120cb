"""bench/trainer_mfu_nemotron.py: its CPU smoke run measures each row and counts FLOPs from the shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))


def test_nano_args_keep_nanos_widths_in_the_cut_pattern():
    from trainer_mfu_nemotron import nano_args

    args = nano_args("MEMEM*E")
    assert args.layer_types == ["mamba", "moe", "mamba", "moe", "mamba", "attention", "moe"]
    assert (args.hidden_size, args.num_experts, args.top_k, args.moe_intermediate_size) == (
        2688,
        128,
        6,
        1856,
    )
    assert (args.mamba_num_heads, args.mamba_head_dim, args.ssm_state_size) == (64, 64, 128)
    assert 4.0e9 < args.param_counts()["total"] < 5.0e9  # fits one H200 with fp32 AdamW beside 32k tokens


def test_cpu_smoke_run_measures_mfu_and_the_scan_share(tmp_path):
    pytest.importorskip("torchtitan", reason="the trainer's extra (agentrl[train]) is not installed")
    from trainer_mfu_nemotron import nano_args

    out = tmp_path / "nemotron.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "trainer_mfu_nemotron.py"),
            "--cpu",
            "--quick",
            "--results",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    args = nano_args("MEMEM*E", tiny=True)
    assert [row["seq"] for row in report["runs"]] == [128, 256]
    for row in report["runs"]:
        assert row["mamba_layers"] == 3 and row["step_s"] > 0 and row["mamba_scan"] == "torch"
        flops = args.training_flops_per_token(mean_context=row["seq"] / 2) * row["seq"]
        assert row["tflops_per_gpu"] * 1e12 * row["step_s"] == pytest.approx(flops, rel=1e-6)
        assert row["mfu"] == pytest.approx(flops / row["step_s"] / (row["matmul_tflops"] * 1e12), rel=1e-6)
        assert row["mamba_scan_share"] == pytest.approx(
            3 * row["mamba_scan_s_per_layer"] / row["step_s"], rel=1e-6
        )
        assert 0 < row["scan_flops_share"] < 1
    assert report["longest_seq"] == 256 and report["mfu_at_longest"] == report["runs"][-1]["mfu"]
    assert report["scan_at_longest"] == "torch" and report["fla_over_torch_speedup"] == {}  # fla: CUDA only
