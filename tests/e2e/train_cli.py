"""Helpers of the e2e tests that run `agentrl train` through the CLI as a user would."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def start_cli(*args: str) -> subprocess.Popen:
    """`python -m agentrl.cli ARGS` from the checkout in its own session, output captured."""
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


@contextmanager
def watched_train(config: Path, run_dir: Path, overrides: list[str], *, log_path: Path) -> Iterator[subprocess.Popen]:
    """`agentrl train --config CONFIG -o RUN_DIR --set ...` in its own session, its output into `log_path`, for
    tests that watch the run while it trains; on leaving, a run still going is killed with its whole process group
    (Ray, vLLM, the actors) and the log is closed."""
    command = [sys.executable, "-m", "agentrl.cli", "train", "--config", str(config), "-o", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        try:
            yield process
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def overdue(run_dir: Path, log_path: Path, *, lines: int = 20) -> str:
    """The failure message of a watched run past its deadline: how many steps it logged, and the last lines of
    its output and of each server's log, so a run that hung in CI says where."""
    metrics = run_dir / "metrics.jsonl"
    steps = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    parts = [f"the run did not finish in time ({steps} steps logged)"]
    for path in [log_path, *sorted((run_dir / "logs").glob("*.log"))]:
        if path.is_file():
            tail = [line[:300] for line in path.read_text(errors="replace").splitlines()[-lines:]]
            parts.append(f"--- {path.name}, last {len(tail)} lines:\n" + "\n".join(tail))
    return "\n".join(parts)


def finish(process: subprocess.Popen, *, timeout: float) -> tuple[int, str]:
    """Wait for a `start_cli` process: (exit code, output); past `timeout` (or on any error) its whole
    process group (Ray, vLLM, the actors) is killed."""
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, output


def run_train(args: list[str], *, timeout: float) -> tuple[int, str]:
    """`agentrl train ARGS` as `start_cli` + `finish`: (exit code, output)."""
    return finish(start_cli("train", *args), timeout=timeout)


def pid_gone(pid: int) -> bool:
    """Whether no process has this id any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def session_pids(*sessions: int) -> list[int]:
    """The pids of every process in any of `sessions` (a `start_new_session` run and what it started there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) in sessions:
                    found.append(int(entry.name))
            except (OSError, ProcessLookupError):
                continue
    return found


def actor_pids(session: int, actor_class: str) -> list[int]:
    """The pids of the Ray worker processes of `session` that run an actor of `actor_class` (`ray::Class...`)."""
    pids = []
    for pid in session_pids(session):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"ray::{actor_class}".encode()):
                pids.append(pid)
        except OSError:
            continue
    return pids


def api_server_pids(port: int) -> list[int]:
    """Pids of the vLLM OpenAI API server processes listening (by their command line) on `port`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" not in argv:
            continue
        if any(flag == "--port" and value == str(port) for flag, value in itertools.pairwise(argv)):
            pids.append(int(entry.name))
    return pids
