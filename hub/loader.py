"""Find environment packages and load them: `agentrl.load_environment(name_or_path)`.

An environment package is a folder with an `environment.toml` (docs/DESIGN.md section 4,
schema in `agentrl.hub.manifest`). `load_environment` accepts

- a path to such a folder (or to its `environment.toml`);
- a built-in name: `reverse-text` -> `environments/reverse_text/` of the checkout, or of the
  package data a wheel installs (`agentrl.project_files`; `-` and `_` are interchangeable);
- a package in a directory listed in `$AGENTRL_ENV_PATH` (os.pathsep-separated), matched
  by folder name or manifest name;
- a package installed from the hub: `owner/name[@version]` (`agentrl.hub.refs.find_installed`),
  or its bare name (the hub's `agentrl.hub.local.installed_environment_dirs()`);
- a verifiers package folder (a pyproject.toml depending on verifiers, no environment.toml):
  `agentrl.hub.interop.verifiers.load_verifiers_package` runs it.

The entrypoint module is imported by `agentrl.hub.entrypoint.import_package_attr` (a private
package per environment, so same-named modules do not collide). The manifest's `env_args` and
the caller's keyword arguments (which win) go to the entrypoint.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl import env_vars
from agentrl.environment import Environment
from agentrl.errors import AgentrlError, NotFoundError
from agentrl.hub.entrypoint import import_package_attr
from agentrl.hub.local import installed_environment_dirs
from agentrl.hub.manifest import MANIFEST_NAME, load_manifest
from agentrl.hub.refs import find_installed
from agentrl.project_files import project_path

__all__ = [
    "EnvironmentInfo",
    "builtin_environments_dir",
    "check_environment_args",
    "find_environment",
    "list_environments",
    "load_environment",
    "require_environment",
]

ENV_PATH_VARIABLE = env_vars.ENV_PATH.name
_HUB_REF_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?(@[\w.+\-]+)?$")


@dataclass(frozen=True)
class EnvironmentInfo:
    """An environment package found on this machine."""

    name: str
    version: str
    description: str
    path: Path
    source: str  # "builtin", "env-path" or "hub"


def builtin_environments_dir() -> Path:
    """The built-in environment packages: `environments/` of the checkout, or the copy a wheel ships
    inside the package (`agentrl.project_files`)."""
    return project_path("environments")


def _search_roots() -> list[tuple[Path, str]]:
    roots: list[tuple[Path, str]] = [(builtin_environments_dir(), "builtin")]
    for entry in (env_vars.ENV_PATH.get() or "").split(os.pathsep):
        if entry.strip():
            roots.append((Path(entry).expanduser(), "env-path"))
    try:
        for folder in installed_environment_dirs():
            roots.append((Path(folder), "hub"))
    except AgentrlError:
        pass
    return roots


def _package_dirs(root: Path) -> list[Path]:
    """Package folders directly in `root` (or `root` itself if it is one)."""
    if (root / MANIFEST_NAME).is_file():
        return [root]
    if not root.is_dir():
        return []
    return sorted(child for child in root.iterdir() if (child / MANIFEST_NAME).is_file())


def list_environments() -> list[EnvironmentInfo]:
    """Every environment package found: built-ins, `$AGENTRL_ENV_PATH`, the local hub."""
    found: list[EnvironmentInfo] = []
    seen: set[str] = set()
    for root, source in _search_roots():
        for folder in _package_dirs(root):
            try:
                manifest = load_manifest(folder)
            except AgentrlError:
                continue  # a broken package is reported when it is loaded by path
            if manifest.name in seen:
                continue
            seen.add(manifest.name)
            found.append(EnvironmentInfo(manifest.name, manifest.version, manifest.description, folder, source))
    return found


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def find_environment(name_or_path: str | os.PathLike[str]) -> Path:
    """The package folder for a path or a name; NotFoundError lists what exists."""
    candidate = Path(name_or_path).expanduser()
    name = str(name_or_path)
    looks_like_path = os.sep in name or name.startswith((".", "~")) or candidate.is_absolute()
    if candidate.name == MANIFEST_NAME and candidate.is_file():
        return candidate.parent
    if candidate.is_dir() and (candidate / MANIFEST_NAME).is_file():
        return candidate
    if candidate.is_dir() and looks_like_path:  # a bare name that is also a local folder is looked up by name
        raise NotFoundError(f"{candidate}: no {MANIFEST_NAME} in this folder; an environment package needs one")
    if _HUB_REF_RE.match(name) and ("/" in name or "@" in name):
        return _find_installed(name)
    if not looks_like_path:
        wanted = _normalise(name)
        for root, _ in _search_roots():
            for folder in _package_dirs(root):
                if _normalise(folder.name) == wanted:
                    return folder
        for info in list_environments():
            if _normalise(info.name) == wanted:
                return info.path
    names = sorted(info.name for info in list_environments())
    available = ", ".join(names) or "none"
    what = "no such folder" if looks_like_path else "unknown environment"
    close = [] if looks_like_path else difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}" if close else ""
    raise NotFoundError(f"{what} {name!r}{hint}; available environments: {available} (or give a folder with "
                        f"{MANIFEST_NAME})")


def _find_installed(reference: str) -> Path:
    """An `owner/name[@version]` package pulled from the hub (via `agentrl.hub.refs`)."""
    try:
        return Path(find_installed(reference))
    except AgentrlError as exc:
        available = ", ".join(sorted(info.name for info in list_environments())) or "none"
        raise NotFoundError(f"{reference!r} is not a folder nor an installed hub package ({exc}); "
                            f"available environments: {available}") from None


def _verifiers_project(name_or_path: str | os.PathLike[str]) -> bool:
    """Whether `name_or_path` is the folder of a verifiers package (pyproject.toml, no environment.toml)."""
    if not (os.fspath(name_or_path) and Path(name_or_path).expanduser().is_dir()):
        return False
    from agentrl.hub.interop.verifiers import find_verifiers_project

    return find_verifiers_project(name_or_path) is not None


def require_environment(name_or_path: str | os.PathLike[str]) -> None:
    """Check that `load_environment` has something to load (a package, by name or folder, or a verifiers package's
    folder) without loading it; else the one-line NotFoundError of `find_environment`."""
    if not _verifiers_project(name_or_path):
        find_environment(name_or_path)


def _entrypoint(name_or_path: str | os.PathLike[str]) -> tuple[Path, Any, Any]:
    """An agentrl package's folder, manifest and imported entrypoint."""
    folder = find_environment(name_or_path)
    manifest = load_manifest(folder)
    return folder, manifest, import_package_attr(folder, manifest.entrypoint, package_name=manifest.name)


