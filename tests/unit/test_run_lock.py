"""A run folder is held by the run writing it: a second `agentrl train` into it stops in one line (two processes)."""

from __future__ import annotations

import subprocess
import sys
import time

HOLD = """
import sys
from agentrl.rl.report import RunDir
handle = RunDir(sys.argv[1]).lock()
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def test_a_second_train_into_a_held_folder_is_one_line_naming_the_holder(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # the lock is taken before the second run starts
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "-o", str(folder),
                                 "--set", "orchestrator.max_steps=1"], capture_output=True, text=True, timeout=120)
        took = time.monotonic() - started
        lines = [line for line in (second.stdout + second.stderr).splitlines() if line.strip()]
        assert second.returncode == 2, lines
        error = [line for line in lines if "another agentrl train" in line]
        assert error and f"(pid {holder.pid})" in error[0] and "-o" in error[0], lines
        assert not (folder / "config.toml").exists()  # nothing written into the held folder
        assert took < 30, took
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    from agentrl.rl.report import RunDir

    RunDir(folder).lock().close()  # released with the holder's process
