"""Lower the CPU priority of the processes that can wait: generation beside a trainer.

On a machine whose CPUs are shared by the trainer and the generation side (vLLM on the
CPU, rollout workers), an asynchronous run is as fast as its trainer: generation runs
ahead and only has to keep up. Under Linux's default scheduler every runnable process
gets its share, so generation bursts preempt the trainer (measured on the 2-core CPU
default: ~0.1 s of run-queue wait per 0.5 s trainer step). At a higher niceness the
generation side uses the CPU time the trainer leaves idle instead.

Two knobs, because Linux schedules by *autogroup* (one per session, `setsid`) before it
looks at a thread's nice value:

* threads: `nice_prefix(nice)` is a command prefix (coreutils `nice`) so a child and
  everything it starts runs at that niceness from its first instruction;
  `lower_priority(pid, nice=...)` renices every thread of a running process (a process
  renicing itself: the threads it starts later inherit it);
* `set_autogroup_nice(pid, nice)`: the niceness of a session's autogroup
  (`/proc/PID/autogroup`), which is what competes with the trainer's session. Only for a
  process in a session of its own (vLLM's server is), since the whole session shares it.

Raising niceness needs no privilege; a value the kernel refuses, or a kernel without
autogroups, leaves the process as it was (priority is an optimisation, never a failure).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["MAX_NICE", "nice_prefix", "lower_priority", "set_autogroup_nice"]

MAX_NICE = 19
"""The lowest CPU priority Linux has."""


def _check(nice: int) -> int:
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"nice must be between 0 and {MAX_NICE}, got {nice}")
    return nice


def nice_prefix(nice: int) -> list[str]:
    """`["nice", "-n", N]` so a command starts at niceness `nice` (`nice` adds N to the caller's).

    Empty when the calling thread is already at `nice` or lower priority, or without `nice`.
    """
    increment = _check(nice) - os.getpriority(os.PRIO_PROCESS, 0)
    binary = shutil.which("nice") if increment > 0 else None
    return [binary, "-n", str(increment)] if binary else []


def lower_priority(pid: int, *, nice: int) -> None:
    """Set every thread of `pid` to niceness `nice` (never raising anyone's priority)."""
    if not _check(nice):
        return
    try:
        tids = [int(entry.name) for entry in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:  # no /proc (not Linux), or the process is gone: its main thread only
        tids = [pid]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # the thread ended meanwhile, or the kernel refused
            continue


def set_autogroup_nice(pid: int, nice: int) -> None:
    """Set the niceness of the autogroup of `pid`'s session (no-op for 0 or without autogroups)."""
    if not _check(nice):
        return
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:  # no autogroups on this kernel (or not Linux), or the process is gone
        pass
