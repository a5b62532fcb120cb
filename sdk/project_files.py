"""Where the project's own files are: the built-in environments and the cookbook recipes.

    from agentrl.project_files import project_root, project_path, resolve_project_path
    project_path("environments")                      # the built-in environment packages
    project_path("cookbook", "cpu-default", "train.toml")
    resolve_project_path("cookbook/cpu-default/tiny-moe-sft")   # a recipe's relative path

`environments/` and `cookbook/` live at the top of a checkout, beside `sdk/`. A wheel
ships them as package data inside the package (`agentrl/environments/`,
`agentrl/cookbook/`, see pyproject.toml), so `project_root()` is

- the installed package folder (`importlib.resources.files("agentrl")`) when it holds
  both folders: a wheel install (`pip install agentrl-*.whl`, `pip install .`);
- else the folder above the real `sdk/` (symlinks resolved): a checkout, whether
  installed editable (`pip install -e .`) or put on the path another way.

Everything that reads those folders (RunConfig's defaults, the loader's built-ins, the
baseline of `agentrl eval --model RUN/checkpoints/step_N`) goes through this module.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from pathlib import Path

from agentrl.errors import NotFoundError

__all__ = ["PROJECT_DIRS", "project_path", "project_root", "resolve_project_path"]

#: The folders a wheel ships as package data and a checkout has at its top.
PROJECT_DIRS = ("environments", "cookbook")


def _holds_project_dirs(folder: Path) -> bool:
    return all((folder / name).is_dir() for name in PROJECT_DIRS)


@functools.cache
def project_root() -> Path:
    """The folder that holds `environments/` and `cookbook/` (the package folder of a wheel install,
    else the checkout); NotFoundError when neither has them."""
    import agentrl

    installed = importlib.resources.files("agentrl")
    candidates = []
    if isinstance(installed, Path):  # a package unpacked on disk (pip never installs zipped)
        candidates.append(installed)
    sdk = Path(agentrl.__file__).resolve().parent
    candidates += [sdk, sdk.parent]
    for folder in candidates:
        if _holds_project_dirs(folder):
            return folder
    raise NotFoundError(
        f"agentrl's {' and '.join(PROJECT_DIRS)} folders are neither in the installed package ({installed}) "
        f"nor in a checkout above {sdk}; reinstall agentrl (pip install agentrl-*.whl, or pip install -e DIR)"
    )


def project_path(*parts: str) -> Path:
    """A path inside the project's files, e.g. `project_path("cookbook", "cpu-default", "train.toml")`."""
    return project_root().joinpath(*parts)


def resolve_project_path(path: str | os.PathLike[str]) -> Path:
    """`path` as given when it exists (or is absolute); a relative path that does not exist here but
    does in the project's files (recipes name `cookbook/...`) resolved there; else `path` unchanged."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return given
    try:
        inside = project_root() / given
    except NotFoundError:
        return given
    return inside if inside.exists() else given
