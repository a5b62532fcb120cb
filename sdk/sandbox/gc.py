"""Find and remove sandboxes: orphans of dead processes, a run's sandboxes, or all of them.

Docker sandboxes are found by their `agentrl.sandbox` label; bubblewrap sandboxes by
their workspace folders (named with the owning pid) under the bwrap state folder, each
removed with its cgroup and tmpfs mount, and by cgroups named with a dead owner's pid. Used by
`agentrl sandbox gc` / `ls` and, for Docker orphans, once at the first sandbox start of a
process.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrl.sandbox.bwrap_workspace import list_workspaces, remove_orphan_cgroups, remove_workspace, workspace_root
from agentrl.sandbox.docker_engine import docker_client, labelled_containers, remove_container
from agentrl.sandbox.labels import owner_alive

__all__ = ["SandboxInfo", "collect_garbage", "list_sandboxes"]


@dataclass
class SandboxInfo:
    """One sandbox seen by `list_sandboxes`."""

    backend: str
    id: str
    owner: str
    pid: str
    status: str
    image: str
    orphan: bool


def list_sandboxes(*, include_docker: bool = True, include_bwrap: bool = True) -> list[SandboxInfo]:
    """All sandboxes on this machine (Docker containers with our label, bwrap workspaces)."""
    found: list[SandboxInfo] = []
    if include_docker:
        for container in labelled_containers(docker_client()):
            labels = container.labels or {}
            found.append(SandboxInfo(
                backend="docker", id=container.id[:12], owner=labels.get("agentrl.owner", "?"),
                pid=labels.get("agentrl.pid", "?"), status=container.status,
                image=(container.attrs.get("Config") or {}).get("Image", "?"), orphan=not owner_alive(labels),
            ))
    if include_bwrap:
        for workspace in list_workspaces():
            found.append(SandboxInfo(
                backend="bwrap", id=workspace.path.name, owner=workspace.labels.get("agentrl.owner", "?"),
                pid=workspace.labels.get("agentrl.pid", "?"), status="workspace", image="rootfs",
                orphan=not owner_alive(workspace.labels),
            ))
    return found


def collect_garbage(*, owner: str | None = None, everything: bool = False, docker: bool = True,
                    bwrap: bool = True) -> list[SandboxInfo]:
    """Remove orphaned (or the given owner's, or all) sandboxes of both local backends."""
    removed: list[SandboxInfo] = []
    for info in list_sandboxes(include_docker=docker, include_bwrap=bwrap):
        if not (everything or (owner is not None and info.owner == owner) or (owner is None and info.orphan)):
            continue
        if info.backend == "docker":
            if not remove_container(docker_client(), info.id):
                continue
        else:
            remove_workspace(workspace_root() / info.id)
        removed.append(info)
    if bwrap and owner is None:  # cgroups of dead owners left without a folder
        removed += [SandboxInfo(backend="bwrap", id=name, owner="?", pid="?", status="cgroup", image="-", orphan=True)
                    for name in remove_orphan_cgroups()]
    return removed
