"""verifiers packages: find them, load them as agentrl Environments, import them as agentrl packages.

A verifiers environment package (github.com/PrimeIntellect-ai/verifiers) is a Python project:
a `pyproject.toml` whose dependencies name `verifiers` and a module named after the project
(`name = "vf-reverse"` -> `vf_reverse.py` or `vf_reverse/__init__.py`). It has no
`environment.toml`. Two APIs exist:

- **v1** (verifiers >= 0.4, `import verifiers.v1 as vf`): the module's `__all__` exports a
  `vf.Taskset` subclass; `agentrl.hub.verifiers_v1.VerifiersTasksetEnv` runs it.
- **load_environment()** (verifiers < 0.4; 0.3 keeps it as `verifiers.legacy`): the module
  defines `load_environment(**kwargs)` returning a `vf.SingleTurnEnv` / `MultiTurnEnv` /
  `ToolEnv`...; `agentrl.hub.verifiers_legacy.VerifiersLegacyEnv` runs it.

`agentrl.load_environment(FOLDER)` calls `load_verifiers_package` for such a folder, and
`agentrl env import verifiers FOLDER` (`import_verifiers_package`) writes an agentrl package:
the project's files under `verifiers_package/`, an `environment.toml` whose requirements are
the project's dependencies, and an entrypoint module that loads the copy. verifiers itself is
imported only here, inside functions (the `verifiers` extra).
"""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.hub.tree_copy import copy_tree, package_folder

__all__ = [
    "ENTRY_MODULE",
    "VerifiersProject",
    "find_verifiers_project",
    "import_verifiers_package",
    "load_verifiers_package",
    "require_verifiers",
]

ENTRY_MODULE = "verifiers_entry"
COPY_DIR = "verifiers_package"
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._\-]*)")
_SKIPPED = {"__pycache__", ".git", ".venv", "build", "dist", ".pytest_cache", "outputs"}
INSTALL_HINT = (
    "pip install 'agentrl[verifiers]' (v1 Tasksets need verifiers>=0.4; load_environment() packages "
    "need verifiers<0.4, whose 0.3 releases keep that API as verifiers.legacy)"
)


class VerifiersProject:
    """A verifiers package folder: its project name, module and dependencies (from pyproject.toml)."""

    def __init__(
        self, folder: Path, *, name: str, version: str, description: str, dependencies: list[str]
    ) -> None:
        self.folder = folder
        self.name = name
        self.version = version
        self.description = description
        self.dependencies = dependencies
        self.module = name.replace("-", "_").lower()

    def module_file(self) -> Path:
        """The module's file: `<module>.py` or `<module>/__init__.py` (NotFoundError when neither exists)."""
        for candidate in (self.folder / f"{self.module}.py", self.folder / self.module / "__init__.py"):
            if candidate.is_file():
                return candidate
        raise NotFoundError(
            f"{self.folder / 'pyproject.toml'}: project {self.name!r} has no module "
            f"{self.module}.py or {self.module}/__init__.py in the folder"
        )


def _requirement_name(requirement: str) -> str:
    match = _REQUIREMENT_NAME.match(requirement)
    return match.group(1).lower().replace("_", "-") if match else ""


