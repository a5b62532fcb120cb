"""`agentrl env install`: install a package's Python requirements (from `environment.toml`) with pip.

The target is a package folder or `owner/name[@version]` of a pulled package. Every
requirement is parsed first (PEP 508), so a malformed one is reported by name before pip
runs; pip runs in the current interpreter (`python -m pip install ...`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.hub.manifest import MANIFEST_NAME, load_manifest

__all__ = ["resolve_package_dir", "install_requirements"]


def resolve_package_dir(target: str | Path) -> Path:
    """A package folder from a path, or the install folder of a pulled `owner/name[@version]`."""
    folder = Path(target)
    if folder.exists():
        if not (folder / MANIFEST_NAME).is_file():
            raise NotFoundError(f"{folder}: no {MANIFEST_NAME}; give a package folder or owner/name of a pulled package")
        return folder
    from agentrl.hub.refs import find_installed

    return find_installed(str(target))


def install_requirements(target: str | Path, *, dry_run: bool = False) -> list[str]:
    """Run pip on the package's requirements; returns the command ([] when there is nothing to install)."""
    from packaging.requirements import InvalidRequirement, Requirement

    folder = resolve_package_dir(target)
    manifest = load_manifest(folder)
    for index, text in enumerate(manifest.requirements):
        try:
            Requirement(text)
        except InvalidRequirement as error:
            raise ConfigError(f"{folder / MANIFEST_NAME}: requirements[{index}] {text!r} is not a pip requirement "
                              f"({str(error).splitlines()[0]})") from None
    if not manifest.requirements:
        return []
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *manifest.requirements]
    if dry_run:
        return command
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = " | ".join(line for line in result.stderr.strip().splitlines()[-3:])
        raise AgentrlError(f"pip could not install the requirements of {manifest.name}: {tail}")
    return command
