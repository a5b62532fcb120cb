"""bench/lora.py's summary of two run folders (the form `agentrl train` writes): medians, update sizes, the reward
windows and the full-over-LoRA ratios, and a folder that is not a run refused in one line."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("lora")


def _run(folder: Path, *, push: float, step: float, update_bytes: int, rewards: list[float]) -> Path:
    folder.mkdir(parents=True)
    rows = [{"step": i, "reward": reward, "step_time_s": step + 0.1 * (i % 2), "train_s": step / 2,
             "weight_push_s": push, "mismatch_kl": 1e-3 * (1 + i % 3)} for i, reward in enumerate(rewards)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "weight_updates.jsonl").write_text("".join(json.dumps({"version": i, "load_s": push / 2}) + "\n"
                                                         for i in range(len(rewards))))
    staged = folder / "weights" / f"v{len(rewards) - 1}"
    staged.mkdir(parents=True)
    (staged / "adapter_model.safetensors").write_bytes(b"\0" * update_bytes)
    return folder


def test_two_runs_are_summarised_with_ratios(bench, tmp_path, capsys):
    rising = [0.5 + 0.02 * i for i in range(12)]
    full = _run(tmp_path / "full", push=2.0, step=4.0, update_bytes=40_000, rewards=rising)
    lora = _run(tmp_path / "lora", push=0.2, step=3.0, update_bytes=1_000, rewards=[0.5] * 12)
    results = tmp_path / "lora.json"
    assert bench.main(["--summarize", str(full), str(lora), "--results", str(results), "--window", "4"]) == 0
    report = json.loads(results.read_text())
    assert report["ratios"]["push_full_over_lora"] == 10.0
    assert report["ratios"]["update_bytes_full_over_lora"] == 40.0
    assert report["ratios"]["step_time_full_over_lora"] == pytest.approx(4.05 / 3.05, abs=1e-3)
    assert report["ratios"]["trainer_peak_full_over_lora"] is None  # CPU runs report no GPU memory
    assert report["full"]["reward_delta"]["delta"] == pytest.approx(0.16) and report["full"]["reward_delta"]["low"] > 0
    assert report["lora"]["reward_delta"]["delta"] == pytest.approx(0.0)
    assert report["full"]["mismatch_kl_median"] == pytest.approx(2e-3)
    assert "LoRA against full fine-tuning" in capsys.readouterr().out


def test_a_folder_without_metrics_is_refused_in_one_line(bench, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        bench.main(["--summarize", str(tmp_path / "empty"), str(tmp_path / "empty"),
                    "--results", str(tmp_path / "x.json")])
    assert str(info.value) == f"bench/lora: {tmp_path / 'empty'} has no metrics.jsonl; give a run folder of `agentrl train`"


def test_a_run_brought_back_without_its_adapter_uses_the_recorded_size(bench, tmp_path):
    """scripts/gpu_run.sh's lora phase records the last adapter's bytes instead of bringing its files back."""
    lora = _run(tmp_path / "lora", push=0.2, step=3.0, update_bytes=1_000, rewards=[0.5] * 6)
    import shutil

    shutil.rmtree(lora / "weights")
    assert bench.summarize(lora, window=2)["update_bytes"] is None
    (lora / "adapter_bytes").write_text("123456\n")
    assert bench.summarize(lora, window=2)["update_bytes"] == 123456
