"""`agentrl train --resume` after `kill -9`: no step trained twice or skipped.

The run is killed with SIGKILL (its whole process group: CLI, Ray, actors) once a
checkpoint exists and a later step has started; the vLLM server, which runs in its own
session, must die with it (every process of that session: the API server and the engine core). The resumed run restarts at the last complete checkpoint:
metrics.jsonl ends up with each step exactly once, and the trainer's own optimizer-step
counter (restored from the checkpoint, reported as `train/step`) is step + 1 at every
step, so no optimizer step was applied twice or skipped. With both loggers on, TensorBoard's
reader shows each step once with the values metrics.jsonl ends with (the resumed run's for the
redone steps), and the resumed W&B run is the first one's (same id), logging from the checkpoint's step.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.rl.report import read_metrics
from agentrl.rl.resume import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"
LOGGERS = [name for name in ("tensorboard", "wandb") if importlib.util.find_spec(name) is not None]
"""The loggers whose extras are installed (the resume itself is tested without them too)."""


def _train(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _wait_group_gone(group: int, timeout_s: float) -> bool:
    """True once no process is left in process group `group` (the vLLM server's API and engine core)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.e2e
def test_resume_after_kill_9(tmp_path):
    run_dir = tmp_path / "run"
    steps = 6
    first = _train("--config", str(CI_CONFIG), "-o", str(run_dir), "--set", f"orchestrator.max_steps={steps}",
                   "--set", f"run.loggers={json.dumps(LOGGERS)}")
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            info = latest_checkpoint(run_dir / "checkpoints")
            if info is not None and info.step >= 2 and len(read_metrics(run_dir / "metrics.jsonl")) >= 2:
                break
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("no checkpoint within 10 minutes")
    finally:
        _kill_group(first)
    killed_at = len(read_metrics(run_dir / "metrics.jsonl"))
    assert killed_at < steps, "the run finished before it could be killed"
    # the server leads its own session
    server_group = json.loads((run_dir / "placement.json").read_text())["servers"][0]["pid"]
    gone = _wait_group_gone(server_group, 60)
    if not gone:
        os.killpg(server_group, signal.SIGKILL)
    assert gone, "a vLLM server process (API server or engine core) survived kill -9 of the run"

    resumed_at = latest_checkpoint(run_dir / "checkpoints").step
    second = _train("--resume", str(run_dir))
    try:
        output, _ = second.communicate(timeout=700)
    finally:
        if second.poll() is None:
            _kill_group(second)
    assert second.returncode == 0, output[-3000:]
    assert "resuming from" in output
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(steps))
    assert [int(row["train/step"]) for row in rows] == [step + 1 for step in range(steps)]
    assert latest_checkpoint(run_dir / "checkpoints").step == steps
    _assert_loggers_continued(run_dir, rows, resumed_at=resumed_at)


def _assert_loggers_continued(run_dir: Path, rows: list[dict], *, resumed_at: int) -> None:
    if "tensorboard" in LOGGERS:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        assert [(e.step, e.value) for e in events.Scalars("reward")] == \
            [(row["step"], pytest.approx(row["reward"], rel=1e-6)) for row in rows]
    if "wandb" not in LOGGERS:
        return
    from tests.wandb_records import history_rows

    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(path.endswith(f"run-{run_id}.wandb") for path in files)
    history = history_rows(files[-1])  # the resumed run's (the killed one's file has no exit record)
    assert [h["_step"] for h in history] == list(range(resumed_at, len(rows)))
    assert [h["reward"] for h in history] == pytest.approx([row["reward"] for row in rows[resumed_at:]])
