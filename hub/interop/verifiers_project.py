"""A verifiers package on disk: detect it and its API, check the verifiers it needs, load it in this process.

`find_verifiers_project(FOLDER)` reads a project folder (its `pyproject.toml`, its module) into a
`VerifiersProject` with the API it uses (`detect_api`: what the module defines, v1 Tasksets and Envs
or `load_environment()`); `installed_verifiers` / `require_verifiers` say whether this environment
can run it; `load_in_process` builds the agentrl Environment here
(`verifiers_v1.VerifiersTasksetEnv` or `verifiers_legacy.VerifiersLegacyEnv`). `agentrl.hub.interop.verifiers`
decides where a package runs (here, or in a worker process on its own venv: `verifiers_proxy`,
`verifiers_worker`, which load it here in turn) and writes agentrl packages of them.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

from agentrl import env_vars
from agentrl.errors import AgentrlError, ConfigError, NotFoundError

_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._\-]*)")
_SKIPPED = {"__pycache__", ".git", ".venv", "build", "dist", ".pytest_cache", "outputs"}
WORKER_ENV = env_vars.VERIFIERS_WORKER.name
"""Set in the worker process (`verifiers_worker`): load the package here, never through another worker."""
_V1_BASES = {"Taskset", "Env", "SingleAgentEnv", "Task", "TaskData", "Toolset", "Harness"}


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
        self.api = "legacy"
        """`v1` (verifiers >= 0.4: `import verifiers.v1`, Taskset/Env subclasses) or `legacy` (`load_environment()`)."""

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


def _module_sources(project: VerifiersProject) -> list[Path]:
    """The module's Python files: `<module>.py`, or every file of the `<module>/` package (at most 200)."""
    single = project.folder / f"{project.module}.py"
    if single.is_file():
        return [single]
    package = project.folder / project.module
    if not (package / "__init__.py").is_file():
        return []
    found: list[Path] = []
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED)
        found += [Path(root) / name for name in sorted(files) if name.endswith(".py")]
        if len(found) >= 200:
            break
    return found[:200]


def detect_api(sources: list[Path]) -> str | None:
    """Which verifiers API the module's files use, from what they define (no import): `v1` when they import
    `verifiers.v1` or subclass its Taskset/Env/Task types, `legacy` when they import verifiers otherwise,
    None when they never import verifiers."""
    uses_verifiers = v1 = False
    for source in sources:
        try:
            tree = ast.parse(source.read_bytes(), filename=str(source))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(name == "verifiers" or name.startswith("verifiers.") for name in names):
                uses_verifiers = True
                v1 = v1 or any(name == "verifiers.v1" or name.startswith("verifiers.v1.") for name in names)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(base, (ast.Attribute, ast.Subscript)) and _base_name(base) in _V1_BASES
                for base in node.bases
            ):
                v1 = v1 or uses_verifiers
    if not uses_verifiers:
        return None
    return "v1" if v1 else "legacy"


def check_module(project: VerifiersProject) -> None:
    """What `agentrl env install` can tell without importing: the module's file exists, its files parse, and its
    top level defines or imports `load_environment` or sets `__all__` (a v1 package's exports); else a one-line
    error naming the file (the import would fail the same way at the first eval or train)."""
    module_file = project.module_file()
    for source in _module_sources(project):
        try:
            tree = ast.parse(source.read_bytes(), filename=str(source))
        except SyntaxError as error:
            raise ConfigError(f"{source}:{error.lineno}: syntax error: {error.msg}") from None
        except ValueError as error:  # NUL bytes
            raise ConfigError(f"{source}: not Python source ({error})") from None
        if source != module_file:
            continue
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(target.id for target in targets if isinstance(target, ast.Name))
        if not names & {"load_environment", "__all__"}:
            raise ConfigError(f"{module_file}: defines no load_environment() and no __all__ (a v1 package's "
                              "Taskset or Env); a verifiers package needs one of them")


def _base_name(base: ast.expr) -> str:
    if isinstance(base, ast.Subscript):
        base = base.value
    return base.attr if isinstance(base, ast.Attribute) else ""


def find_verifiers_project(path: str | Path) -> VerifiersProject | None:
    """The verifiers project in `path` (a folder without environment.toml whose pyproject.toml depends on
    verifiers, or whose module imports it), or None when `path` is not one."""
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
    declared = "verifiers" in {_requirement_name(item) for item in dependencies}
    name = project.get("name")
    if not isinstance(name, str) or not name.strip():
        if not declared:
            return None
        raise ConfigError(f"{pyproject}: [project] name is missing; a verifiers package is named by it")
    found = VerifiersProject(
        folder.resolve(),
        name=name.strip(),
        version=str(project.get("version") or "0.1.0"),
        description=str(project.get("description") or ""),
        dependencies=dependencies,
    )
    api = detect_api(_module_sources(found))
    if api is None and not declared:
        return None  # neither lists nor imports verifiers
    found.api = api or "legacy"
    return found


