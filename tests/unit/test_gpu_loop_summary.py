"""bench/gpu_loop.py's run summary reports the peers' figures of every replay arm a run logged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_loop  # noqa: E402


def _row(step: int, **train: float) -> dict:
    return {"step": step, "time": 10.0 * step, "reward": 0.5, "mismatch_kl": 1e-3, "step_time_s": 1.0, "wait_s": 0.1,
            "train_s": 0.5, "weight_stage_s": 0.1, "weight_push_s": 0.2,
            **{f"train/{key}": value for key, value in train.items()}}


def test_the_arms_shares_and_largest_ratios_are_summarised(tmp_path):
    rows = [_row(0, mismatch_kl_live_routing=4e-3, mismatch_large_fraction=0.0, mismatch_large_fraction_live_routing=2e-3,
                 mismatch_max_log_ratio=0.3, mismatch_max_log_ratio_live_routing=1.5, mismatch_kl_replay_ids_weights=8e-4),
            _row(1, mismatch_kl_live_routing=2e-3, mismatch_large_fraction=1e-3, mismatch_large_fraction_live_routing=4e-3,
                 mismatch_max_log_ratio=0.9, mismatch_max_log_ratio_live_routing=0.7, mismatch_kl_replay_ids_weights=6e-4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = gpu_loop.summarise(tmp_path, ahead=0)
    assert summary["r3_kl_reduction"] == 3.0
    assert summary["mismatch_large_fraction_live_routing"] == 3e-3 and summary["mismatch_large_fraction_replayed"] == 5e-4
    assert summary["mismatch_max_log_ratio_live_routing"] == 1.5 and summary["mismatch_max_log_ratio_replayed"] == 0.9
    assert summary["mismatch_kl_replay_ids_weights"] == 7e-4
    older = [{key: value for key, value in row.items() if "large" not in key and "max_log" not in key
              and "weights" not in key} for row in rows]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in older))
    assert not any("large" in key or "max_log" in key for key in gpu_loop.summarise(tmp_path, ahead=0))
