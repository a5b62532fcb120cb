"""bench/step_time_check.py: the defaults come from its --fit; its CPU variant predicts each measured row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))


def test_fit_on_the_committed_h200_rows_gives_the_defaults():
    from step_time_check import fit
    from trainer_mfu import air_args

    from agentrl.rl.step_time import PlanSection

    rows = json.loads((ROOT / "bench" / "results" / "trainer_mfu.json").read_text())["runs"]
    fitted = fit(rows, lambda r: air_args(2))
    defaults = PlanSection()
    for name in ("grouped_gemm_tflops", "attention_tflops", "cp_attention_tflops", "step_overhead_s"):
        assert fitted[name] == pytest.approx(getattr(defaults, name), rel=0.01), name


def test_cpu_variant_measures_rates_and_predicts_each_row(tmp_path):
    pytest.importorskip("torchtitan", reason="the trainer's extra (agentrl[train]) is not installed")
    out = tmp_path / "check.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "step_time_check.py"),
            "--cpu",
            "--quick",
            "--steps",
            "1",
            "--results",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and set(report["rates"]) == {
        "dense_gemm_tflops",
        "grouped_gemm_tflops",
        "attention_tflops",
        "cp_attention_tflops",
    }
    assert all(rate > 0 for rate in report["rates"].values())
    assert [row["key"] for row in report["rows"]] == ["1x_128_L2", "1x_256_L2"]
    for row, run in zip(report["rows"], report["runs"]):
        assert row["measured_s"] == run["step_s"] > 0
        assert row["error_measured_rates"] == pytest.approx(
            row["predicted_measured_rates_s"] / row["measured_s"] - 1
        )
        terms = row["terms_measured_rates"]  # the prediction is built from this run's rates
        assert terms["grouped_gemm_s"] > 0 and terms["attention_s"] > 0 and terms["fsdp_s"] == 0
    assert "trainer step time: measured vs predicted (cpu)" in result.stdout