def installed_verifiers() -> str | None:
    """The version of verifiers installed in this process's environment (no import), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verifiers")
    except PackageNotFoundError:
        return None


def _fits(project: VerifiersProject, version: str | None) -> bool:
    """Whether verifiers `version` has the package's API (v1: >= 0.4; load_environment(): < 0.4)."""
    from packaging.version import InvalidVersion, Version

    if version is None:
        return False
    try:
        new = Version(version) >= Version("0.4.0")
    except InvalidVersion:
        return False
    return new if project.api == "v1" else not new


def require_verifiers(project: VerifiersProject) -> Any:
    """The installed `verifiers` module when it has the package's API, else a one-line AgentrlError."""
    from agentrl.hub.interop.verifiers_venv import api_requirement

    version = installed_verifiers()
    if not _fits(project, version):
        have = f"verifiers {version} is installed here" if version else "verifiers is not installed here"
        raise AgentrlError(
            f"verifiers package {project.name!r} ({'v1' if project.api == 'v1' else 'load_environment()'} API, "
            f"{api_requirement(project.api)}): {have}; run `agentrl env install {project.folder}` "
            "(its own venv; agentrl's environment is left unchanged)"
        )
    import verifiers

    return verifiers


def _missing_module(error: BaseException) -> str | None:
    """The top-level module a failed import could not find, when that was the failure."""
    if isinstance(error, ModuleNotFoundError) and error.name:
        return error.name.split(".")[0]
    return None


def _import_module(project: VerifiersProject) -> Any:
    """Import the project's module by its own name (its modules import each other by that name), with the
    folder first on sys.path, as an installed project would be."""
    verifiers = require_verifiers(project)
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
        missing = _missing_module(error)
        if missing is not None and missing not in ("verifiers", project.module):
            listed = any(_requirement_name(item) == missing.replace("_", "-") for item in project.dependencies)
            raise AgentrlError(
                f"{module_file}: import failed: the package needs the module {missing!r}, which is not installed "
                + ("(its dependencies list it: run `agentrl env install " + str(project.folder) + "`)" if listed
                   else f"and not among its [project] dependencies: add the package that provides {missing!r} "
                   "to pyproject.toml, then `agentrl env install " + str(project.folder) + "`")
            ) from None
        if isinstance(error, (AttributeError, ImportError)) and (missing == "verifiers" or "verifiers" in str(error)):
            raise AgentrlError(
                f"{module_file}: import failed ({type(error).__name__}: {error}) under verifiers "
                f"{getattr(verifiers, '__version__', '?')}: the package may need another verifiers release; "
                "pin it in its [project] dependencies and run `agentrl env install " + str(project.folder) + "`"
            ) from None
        raise AgentrlError(f"{module_file}: import failed: {type(error).__name__}: {error}") from None


def _exported_class(module: Any, base_name: str) -> type | None:
    """The `verifiers.v1.<base_name>` subclass the module exports in `__all__` (as verifiers' loader wants)."""
    try:
        import verifiers.v1 as vf
    except ImportError:
        return None
    base = getattr(vf, base_name)
    found = [
        value
        for name in getattr(module, "__all__", None) or []
        if isinstance(value := getattr(module, name, None), type)
        and issubclass(value, base)
        and value is not base
        and value.__module__.split(".")[0] != "verifiers"
    ]
    if len(found) > 1:
        raise AgentrlError(
            f"{module.__file__}: __all__ exports {len(found)} {base_name} subclasses "
            f"({', '.join(cls.__name__ for cls in found)}); verifiers wants exactly one"
        )
    return found[0] if found else None


def load_in_process(project: VerifiersProject, kwargs: dict[str, Any]):
    """The package's Environment in this process (verifiers importable here)."""
    module = _import_module(project)
    taskset = _exported_class(module, "Taskset") if project.api == "v1" else None
    env_class = _exported_class(module, "Env") if project.api == "v1" else None
    if taskset is not None or env_class is not None:
        from agentrl.hub.interop.verifiers_v1 import VerifiersTasksetEnv

        env = VerifiersTasksetEnv.from_package(
            taskset, env_class, module=project.module, name=_env_name(project.name), options=dict(kwargs)
        )
    elif callable(getattr(module, "load_environment", None)):
        from agentrl.hub.interop.verifiers_legacy import VerifiersLegacyEnv

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
            f"{project.module_file()}: exports no verifiers.v1 Taskset or Env subclass in __all__ and "
            "defines no load_environment(); a verifiers package needs one of them"
        )
    env.path = project.folder
    return env


def _env_name(project_name: str) -> str:
    name = re.sub(r"[^a-z0-9\-_]", "-", project_name.lower()).strip("-_") or "verifiers-env"
    return name[:64]
