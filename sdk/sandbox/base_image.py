"""The sandbox base image `agentrl-base:bookworm`, built locally with debootstrap.

No image registry is reachable here, so the base image is made from Debian's mirror:
`debootstrap --variant=minbase bookworm` plus python3, pip, git, pytest and patch, a
non-root user `agent` (uid 1000) and a `/workspace` folder, then `docker import`. The
recipe is hashed; the hash is stored as the image label `agentrl.recipe` and in a stamp
file inside the rootfs, so a second build with the same recipe returns at once. The
rootfs tree stays on disk (`rootfs_dir()`) because the bubblewrap backend runs on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentrl import env_vars
from agentrl.errors import AgentrlError
from agentrl.sandbox.docker_engine import docker_client

__all__ = [
    "BASE_IMAGE_TAG",
    "BASE_RECIPE",
    "SANDBOX_UID",
    "SANDBOX_USER",
    "BaseImageInfo",
    "build_base_image",
    "build_rootfs",
    "recipe_hash",
    "rootfs_dir",
]

BASE_IMAGE_TAG = "agentrl-base:bookworm"
SANDBOX_USER = "agent"
SANDBOX_UID = 1000
RECIPE_LABEL = "agentrl.recipe"
STAMP_NAME = ".agentrl-recipe"

# Everything that determines the image; its hash is the cache key.
BASE_RECIPE: dict = {
    "suite": "bookworm",
    "variant": "minbase",
    "mirror": "http://deb.debian.org/debian",
    "packages": ["python3", "python3-pip", "python3-pytest", "git", "patch", "ca-certificates", "procps"],
    "user": SANDBOX_USER,
    "uid": SANDBOX_UID,
    "workdir": "/workspace",
    "env": {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
    "recipe_version": 1,
}


@dataclass(frozen=True)
class BaseImageInfo:
    """What `build_base_image` produced."""

    tag: str
    image_id: str
    recipe_hash: str
    rootfs: Path
    cached: bool


def recipe_hash(recipe: dict | None = None) -> str:
    """A short stable hash of a recipe (sorted JSON)."""
    data = json.dumps(recipe or BASE_RECIPE, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def cache_root() -> Path:
    """Where rootfs trees live: `$AGENTRL_SANDBOX_CACHE` or /var/cache/agentrl (as root)."""
    env = env_vars.SANDBOX_CACHE.get()
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/agentrl")
    return Path.home() / ".cache" / "agentrl"


def rootfs_dir(suite: str = "bookworm") -> Path:
    """The on-disk debootstrap tree of the base image (used read-only by bubblewrap)."""
    return cache_root() / "rootfs" / suite


@contextlib.contextmanager
def _build_lock():
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _rootfs_is_current(path: Path, digest: str) -> bool:
    stamp = path / STAMP_NAME
    return stamp.is_file() and stamp.read_text().strip() == digest


def _run(cmd: list[str], *, what: str, log: Path | None = None) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-5:]
        if log is not None:
            log.write_text(out.stdout + out.stderr)
        raise AgentrlError(f"{what} failed (exit {out.returncode}): {' | '.join(tail)}")


def build_rootfs(*, recipe: dict | None = None, force: bool = False) -> tuple[Path, bool]:
    """Debootstrap the base rootfs unless a tree with the same recipe hash exists.

    Returns (path, cached). Builds into a temporary folder beside the target and renames
    it into place, so an interrupted build never leaves a half tree behind.
    """
    recipe = recipe or BASE_RECIPE
    digest = recipe_hash(recipe)
    target = rootfs_dir(recipe["suite"])
    if not force and _rootfs_is_current(target, digest):
        return target, True
    if os.geteuid() != 0:
        raise AgentrlError("sandbox build-base: debootstrap needs root; run it as root (scripts/install.sh does)")
    if shutil.which("debootstrap") is None:
        raise AgentrlError("sandbox build-base: debootstrap is not installed; run: apt-get install debootstrap")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{recipe['suite']}-build-", dir=target.parent))
    try:
        _run(
            [
                "debootstrap", f"--variant={recipe['variant']}", f"--include={','.join(recipe['packages'])}",
                recipe["suite"], str(work), recipe["mirror"],
            ],
            what="debootstrap",
            log=target.parent / "debootstrap-failed.log",
        )
        user, uid = recipe["user"], recipe["uid"]
        _run(["chroot", str(work), "useradd", "-m", "-u", str(uid), "-U", "-s", "/bin/bash", user], what="useradd")
        workdir = work / recipe["workdir"].lstrip("/")
        workdir.mkdir(parents=True, exist_ok=True)
        os.chown(workdir, uid, uid)
        # Keep the image small: apt lists and downloaded .debs are not needed at run time.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (work / junk).glob("*"):
                if entry.is_file():
                    entry.unlink()
        work.chmod(0o755)  # mkdtemp made it 0700; it becomes the image's /
        (work / STAMP_NAME).write_text(digest + "\n")
        old = target.with_name(target.name + ".old")
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
        work.rename(target)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target, False


def image_recipe(client, tag: str) -> str | None:
    """The recipe label of a local image, or None when the image does not exist."""
    import docker.errors

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    return (image.labels or {}).get(RECIPE_LABEL)


def build_base_image(*, tag: str = BASE_IMAGE_TAG, recipe: dict | None = None, force: bool = False) -> BaseImageInfo:
    """Build (or find cached) the base image and its rootfs; instant when nothing changed."""
    recipe = recipe or BASE_RECIPE
    digest = recipe_hash(recipe)
    client = docker_client()
    with _build_lock():
        rootfs, rootfs_cached = build_rootfs(recipe=recipe, force=force)
        if not force and image_recipe(client, tag) == digest:
            image = client.images.get(tag)
            return BaseImageInfo(tag=tag, image_id=image.id, recipe_hash=digest, rootfs=rootfs, cached=True)
        changes = [f"LABEL {RECIPE_LABEL}={digest}", f"WORKDIR {recipe['workdir']}", 'CMD ["/bin/bash"]']
        changes += [f"ENV {key}={value}" for key, value in recipe["env"].items()]
        with tempfile.NamedTemporaryFile(dir=rootfs.parent, suffix=".tar") as tar_file:
            tar = subprocess.run(
                ["tar", "-C", str(rootfs), "--numeric-owner", "--exclude=./" + STAMP_NAME, "-cf", "-", "."],
                stdout=tar_file, stderr=subprocess.PIPE,
            )
            if tar.returncode != 0:
                raise AgentrlError(f"sandbox build-base: tar of {rootfs} failed: {tar.stderr.decode()[-300:]}")
            tar_file.flush()
            repository, _, version = tag.rpartition(":")
            # A path (not a stream) makes docker-py send the tar with a Content-Length.
            client.api.import_image(src=tar_file.name, repository=repository, tag=version, changes=changes)
        image = client.images.get(tag)
        if (image.labels or {}).get(RECIPE_LABEL) != digest:
            raise AgentrlError(f"sandbox build-base: imported {tag} but its {RECIPE_LABEL} label is missing")
        return BaseImageInfo(tag=tag, image_id=image.id, recipe_hash=digest, rootfs=rootfs, cached=False)
