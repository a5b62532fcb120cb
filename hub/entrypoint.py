"""Import an environment package's entrypoint: `import_package_attr(folder, "module:attr")`.

The module is imported from the package folder as a submodule of a private package
(`_agentrl_env_<name>_<hash>`), so two packages with the same module name do not collide.
Sibling modules may be imported relatively (`from . import data`) or by bare name at module
level (`from swe_task import X`): the folder is on `sys.path` only while the package is
imported, and the siblings loaded meanwhile are moved under the private package (a bare-name
import inside a function, run later, would not find them). `agentrl.hub.loader` loads
environments through it; package validation and the SWE-bench import use it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import re
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.hub.manifest import MANIFEST_NAME

__all__ = ["import_package_attr"]

_IMPORT_LOCK = threading.RLock()


def _private_package(folder: Path, name: str) -> str:
    digest = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:10]
    package_name = f"_agentrl_env_{re.sub(r'[^0-9A-Za-z_]', '_', name)}_{digest}"
    if package_name not in sys.modules:
        package = types.ModuleType(package_name)
        package.__path__ = [str(folder.resolve())]  # type: ignore[attr-defined]
        package.__package__ = package_name
        package.__file__ = None
        sys.modules[package_name] = package
    return package_name


@contextlib.contextmanager
def _siblings_importable(folder: Path, package: str) -> Iterator[None]:
    """Let the package's modules import siblings by bare name (`from swe_task import X`) while
    it is imported; afterwards take the folder off sys.path and move those sibling modules
    to private names, so packages with same-named modules do not collide."""
    entry = str(folder.resolve())
    root = folder.resolve()
    before = set(sys.modules)
    with _IMPORT_LOCK:
        sys.path.insert(0, entry)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)
            for name in set(sys.modules) - before:
                if name == package or name.startswith(package + "."):
                    continue
                module = sys.modules.get(name)
                file = getattr(module, "__file__", None)
                if file and Path(file).resolve().is_relative_to(root):
                    sys.modules.pop(name, None)
                    sys.modules.setdefault(f"{package}.{name}", module)


def import_package_attr(folder: str | os.PathLike[str], spec: str, *, package_name: str | None = None) -> Any:
    """Import `module:attr` from an environment package folder (no sys.path changes)."""
    folder = Path(folder)
    if ":" not in spec:
        raise AgentrlError(f"{folder / MANIFEST_NAME}: {spec!r} must look like 'module:function'")
    module_name, attr = spec.split(":", 1)
    package = _private_package(folder, package_name or folder.name)
    module_file = folder.joinpath(*module_name.split(".")).with_suffix(".py")
    module_pkg = folder.joinpath(*module_name.split(".")) / "__init__.py"
    if not module_file.is_file() and not module_pkg.is_file():
        raise NotFoundError(
            f"{folder / MANIFEST_NAME}: entrypoint module {module_name!r} not found ({module_file.name} is missing)"
        )
    try:
        with _siblings_importable(folder, package):
            module = importlib.import_module(f"{package}.{module_name}")
    except AgentrlError:
        raise
    except Exception as exc:
        raise AgentrlError(f"{module_file}: import failed: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise NotFoundError(f"{module_file}: has no {attr!r} (named by {spec!r} in {MANIFEST_NAME})") from None
