"""Bubblewrap sandboxes' host state: their folders, tmpfs mounts and cgroups, and removing what is left behind.

A bwrap sandbox lives in a folder of `workspace_root` named with its id, holding its labels
(`LABELS_FILE`) and a tmpfs (`DISK_DIR`) with its writable trees; its cgroup is named
`cgroup_name`: the prefix, the owning process's pid and start time, the sandbox id, so a dead
owner's cgroups and folders are found (`list_workspaces`, `remove_orphan_cgroups`) and removed
(`remove_workspace`) by `agentrl.sandbox.gc` and at the first bwrap start of a process.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox import cgroups
from agentrl.sandbox.archive import remove_tree
from agentrl.sandbox.base import SandboxError
from agentrl.sandbox.base_image import cache_root
from agentrl.sandbox.labels import process_start_time

__all__ = ["BWRAP_ENV", "CGROUP_PREFIX", "DISK_DIR", "LABELS_FILE", "Workspace", "cgroup_name", "claim_host_uid",
           "list_workspaces",
           "remove_orphan_cgroups", "remove_workspace", "unmount", "workspace_root"]

LABELS_FILE = "labels.json"
DISK_DIR = "disk"  # the sandbox's tmpfs (or, without one, a plain folder), inside its host folder
CGROUP_PREFIX = "agentrl-bwrap."
BWRAP_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}


def workspace_root() -> Path:
    """Host folder holding the bwrap sandboxes' writable trees."""
    return cache_root() / "bwrap"


@dataclass
class Workspace:
    """A bwrap sandbox's host folder and its labels."""

    path: Path
    labels: dict[str, str]


def list_workspaces() -> list[Workspace]:
    """All bwrap sandbox folders on this machine."""
    root = workspace_root()
    found = []
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if not path.is_dir() or path.is_symlink():  # the host-uid lock file, nothing of a sandbox
                continue
            try:
                labels = json.loads((path / LABELS_FILE).read_text())
            except (OSError, ValueError):
                labels = {}
            found.append(Workspace(path=path, labels=labels))
    return found


def claim_host_uid(own: Path, labels: dict[str, str], *, base: int, span: int) -> int:
    """A host uid in [base, base + span) that no other bwrap sandbox folder on this machine holds, written with
    `labels` into `own`'s labels file under a lock: two sandboxes sharing a uid would share its RLIMIT_NPROC where
    there is no cgroup (a red-team pass, 2026-12-07: about 2% of pairs among 64 sandboxes by random draws alone).
    The uid is free again when its folder is removed."""
    import fcntl

    with open(workspace_root() / ".host-uids.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        taken = {int(ws.labels["host_uid"]) for ws in list_workspaces()
                 if ws.path != own and str(ws.labels.get("host_uid", "")).isdigit()}
        for _ in range(1000):
            uid = base + int.from_bytes(os.urandom(4), "big") % span
            if uid not in taken:
                break
        else:
            raise SandboxError(f"no free host uid for a bwrap sandbox: {len(taken)} of {span} are held by sandbox "
                               f"folders under {workspace_root()}; remove the stale ones (agentrl sandbox gc)")
        (own / LABELS_FILE).write_text(json.dumps({**labels, "host_uid": str(uid)}))
    return uid


def unmount(path: Path) -> None:
    """Unmount `path` (detaching it lazily when busy); SandboxError if it stays mounted."""
    if not os.path.ismount(path):
        return
    for flags in ([], ["--lazy"]):
        done = subprocess.run(["umount", *flags, str(path)], capture_output=True, text=True, env=BWRAP_ENV,
                              timeout=30)
        if done.returncode == 0 or not os.path.ismount(path):
            return
    raise SandboxError(f"cannot unmount the bwrap sandbox tmpfs at {path}: {done.stderr.strip()}")


def cgroup_name(sandbox_id: str) -> str:
    """The sandbox's cgroup name: prefix, owning pid and its start time (for orphan checks), sandbox id."""
    pid = os.getpid()
    return f"{CGROUP_PREFIX}{pid}.{process_start_time(pid)}.{sandbox_id}"


def _cgroup_owner_alive(name: str) -> bool:
    pid, _, rest = name.removeprefix(CGROUP_PREFIX).partition(".")
    started, _, _ = rest.partition(".")
    return pid.isdigit() and bool(started) and process_start_time(int(pid)) == started


def remove_workspace(path: Path, *, cgroup_root: Path = cgroups.CGROUP_ROOT) -> None:
    """Remove a bwrap sandbox left behind: kill its cgroup's processes, unmount its tmpfs, delete both."""
    found = [group for group in cgroups.find(CGROUP_PREFIX, root=cgroup_root) if group.name.endswith(f".{path.name}")]
    for group in found:
        group.kill_all()
    unmount(path / DISK_DIR)
    for group in found:
        group.remove()
    remove_tree(path)


def remove_orphan_cgroups(*, cgroup_root: Path = cgroups.CGROUP_ROOT) -> list[str]:
    """Kill and remove the bwrap sandbox cgroups whose owning process is dead; returns their names."""
    removed = []
    for group in cgroups.find(CGROUP_PREFIX, root=cgroup_root):
        if not _cgroup_owner_alive(group.name):
            group.kill_all()
            group.remove()
            removed.append(group.name)
    return removed
