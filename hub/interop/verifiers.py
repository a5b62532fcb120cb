"""verifiers packages: find them, load them as agentrl Environments, import them as agentrl packages.

A verifiers environment package (github.com/PrimeIntellect-ai/verifiers) is a Python project:
a `pyproject.toml` whose dependencies name `verifiers` and a module named after the project
(`name = "vf-reverse"` -> `vf_reverse.py` or `vf_reverse/__init__.py`). It has no
`environment.toml`. Two APIs exist:

- **v1** (verifiers >= 0.4, `import verifiers.v1 as vf`): the module's `__all__` exports a
  `vf.Taskset` subclass; `agentrl.hub.interop.verifiers_v1.VerifiersTasksetEnv` runs it.
- **load_environment()** (verifiers < 0.4; 0.3 keeps it as `verifiers.legacy`): the module
  defines `load_environment(**kwargs)` returning a `vf.SingleTurnEnv` / `MultiTurnEnv` /
  `ToolEnv`...; `agentrl.hub.interop.verifiers_legacy.VerifiersLegacyEnv` runs it.

`agentrl.load_environment(FOLDER)` calls `load_verifiers_package` for such a folder, and
`agentrl env import verifiers FOLDER` (`import_verifiers_package`) writes an agentrl package:
the project's files under `verifiers_package/`, an `environment.toml` whose requirements are
the project's dependencies, and an entrypoint module that loads the copy. verifiers itself is
imported only here, inside functions (the `verifiers` extra).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from agentrl import env_vars
from agentrl.errors import NotFoundError
from agentrl.hub.interop.verifiers_project import (
    _SKIPPED,
    VerifiersProject,
    _env_name,
    _fits,
    detect_api,
    find_verifiers_project,
    installed_verifiers,
    load_in_process,
    require_verifiers,
)
from agentrl.hub.tree_copy import copy_tree, package_folder

__all__ = [
    "ENTRY_MODULE",
    "VerifiersProject",
    "detect_api",
    "find_verifiers_project",
    "import_verifiers_package",
    "load_verifiers_package",
    "require_verifiers",
]

ENTRY_MODULE = "verifiers_entry"
COPY_DIR = "verifiers_package"

def load_verifiers_package(path: str | Path, **kwargs: Any):
    """The agentrl Environment running the verifiers package in `path`; `kwargs` go to its
    `load_environment(**kwargs)` (old API) or, as config fields, to its TasksetConfig (v1).

    Where this environment has the verifiers the package's API needs (or inside the package's worker),
    the package runs in this process; otherwise in a worker process on the venv `agentrl env install`
    made for it (`agentrl.hub.interop.verifiers_proxy`); without either, one line says to run that command."""
    project = find_verifiers_project(path)
    if project is None:
        raise NotFoundError(
            f"{path}: not a verifiers package (a folder with a pyproject.toml, no environment.toml, whose "
            "dependencies name verifiers or whose module imports it)"
        )
    project.module_file()
    if not env_vars.VERIFIERS_WORKER.is_on() and not _fits(project, installed_verifiers()):
        from agentrl.hub.interop.verifiers_venv import find_package_venv

        venv = find_package_venv(project)
        if venv is not None:
            from agentrl.hub.interop.verifiers_proxy import VerifiersWorkerEnv

            return VerifiersWorkerEnv.start(project, venv, kwargs)
    return load_in_process(project, kwargs)


_ENTRY = '''"""Entrypoint of a package imported from a verifiers environment (see agentrl.hub.interop.verifiers)."""

from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent / "{copy_dir}"


def load_environment(**kwargs):
    from agentrl.hub.interop.verifiers import load_verifiers_package

    return load_verifiers_package(PROJECT_DIR, **kwargs)


def build_dataset():
    env = load_environment()
    return {{split: env.get_dataset(split) for split in env.splits}}
'''


def import_verifiers_package(
    path: str | Path, *, out: str | Path | None = None, name: str | None = None
) -> Path:
    """Write an agentrl package (in `out`, default ./<name>) that runs the verifiers package in `path`."""
    from agentrl.hub.manifest import load_manifest

    project = find_verifiers_project(path)
    if project is None:
        raise NotFoundError(
            f"{path}: not a verifiers package (needs a pyproject.toml whose dependencies name "
            "verifiers, and no environment.toml)"
        )
    project.module_file()
    env_name = _env_name(name or project.name)
    target = Path(out) if out is not None else Path.cwd() / env_name
    with package_folder(target) as staging:
        _write_package(staging, project, env_name)
        load_manifest(staging)  # what was written validates
    return target


def _write_package(target: Path, project: VerifiersProject, env_name: str) -> None:
    """The package's files: the project copied (links checked, see hub/tree_copy.py), entry, manifest, README."""
    import tomli_w

    copy_tree(project.folder, target / COPY_DIR, ignore=lambda name: name in _SKIPPED)
    (target / f"{ENTRY_MODULE}.py").write_text(_ENTRY.format(copy_dir=COPY_DIR))
    version = project.version if re.match(r"^\d+\.\d+\.\d+", project.version) else "0.1.0"
    manifest = {
        "name": env_name,
        "version": version,
        "description": project.description or f"verifiers environment {project.name}",
        "tags": ["verifiers"],
        "entrypoint": f"{ENTRY_MODULE}:load_environment",
        "requirements": project.dependencies,
        "reward": {"description": f"verifiers' own reward functions of {project.name} (see {COPY_DIR}/)"},
        "dataset": {"generator": f"{ENTRY_MODULE}:build_dataset"},
    }
    (target / "environment.toml").write_text(tomli_w.dumps(manifest))
    readme = project.folder / "README.md"
    note = (
        f"# {env_name}\n\nImported with `agentrl env import verifiers` from the verifiers package "
        f"`{project.name}` {project.version}; its files are in `{COPY_DIR}/`, unchanged.\n"
    )
    (target / "README.md").write_text(
        note + ("\n" + readme.read_text(errors="replace") if readme.is_file() and not readme.is_symlink() else "")
    )