def find_verifiers_project(path: str | Path) -> VerifiersProject | None:
    """The verifiers project in `path` (a folder without environment.toml whose pyproject.toml depends on
    verifiers), or None when `path` is not one."""
    folder = Path(path).expanduser()
    pyproject = folder / "pyproject.toml"
    if not folder.is_dir() or (folder / "environment.toml").is_file() or not pyproject.is_file():
        return None
    try:
        data = tomllib.loads(pyproject.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{pyproject}: malformed TOML: {error}") from None
    project = data.get("project")
    if not isinstance(project, dict):
        return None
    dependencies = [str(item) for item in project.get("dependencies") or []]
    if "verifiers" not in {_requirement_name(item) for item in dependencies}:
        return None
    name = project.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{pyproject}: [project] name is missing; a verifiers package is named by it")
    return VerifiersProject(
        folder.resolve(),
        name=name.strip(),
        version=str(project.get("version") or "0.1.0"),
        description=str(project.get("description") or ""),
        dependencies=dependencies,
    )


def require_verifiers(what: str) -> Any:
    """The installed `verifiers` module, or a one-line AgentrlError naming the extra to install."""
    try:
        import verifiers
    except ImportError:
        raise AgentrlError(
            f"{what} needs the verifiers package, which is not installed: {INSTALL_HINT}"
        ) from None
    return verifiers


def _import_module(project: VerifiersProject) -> Any:
    """Import the project's module by its own name (its modules import each other by that name), with the
    folder first on sys.path, as an installed project would be."""
    require_verifiers(f"{project.folder}: verifiers package {project.name!r}")
    module_file = project.module_file()
    loaded = sys.modules.get(project.module)
    if loaded is not None:
        origin = Path(getattr(loaded, "__file__", "") or "").resolve()
        if origin != module_file.resolve():
            raise AgentrlError(
                f"{project.folder}: a different module {project.module!r} is already imported "
                f"(from {origin}); load one package of that name per process"
            )
        return loaded
    entry = str(project.folder)
    if entry not in sys.path:
        sys.path.insert(0, entry)
    try:
        return importlib.import_module(project.module)
    except AgentrlError:
        raise
    except Exception as error:  # noqa: BLE001 - the package's own import failure, as one line
        source = module_file.read_text(errors="replace")
        if isinstance(error, (AttributeError, ImportError)) and "def load_environment" in source:
            import verifiers

            raise AgentrlError(
                f"{module_file}: import failed ({type(error).__name__}: {error}); this package uses "
                f"verifiers' load_environment() API, which verifiers "
                f"{getattr(verifiers, '__version__', '?')} does not have: "
                "install verifiers<0.4 (0.3.1 keeps it as verifiers.legacy)"
            ) from None
        raise AgentrlError(f"{module_file}: import failed: {type(error).__name__}: {error}") from None


def _taskset_class(module: Any) -> type | None:
    """The `verifiers.v1.Taskset` subclass the module exports in `__all__` (as verifiers' loader wants)."""
    try:
        from verifiers.v1 import Taskset
    except ImportError:
        return None
    found = [
        value
        for name in getattr(module, "__all__", None) or []
        if isinstance(value := getattr(module, name, None), type)
        and issubclass(value, Taskset)
        and value is not Taskset
    ]
    if len(found) > 1:
        raise AgentrlError(
            f"{module.__file__}: __all__ exports {len(found)} Taskset subclasses "
            f"({', '.join(cls.__name__ for cls in found)}); verifiers wants exactly one"
        )
    return found[0] if found else None


def load_verifiers_package(path: str | Path, **kwargs: Any):
    """The agentrl Environment running the verifiers package in `path`; `kwargs` go to its
    `load_environment(**kwargs)` (old API) or, as config fields, to its TasksetConfig (v1)."""
    project = find_verifiers_project(path)
    if project is None:
        raise NotFoundError(
            f"{path}: not a verifiers package (a folder with a pyproject.toml that depends on "
            "verifiers and no environment.toml)"
        )
    module = _import_module(project)
    taskset = _taskset_class(module)
    if taskset is not None:
        from agentrl.hub.verifiers_v1 import VerifiersTasksetEnv

        _require_v1_version(project)
        env = VerifiersTasksetEnv.from_class(taskset, name=_env_name(project.name), options=kwargs)
    elif callable(getattr(module, "load_environment", None)):
        from agentrl.hub.verifiers_legacy import VerifiersLegacyEnv

        try:
            vf_env = module.load_environment(**kwargs)
        except TypeError as error:
            raise AgentrlError(
                f"verifiers package {project.name!r}: bad arguments to load_environment: {error}"
            ) from None
        except Exception as error:  # noqa: BLE001
            raise AgentrlError(
                f"verifiers package {project.name!r}: load_environment failed: "
                f"{type(error).__name__}: {error}"
            ) from None
        env = VerifiersLegacyEnv(vf_env, name=_env_name(project.name))
    else:
        raise AgentrlError(
            f"{project.module_file()}: exports no verifiers.v1 Taskset subclass in __all__ and "
            "defines no load_environment(); a verifiers package needs one of them"
        )
    env.path = project.folder
    return env


def _require_v1_version(project: VerifiersProject) -> None:
    """v1 Tasksets are run against verifiers 0.4's v1 API (0.3's earlier v1 differs)."""
    import verifiers
    from packaging.version import InvalidVersion, Version

    installed = getattr(verifiers, "__version__", "0")
    try:
        too_old = Version(installed) < Version("0.4.0")
    except InvalidVersion:
        too_old = False
    if too_old:
        raise AgentrlError(
            f"verifiers package {project.name!r} is a v1 Taskset, which agentrl runs with verifiers>=0.4; "
            f"verifiers {installed} is installed: pip install 'agentrl[verifiers]'"
        )


def _env_name(project_name: str) -> str:
    name = re.sub(r"[^a-z0-9\-_]", "-", project_name.lower()).strip("-_") or "verifiers-env"
    return name[:64]


_ENTRY = '''"""Entrypoint of a package imported from a verifiers environment (see agentrl.hub.verifiers)."""

from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parent / "{copy_dir}"


def load_environment(**kwargs):
    from agentrl.hub.verifiers import load_verifiers_package

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
