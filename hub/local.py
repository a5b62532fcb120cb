"""The local hub: a directory of immutable, content-hashed package versions (the embedded default).

Layout under the hub root (`AGENTRL_HUB`, default `~/.agentrl/hub`):

    packages/<owner>/<name>/<version>/   one published package (see `agentrl.hub.package`)
    packages/<owner>/<name>/.lock        file lock taken while a version of that package is published
    .staging/<pid>-<random>/             a push being written; renamed into place when whole
    installed/<owner>/<name>/<version>/  packages pulled for use (`agentrl.hub.refs.find_installed`)

A version becomes visible by one `rename` of a fully written staging folder, so readers see it
whole or not at all, also when the pushing process is killed midway (its staging folder is
swept by a later push). Publishing holds a per-package file lock, so concurrent pushes of the
same package are serialised: the second finds the version and is a no-op (same content) or is
refused (different content).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from agentrl.errors import NotFoundError
from agentrl.hub.package import LOCK_NAME, PackageLock, published_files, read_lock, verify_package
from agentrl.hub.refs import (
    PackageRef,
    VersionConflictError,
    hub_root,
    installed_root,
    list_installed,
    resolve_version,
    sort_versions,
)

__all__ = ["LocalHub", "installed_environment_dirs"]


def installed_environment_dirs() -> list[Path]:
    """The folder of the latest installed version of every pulled package (searched by the SDK loader)."""
    latest: dict[str, Path] = {}
    for ref in list_installed():  # oldest first, so the last one wins
        latest[ref.repo_id] = installed_root() / ref.owner / ref.name / ref.version
    return list(latest.values())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalHub:
    """A hub in a local directory."""

    kind = "local"

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else hub_root()
        self.packages_dir = self.root / "packages"
        self.staging_root = self.root / ".staging"

    def __repr__(self) -> str:
        return f"LocalHub({str(self.root)!r})"

    # -- reading ---------------------------------------------------------------------------
    def _package_dir(self, ref: PackageRef) -> Path:
        return self.packages_dir / ref.owner / ref.name

    def versions(self, ref: PackageRef) -> list[str]:
        """Published versions of `owner/name`, oldest first."""
        folder = self._package_dir(ref)
        if not folder.is_dir():
            return []
        return sort_versions(p.name for p in folder.iterdir() if p.is_dir() and (p / LOCK_NAME).is_file())

    def resolve(self, ref: PackageRef) -> PackageRef:
        """The same reference with its version filled in (the latest when none was given)."""
        return resolve_version(
            ref, self.versions(ref), hub="in the local hub", hub_detail=f"in the local hub {self.root}",
            hint="push it with `agentrl env push` or list packages with `agentrl env list`",
        )

    def lock_of(self, ref: PackageRef) -> PackageLock | None:
        """The lock file of a published version, or None when that version does not exist."""
        if ref.version is None or ref.version not in self.versions(ref):
            return None
        return read_lock(self._package_dir(ref) / ref.version)

    def read_text(self, ref: PackageRef, relative: str) -> str:
        """One file of a published version, as text."""
        ref = self.resolve(ref)
        path = self._package_dir(ref) / ref.version / relative
        if not path.is_file():
            raise NotFoundError(f"{ref}: the package has no file {relative!r}")
        return path.read_text()

    def list_packages(self) -> list[PackageRef]:
        """Every package, at its latest version."""
        found: list[PackageRef] = []
        if not self.packages_dir.is_dir():
            return found
        for owner in sorted(p for p in self.packages_dir.iterdir() if p.is_dir()):
            for name in sorted(p for p in owner.iterdir() if p.is_dir()):
                versions = self.versions(PackageRef(owner.name, name.name))
                if versions:
                    found.append(PackageRef(owner.name, name.name, versions[-1]))
        return found

    # -- writing ---------------------------------------------------------------------------
    def new_staging_dir(self) -> Path:
        """An empty folder on the hub's filesystem to write a push into (swept if the push dies)."""
        self._sweep_staging()
        self.staging_root.mkdir(parents=True, exist_ok=True)
        path = self.staging_root / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        return path

    def _sweep_staging(self) -> None:
        if not self.staging_root.is_dir():
            return
        for path in self.staging_root.iterdir():
            pid_text = path.name.split("-", 1)[0]
            if pid_text.isdigit() and not _pid_alive(int(pid_text)):
                shutil.rmtree(path, ignore_errors=True)

    def publish(self, staged: Path, ref: PackageRef, lock: PackageLock) -> bool:
        """Move a staged package into place as `ref`; False when that version already holds it."""
        from filelock import FileLock

        folder = self._package_dir(ref)
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".lock")):
            existing = self.lock_of(ref)
            if existing is not None:
                shutil.rmtree(staged, ignore_errors=True)
                if existing.content_hash == lock.content_hash:
                    return False
                raise VersionConflictError.for_ref(ref, existing.content_hash, lock.content_hash)
            target = folder / ref.version
            if target.exists():  # a folder without a lock file is debris, never a version
                shutil.rmtree(target)
            os.rename(staged, target)
            _fsync_dir(folder)
        return True

    def fetch(self, ref: PackageRef, destination: Path) -> PackageLock:
        """Copy a published version into `destination` (absent) and verify every file's hash."""
        ref = self.resolve(ref)
        source = self._package_dir(ref) / ref.version
        published_files(source)  # no link followed into the host, no FIFO read, before anything is copied
        shutil.copytree(source, destination, symlinks=True)
        return verify_package(destination)


def _fsync_dir(path: Path) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
