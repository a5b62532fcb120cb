"""Labels that tie a sandbox to the run and the process that owns it.

Every sandbox carries `agentrl.sandbox=1`, `agentrl.owner=<run id>`, `agentrl.pid=<pid>`,
`agentrl.pid_start=<start time of that pid>` and `agentrl.host=<hostname>`. A sandbox is an
orphan when it was made on this host and its pid no longer runs (or the pid was reused by
a process with another start time); `agentrl.sandbox.gc` removes orphans.
"""

from __future__ import annotations

import os
import socket

__all__ = ["MARKER", "owner_alive", "process_start_time", "sandbox_labels"]

MARKER = "agentrl.sandbox"


def process_start_time(pid: int) -> str:
    """The kernel's start time (clock ticks since boot) of a process, or '' when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return ""
    # The command name (field 2) may hold spaces; fields after the closing paren are plain.
    return stat.rsplit(")", 1)[1].split()[19]


def sandbox_labels(*, owner: str, backend: str) -> dict[str, str]:
    """The labels for a sandbox created by this process."""
    pid = os.getpid()
    return {
        MARKER: "1",
        "agentrl.owner": owner,
        "agentrl.pid": str(pid),
        "agentrl.pid_start": process_start_time(pid),
        "agentrl.host": socket.gethostname(),
        "agentrl.backend": backend,
    }


def owner_alive(labels: dict[str, str]) -> bool:
    """False only when the owning process certainly is dead (same host, pid gone or reused)."""
    if labels.get("agentrl.host") != socket.gethostname():
        return True  # another machine's sandbox: not ours to judge
    try:
        pid = int(labels.get("agentrl.pid", ""))
    except ValueError:
        return False
    started = process_start_time(pid)
    if not started:
        return False
    expected = labels.get("agentrl.pid_start")
    return not expected or expected == started
