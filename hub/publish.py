"""Push and pull packages through any hub backend (local directory or Hugging Face Hub).

`push_package` validates the package, compares its content hash with what the hub holds for
that version (same: no-op; different: refused), builds and pushes the sandbox image when a
registry is given (recording its digest), stages the published form, and hands it to the
backend to publish atomically. `pull_package` fetches a version into the install folder,
verifies every file's hash, and optionally pulls the image by its digest.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agentrl import env_vars
from agentrl.errors import AgentrlError, NotFoundError
from agentrl.hub.images import build_image, push_image
from agentrl.hub.manifest import MANIFEST_NAME, Manifest, load_manifest
from agentrl.hub.package import PackageLock, content_hash, stage_package, validate_package, verify_package
from agentrl.hub.refs import PackageRef, VersionConflictError, default_owner, installed_root, parse_ref

__all__ = ["HubBackend", "VersionConflictError", "PushResult", "get_hub", "push_package", "pull_package",
           "list_packages", "STAGE_DELAY_ENV"]

STAGE_DELAY_ENV = env_vars.HUB_STAGE_DELAY_S.name
"""Seconds to sleep after each staged file (fault-injection hook: lets tests kill a push midway)."""


class HubBackend(Protocol):
    """What `push_package` and `pull_package` need from a hub."""

    kind: str

    def versions(self, ref: PackageRef) -> list[str]: ...
    def resolve(self, ref: PackageRef) -> PackageRef: ...
    def lock_of(self, ref: PackageRef) -> PackageLock | None: ...
    def read_text(self, ref: PackageRef, relative: str) -> str: ...
    def list_packages(self) -> list[PackageRef]: ...
    def new_staging_dir(self) -> Path: ...
    def publish(self, staged: Path, ref: PackageRef, lock: PackageLock) -> bool: ...
    def fetch(self, ref: PackageRef, destination: Path) -> PackageLock: ...


def get_hub(spec: str | None = None, *, private: bool = False) -> HubBackend:
    """`local` (default, `AGENTRL_HUB`), `hf` (Hugging Face Hub, `HF_ENDPOINT`/`HF_TOKEN`), or a local hub path."""
    spec = spec or env_vars.HUB_BACKEND.get()
    if spec == "local":
        from agentrl.hub.local import LocalHub

        return LocalHub()
    if spec in ("hf", "huggingface"):
        from agentrl.hub.hf import HFHub

        return HFHub(private=private)
    if "/" in spec or spec.startswith("."):
        from agentrl.hub.local import LocalHub

        return LocalHub(spec)
    raise AgentrlError(f"--hub {spec!r}: unknown hub; use 'local', 'hf', or the path of a local hub folder")


@dataclass
class PushResult:
    """What a push did."""

    ref: PackageRef
    content_hash: str
    published: bool
    """False when the hub already held this exact content (a no-op)."""
    image: str | None = None
    image_digest: str | None = None


def push_package(
    package_dir: str | Path, *, hub: HubBackend, owner: str | None = None, name: str | None = None,
    registry: str | None = None, log=None,
) -> PushResult:
    """Publish a package folder; see the module docstring for the steps."""
    say = log or (lambda message: None)
    package_dir = Path(package_dir)
    if not (package_dir / MANIFEST_NAME).is_file():
        raise NotFoundError(f"{package_dir}: no {MANIFEST_NAME}; create one with `agentrl env init NAME`")
    manifest = load_manifest(package_dir)
    ref = PackageRef(owner or default_owner(), name or manifest.name, manifest.version)
    hash_value = content_hash(package_dir)
    existing = hub.lock_of(ref)  # decided by the hash alone: an unchanged push skips building anything
    if existing is not None:
        if existing.content_hash == hash_value:
            say(f"{ref} is already published with this content ({hash_value[:19]}...): nothing to do")
            return PushResult(ref, hash_value, False, existing.image, existing.image_digest)
        raise VersionConflictError.for_ref(ref, existing.content_hash, hash_value)
    manifest, splits = validate_package(package_dir)
    image, digest = _publish_image(package_dir, manifest, registry=registry, say=say)
    staged = hub.new_staging_dir()
    delay = float(os.environ.get(STAGE_DELAY_ENV) or 0)
    on_file = (lambda _relative: time.sleep(delay)) if delay > 0 else None
    try:
        lock = stage_package(package_dir, staged, image=image, image_digest=digest, splits=splits,
                             manifest=manifest, on_file=on_file)
        say(f"staged {len(lock.files)} files, content hash {hash_value[:19]}...")
        published = hub.publish(staged, ref, lock)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    say(f"published {ref}" if published else f"{ref} was published meanwhile with this content: nothing to do")
    return PushResult(ref, hash_value, published, image, digest)


def _publish_image(
    package_dir: Path, manifest: Manifest, *, registry: str | None, say
) -> tuple[str | None, str | None]:
    sandbox = manifest.sandbox
    if sandbox is None:
        return None, None
    if registry is None or not sandbox.dockerfile:
        if sandbox.dockerfile and not sandbox.digest:
            say(f"no --registry given: image {sandbox.image} is not built or pushed, and no digest is recorded")
        return sandbox.image, sandbox.digest
    local_tag = f"{manifest.name}:{manifest.version}"
    say(f"building image {local_tag} from {sandbox.dockerfile}")
    build_image(package_dir, dockerfile=sandbox.dockerfile, tag=local_tag, network=sandbox.network)
    remote, digest = push_image(local_tag, registry=registry)
    say(f"pushed {remote} ({digest})")
    return remote, digest


def pull_package(
    text: str, *, hub: HubBackend, destination: str | Path | None = None, pull_image: bool = False, log=None,
) -> Path:
    """Fetch `owner/name[@version]` into the install folder (or `destination`), verifying every hash."""
    say = log or (lambda message: None)
    ref = hub.resolve(parse_ref(text))
    published = hub.lock_of(ref)
    target = Path(destination) if destination is not None else installed_root() / ref.owner / ref.name / ref.version
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".pull-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        lock = hub.fetch(ref, scratch)
        if published is not None:
            verify_package(scratch, expected_content_hash=published.content_hash)
        if target.exists():
            shutil.rmtree(target)
        os.rename(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    say(f"pulled {ref} into {target} ({len(lock.files)} files verified)")
    if pull_image and lock.image and lock.image_digest:
        from agentrl.hub.images import pull_image_by_digest

        pulled = pull_image_by_digest(lock.image, lock.image_digest)
        say(f"pulled image {pulled}")
    return target


def list_packages(hub: HubBackend, *, search: str | None = None, tag: str | None = None) -> list[dict[str, Any]]:
    """Latest version of each package with its description and tags, filtered by text and tag."""
    import tomllib

    rows: list[dict[str, Any]] = []
    for ref in hub.list_packages():
        data = tomllib.loads(hub.read_text(ref, MANIFEST_NAME))
        row = {"ref": ref.repo_id, "version": ref.version, "description": data.get("description", ""),
               "tags": list(data.get("tags", []))}
        if search and search.lower() not in f"{row['ref']} {row['description']}".lower():
            continue
        if tag and tag not in row["tags"]:
            continue
        rows.append(row)
    return rows


def temporary_dir(prefix: str = "agentrl-hub-") -> Path:
    """A fresh temporary folder (callers remove it)."""
    return Path(tempfile.mkdtemp(prefix=prefix))
