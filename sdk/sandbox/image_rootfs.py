"""A local Docker image's file system as a folder, for bubblewrap sandboxes of other images than the base.

`image_rootfs(image)` exports the image once (`docker export` of a created, never started
container, unpacked by `tar` as root so owners and modes stay) into the sandbox cache, keyed
by the image id, and returns the folder with the image's `ENV` and `WORKDIR`. bwrap mounts it
read-only as `/`, sets the image's variables under the sandbox's own, and seeds the
sandbox's writable working directory with the image's content there (as the Docker backend
seeds its tmpfs workspace). A machine without a Docker engine can only use the base rootfs
(`agentrl sandbox build-base`).
"""

from __future__ import annotations

import fcntl
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.sandbox.archive import remove_tree
from agentrl.sandbox.base import SandboxError
from agentrl.sandbox.base_image import cache_root
from agentrl.sandbox.docker_engine import docker_client

__all__ = ["ImageRootfs", "image_rootfs"]


@dataclass(frozen=True)
class ImageRootfs:
    """An exported image: its tree, `ENV` and `WORKDIR`."""

    path: Path
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""


def image_rootfs(image: str) -> ImageRootfs:
    """The image's file system as a folder (exported on first use, then reused while the image id is the same)."""
    import docker
    client = docker_client()
    try:
        found = client.images.get(image)
    except docker.errors.ImageNotFound:
        raise SandboxError(f"sandbox type 'bwrap': image {image} is not in the local Docker engine; build or pull "
                           "it first") from None
    config = found.attrs.get("Config") or {}
    env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
    result = ImageRootfs(path=cache_root() / "image-rootfs" / found.id.split(":")[-1][:24], env=env,
                         workdir=config.get("WorkingDir") or "")
    if (result.path / "bin" / "sh").exists():
        return result
    result.path.parent.mkdir(parents=True, exist_ok=True)
    with open(result.path.parent / ".export.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (result.path / "bin" / "sh").exists():
            return result
        staging = Path(tempfile.mkdtemp(prefix=".export-", dir=result.path.parent))
        staging.chmod(0o755)
        container = client.containers.create(image, command=["true"], network_disabled=True)
        try:
            untar = subprocess.Popen(["tar", "-x", "-p", "--numeric-owner", "-C", str(staging), "-f", "-"],
                                     stdin=subprocess.PIPE, stderr=subprocess.PIPE)
            for chunk in container.export():
                untar.stdin.write(chunk)
            untar.stdin.close()
            if untar.wait() != 0:
                raise SandboxError(f"sandbox type 'bwrap': unpacking {image}: {untar.stderr.read().decode()[-200:]}")
            staging.rename(result.path)
        finally:
            container.remove(force=True)
            if staging.exists():
                remove_tree(staging)
    return result