def _bad_arguments(manifest: Any, exc: TypeError) -> AgentrlError:
    return AgentrlError(f"environment {manifest.name!r}: bad arguments to {manifest.entrypoint}: {exc}")


def check_environment_args(name_or_path: str | os.PathLike[str], args: dict[str, Any]) -> None:
    """The arguments `load_environment` would pass, checked against the entrypoint's signature without building the
    environment (`--dry-run`): an unknown name or argument is the same one line. Verifiers packages are checked
    when they load (their entrypoint runs in its own venv)."""
    if _verifiers_project(name_or_path):
        return
    _, manifest, factory = _entrypoint(name_or_path)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin or C callable): the load will tell
        return
    try:
        signature.bind(**{**manifest.env_args, **args})
    except TypeError as exc:
        raise _bad_arguments(manifest, exc) from None


def load_environment(name_or_path: str | os.PathLike[str], **kwargs: Any):
    """Load an environment package by name or path and return its Environment."""
    if _verifiers_project(name_or_path):
        from agentrl.hub.interop.verifiers import load_verifiers_package

        return load_verifiers_package(name_or_path, **kwargs)
    folder, manifest, factory = _entrypoint(name_or_path)
    arguments = {**manifest.env_args, **kwargs}
    try:
        env = factory(**arguments)
    except AgentrlError:
        raise
    except TypeError as exc:
        raise _bad_arguments(manifest, exc) from exc
    except Exception as exc:
        raise AgentrlError(
            f"environment {manifest.name!r}: {manifest.entrypoint} failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(env, Environment):
        raise AgentrlError(
            f"environment {manifest.name!r}: {manifest.entrypoint} returned {type(env).__name__}, "
            "not an agentrl Environment"
        )
    if env.name == Environment.name:
        env.name = manifest.name
    env.manifest = manifest
    env.path = folder
    return env
