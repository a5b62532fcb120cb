"""Helpers of the e2e tests that run `agentrl train` through the CLI as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_train(args: list[str], *, timeout: float) -> tuple[int, str]:
    """`python -m agentrl.cli train ARGS` from the checkout in its own session: (exit code, output).

    Past `timeout` (or on any error) the whole process group (Ray, vLLM, the actors) is killed.
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "train", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, output


def pid_gone(pid: int) -> bool:
    """Whether no process has this id any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
