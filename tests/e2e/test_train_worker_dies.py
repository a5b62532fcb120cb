"""`kill -9` of the rollout worker mid-run costs no step: Ray restarts it and its groups run again.

The real `agentrl train` (CLI subprocess in a session of its own, local Ray cluster) on the CPU CI
recipe with one rollout worker. Once two steps are in `metrics.jsonl` the test SIGKILLs the
worker's process (`ray::RolloutWorker...` in the driver's session). The worker holds no state:
Ray restarts it in its bundle (`launch.rollout_worker_restarts`), and the groups it was running,
and those sent while it restarted, run again on the new one (`max_task_retries`). So the run
exits 0 with every step once, each with samples and no failed rollout, and a new worker process
ran. With `launch.rollout_worker_restarts = 0` the same kill fails every later group.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from agentrl.rl.report import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import ROOT, actor_pids, finish, session_pids, start_cli  # noqa: E402

CI_CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"
STEPS = 10
KILL_AFTER_STEPS = 2
OVERRIDES = [f"orchestrator.max_steps={STEPS}", "orchestrator.groups_per_step=4", "orchestrator.checkpoint_every=0",
             "run.plots=false"]


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(read_metrics(path)) if path.is_file() else 0


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_killed_rollout_worker_is_restarted_and_costs_no_step(tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", "--config", str(CI_CONFIG), "-o", str(run_dir)]
    for override in OVERRIDES:
        args += ["--set", override]
    process = start_cli(*args)
    try:
        deadline = time.monotonic() + 600
        while _steps_done(run_dir) < KILL_AFTER_STEPS:
            assert process.poll() is None, f"the run ended early (rc {process.returncode})"
            assert time.monotonic() < deadline, "no two steps within 600 s"
            time.sleep(0.2)
        workers = actor_pids(process.pid, "RolloutWorker")
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        restarted: list[int] = []
        while process.poll() is None and not restarted and time.monotonic() < deadline:
            restarted = [pid for pid in actor_pids(process.pid, "RolloutWorker") if pid != workers[0]]
            time.sleep(0.2)
        returncode, output = finish(process, timeout=600)
    finally:
        for pid in session_pids(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert returncode == 0, output[-3000:]
    assert restarted, "no new rollout worker process ran after the kill"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(STEPS)), [row["step"] for row in rows]
    assert all(row["samples"] > 0 for row in rows)
    assert [row["rollout_errors"] for row in rows] == [0] * STEPS, [row.get("first_error") for row in rows]
