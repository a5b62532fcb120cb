"""Package references (`owner/name[@version]`), version ordering, and where hubs and installs live.

`AGENTRL_HUB` moves the local hub (default `~/.agentrl/hub`); pulled packages are installed
under `<hub>/installed/<owner>/<name>/<version>/`, where `agentrl.load_environment("owner/name")`
finds them (`find_installed`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from agentrl import env_vars
from agentrl.errors import AgentrlError, NotFoundError

__all__ = ["PackageRef", "VersionConflictError", "parse_ref", "sort_versions", "resolve_version", "hub_root",
           "installed_root", "default_owner", "find_installed", "list_installed"]

_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9\-_.]{0,95}$")


@dataclass(frozen=True)
class PackageRef:
    """`owner/name` with an optional version (None: the latest)."""

    owner: str
    name: str
    version: str | None = None

    @property
    def repo_id(self) -> str:
        return f"{self.owner}/{self.name}"

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.version}" if self.version else "")


def default_owner() -> str:
    """Owner used when a push names none: `AGENTRL_HUB_OWNER`, else 'local'."""
    return env_vars.HUB_OWNER.raw()


def parse_ref(text: str, *, owner: str | None = None) -> PackageRef:
    """Parse `owner/name[@version]` (or `name[@version]` with the default owner)."""
    raw = text.strip()
    version = None
    if "@" in raw:
        raw, version = raw.rsplit("@", 1)
        if not version:
            raise AgentrlError(f"{text!r}: empty version after '@'; write owner/name@1.0.0 or leave '@' out")
    parts = raw.split("/")
    if len(parts) == 1:
        parts = [owner or default_owner(), parts[0]]
    if len(parts) != 2 or not all(_PART_RE.match(part) for part in parts):
        raise AgentrlError(f"{text!r}: not a package reference; write owner/name or owner/name@version")
    return PackageRef(owner=parts[0], name=parts[1], version=version)


def _version_key(version: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (1, Version(version), version)
    except InvalidVersion:
        return (0, Version("0"), version)


def sort_versions(versions) -> list[str]:
    """Versions oldest first (semantic order; unparsable ones first, by text)."""
    return sorted(versions, key=_version_key)


def resolve_version(ref: PackageRef, versions: list[str], *, hub: str, hub_detail: str, hint: str) -> PackageRef:
    """`ref` with its version filled in from a hub's sorted `versions` (the latest when none was given).

    `hub` names the hub in messages ("in the local hub"), `hub_detail` adds where it is, and
    `hint` says what to do when the package is missing.
    """
    if not versions:
        raise NotFoundError(f"{ref.repo_id}: no such package {hub_detail}; {hint}")
    if ref.version is None:
        return PackageRef(ref.owner, ref.name, versions[-1])
    if ref.version not in versions:
        raise NotFoundError(f"{ref.repo_id}: no version {ref.version!r} {hub} (versions: {', '.join(versions)})")
    return ref

def hub_root() -> Path:
    """The local hub directory: `AGENTRL_HUB`, else `~/.agentrl/hub`."""
    return Path(env_vars.HUB.get() or Path.home() / ".agentrl" / "hub").expanduser()


def installed_root() -> Path:
    """Where pulled packages are installed."""
    return hub_root() / "installed"


def list_installed() -> list[PackageRef]:
    """Every installed package version."""
    root = installed_root()
    found: list[PackageRef] = []
    if not root.is_dir():
        return found
    for owner in sorted(p for p in root.iterdir() if p.is_dir()):
        for name in sorted(p for p in owner.iterdir() if p.is_dir()):
            for version in sort_versions(p.name for p in name.iterdir() if p.is_dir() and not p.name.startswith(".")):
                found.append(PackageRef(owner.name, name.name, version))
    return found


def find_installed(text: str) -> Path:
    """The folder of an installed package (`owner/name[@version]`, latest version when none is given)."""
    ref = parse_ref(text)
    folder = installed_root() / ref.owner / ref.name
    versions = sort_versions(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if folder.is_dir() else []
    if not versions:
        raise NotFoundError(f"environment {ref.repo_id!r} is not installed; pull it with `agentrl env pull {ref}`")
    if ref.version is None:
        return folder / versions[-1]
    if ref.version not in versions:
        raise NotFoundError(f"environment {ref.repo_id} has no installed version {ref.version!r} "
                            f"(installed: {', '.join(versions)})")
    return folder / ref.version


class VersionConflictError(AgentrlError):
    """A version already exists on the hub with different content; versions are immutable."""

    @classmethod
    def for_ref(cls, ref: PackageRef, existing: str, new: str) -> VersionConflictError:
        return cls(f"{ref}: this version is already published with content hash {existing[:19]}..., "
                   f"the package now hashes to {new[:19]}...; versions are immutable, bump `version` "
                   "in environment.toml")
