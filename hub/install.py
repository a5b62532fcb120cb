"""`agentrl env install`: install a package's Python requirements (from `environment.toml`) with pip.

The target is a package folder or `owner/name[@version]` of a pulled package. Every
requirement is parsed first (PEP 508), so a malformed one is reported by name before pip
runs; pip runs in the current interpreter (`python -m pip install ...`).

A verifiers package (its folder, or a package `agentrl env import verifiers` wrote) never goes
into agentrl's own environment: `install_target` makes its own venv (`agentrl.hub.interop.verifiers_venv`),
which the loader then runs it from.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.hub.manifest import MANIFEST_NAME, load_manifest

__all__ = ["install_requirements", "install_target", "resolve_package_dir", "verifiers_project_of"]


def verifiers_project_of(target: str | Path):
    """The verifiers project a target runs: its folder itself, or an imported package's copy; else None."""
    from agentrl.hub.interop.verifiers import COPY_DIR, find_verifiers_project

    folder = Path(target)
    if not folder.is_dir():
        return None
    project = find_verifiers_project(folder)
    if project is None and (folder / MANIFEST_NAME).is_file() and (folder / COPY_DIR).is_dir():
        project = find_verifiers_project(folder / COPY_DIR)
    return project


def install_target(target: str | Path, *, dry_run: bool = False, log=lambda line: None) -> str:
    """`agentrl env install`: a verifiers package's venv, else the package's requirements with pip; one line."""
    project = verifiers_project_of(target)
    if project is None and not Path(target).exists():
        from agentrl.hub.refs import find_installed

        project = verifiers_project_of(find_installed(str(target)))
    if project is not None:
        from agentrl.hub.interop.verifiers_project import check_module
        from agentrl.hub.interop.verifiers_venv import make_package_venv, venv_requirements

        check_module(project)  # a missing module, a syntax error or no entry point: now, not at the first eval

        if dry_run:
            return f"would make a venv for {project.name} with: {' '.join(venv_requirements(project))}"
        folder = make_package_venv(project, log=log)
        return f"{project.name} runs in {folder} (agentrl's own environment unchanged)"
    command = install_requirements(target, dry_run=dry_run)
    return " ".join(command) if command else "no requirements to install"


def resolve_package_dir(target: str | Path) -> Path:
    """A package folder from a path, or the install folder of a pulled `owner/name[@version]`."""
    folder = Path(target)
    if folder.exists():
        if not (folder / MANIFEST_NAME).is_file():
            raise NotFoundError(
                f"{folder}: no {MANIFEST_NAME}; give a package folder or owner/name of a pulled package"
            )
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
