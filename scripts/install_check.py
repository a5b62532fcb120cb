#!/usr/bin/env python3
"""Is this checkout already installed here, as scripts/install.sh would install it? Exit 0 if so.

    PYTHON scripts/install_check.py CHECKOUT EXTRA[,EXTRA...]

Run by the interpreter install.sh installs for (the venv's, or a private python3), before pip:
exit 0 (and pip is skipped: a second install.sh is a no-op) only when

- `agentrl` imports from CHECKOUT (an editable install of this checkout, not of another one);
- the installed distribution's version, requirements (base + each wanted extra) and entry points
  are the ones CHECKOUT's pyproject.toml declares now (a changed pyproject.toml reinstalls);
- every one of those requirements is installed at a version it allows, and the `agentrl`
  console script exists.

Otherwise it prints the first reason on one line and exits 1. Standard library, plus `packaging`
when it is there (agentrl depends on it; without it the answer is 1).
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import sys
import sysconfig
import tomllib
from pathlib import Path


def _reason(checkout: Path, extras: list[str]) -> str | None:
    spec = importlib.util.find_spec("agentrl")
    if spec is None or spec.origin is None:
        return "agentrl is not installed"
    where = Path(spec.origin).resolve().parent.parent
    if where != checkout:
        return f"agentrl imports from {where}, not {checkout}"
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:
        return "packaging is not installed"
    try:
        dist = metadata.distribution("agentrl")
    except metadata.PackageNotFoundError:
        return "agentrl has no installed metadata"
    project = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]
    if dist.version != project["version"]:
        return f"agentrl {dist.version} is installed, pyproject.toml says {project['version']}"
    declared = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in declared]
    if unknown:
        return f"pyproject.toml declares no extra {', '.join(unknown)}"
    if not set(extras) <= set(dist.metadata.get_all("Provides-Extra") or []):
        return f"agentrl is installed without the extras {','.join(extras)}"

    def key(requirement: Requirement) -> tuple:
        name = canonicalize_name(requirement.name)
        return name, str(requirement.specifier), tuple(sorted(requirement.extras))

    def applies(requirement: Requirement, extra: str) -> bool:
        return requirement.marker is None or requirement.marker.evaluate({"extra": extra})

    wanted = {key(Requirement(text)) for text in project.get("dependencies", [])}
    for extra in extras:
        wanted |= {key(Requirement(text)) for text in declared[extra]
                   if applies(Requirement(text), extra)}
    installed_reqs = [Requirement(text) for text in dist.requires or []]
    recorded = {key(r) for r in installed_reqs if any(applies(r, extra) for extra in ["", *extras])}
    if wanted != recorded:
        return "pyproject.toml's requirements changed since agentrl was installed"
    points = {(point.group, point.name, point.value) for point in dist.entry_points}
    declared_points = {("console_scripts", name, value) for name, value in project.get("scripts", {}).items()}
    for group, entries in project.get("entry-points", {}).items():
        declared_points |= {(group, name, value) for name, value in entries.items()}
    if points != declared_points:
        return "pyproject.toml's entry points changed since agentrl was installed"
    for name, specifier, _ in sorted(wanted):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            return f"{name} is not installed"
        if not Requirement(f"{name}{specifier}").specifier.contains(version, prereleases=True):
            return f"{name} {version} is installed, agentrl needs {name}{specifier}"
    script = Path(sysconfig.get_path("scripts")) / "agentrl"
    if not script.exists():
        return f"{script} is missing"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    checkout = Path(argv[0]).resolve()
    extras = [extra for extra in argv[1].split(",") if extra]
    reason = _reason(checkout, extras)
    if reason is not None:
        print(reason)
        return 1
    print(f"agentrl from {checkout} is installed with {','.join(extras) or 'no extras'}; nothing to do")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
