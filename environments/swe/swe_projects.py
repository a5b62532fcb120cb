"""The real open-source projects the `swe` tasks are generated from, pinned by sdist digest.

Each project is a pure-Python PyPI package whose source distribution ships its test
suite, under a permissive licence, whose tests run offline in a few seconds. The sdist is
downloaded on the host (`pip download --no-binary :all: --no-deps`), checked against the
pinned sha256, and copied into the project's sandbox image (see `swe_images.py`), where it
is unpacked into `/testbed` as a git repository.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from agentrl import env_vars
from agentrl.errors import AgentrlError, NotFoundError

__all__ = ["PROJECTS", "Project", "fetch_sdist", "get_project", "sdist_cache_dir"]


@dataclass(frozen=True)
class Project:
    """One upstream project at a fixed version."""

    name: str
    """PyPI distribution name."""
    version: str
    """The pinned version."""
    sdist: str
    """File name of the source distribution on PyPI."""
    sha256: str
    """Digest of that file; a download with another digest is refused."""
    license: str
    """SPDX licence identifier (checked in the sdist's LICENSE file)."""
    homepage: str
    """Upstream repository."""
    source_root: str
    """Folder (relative to /testbed) that goes on PYTHONPATH."""
    packages: tuple[str, ...]
    """Source files or folders (relative to /testbed) whose functions get mutated."""
    tests: tuple[str, ...]
    """Test files or folders (relative to /testbed) pytest collects."""
    skip_modules: tuple[str, ...] = field(default=())
    """Source files never mutated (version strings, platform shims, vendored code)."""

    @property
    def slug(self) -> str:
        """Lower-case identifier used in image names and instance ids."""
        return self.name.lower().replace("_", "-")

    @property
    def image_name(self) -> str:
        """The local sandbox image for this project."""
        return f"agentrl-swe/{self.slug}:{self.version}"


PROJECTS: tuple[Project, ...] = (
    Project(
        name="inflection", version="0.5.1", sdist="inflection-0.5.1.tar.gz",
        sha256="1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
        license="MIT", homepage="https://github.com/jpvanhal/inflection",
        source_root=".", packages=("inflection/__init__.py",), tests=("test_inflection.py",),
    ),
    Project(
        name="isodate", version="0.7.2", sdist="isodate-0.7.2.tar.gz",
        sha256="4cd1aa0f43ca76f4a6c6c0292a85f40b35ec2e43e315b59f06e6d32171a953e6",
        license="BSD-3-Clause", homepage="https://github.com/gweis/isodate",
        source_root="src", packages=("src/isodate",), tests=("tests",),
        skip_modules=("src/isodate/version.py", "src/isodate/__init__.py", "src/isodate/isoerror.py"),
    ),
    Project(
        name="toolz", version="1.2.0", sdist="toolz-1.2.0.tar.gz",
        sha256="9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
        license="BSD-3-Clause", homepage="https://github.com/pytoolz/toolz",
        source_root=".",
        packages=("toolz/itertoolz.py", "toolz/dicttoolz.py", "toolz/functoolz.py", "toolz/recipes.py"),
        tests=("toolz/tests",),
    ),
    Project(
        name="parse", version="1.22.4", sdist="parse-1.22.4.tar.gz",
        sha256="706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5",
        license="MIT", homepage="https://github.com/r1chardj0n3s/parse",
        source_root=".", packages=("parse/__init__.py",), tests=("tests",),
    ),
    Project(
        name="tabulate", version="0.10.0", sdist="tabulate-0.10.0.tar.gz",
        sha256="e2cfde8f79420f6deeffdeda9aaec3b6bc5abce947655d17ac662b126e48a60d",
        license="MIT", homepage="https://github.com/astanin/python-tabulate",
        source_root=".", packages=("tabulate/__init__.py",), tests=("test",),
    ),
    Project(
        name="boltons", version="26.2.0", sdist="boltons-26.2.0.tar.gz",
        sha256="d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c",
        license="BSD-3-Clause", homepage="https://github.com/mahmoud/boltons",
        source_root=".",
        packages=(
            "boltons/strutils.py", "boltons/iterutils.py", "boltons/dictutils.py", "boltons/setutils.py",
            "boltons/listutils.py", "boltons/mathutils.py", "boltons/urlutils.py", "boltons/timeutils.py",
            "boltons/statsutils.py", "boltons/cacheutils.py", "boltons/queueutils.py",
        ),
        tests=("tests",),
    ),
)


def get_project(name: str) -> Project:
    """The project called `name`, or a one-line error listing the known ones."""
    for project in PROJECTS:
        if project.name == name or project.slug == name:
            return project
    known = ", ".join(project.name for project in PROJECTS)
    raise NotFoundError(f"swe: unknown project {name!r}; known projects: {known}")


def sdist_cache_dir() -> Path:
    """Where downloaded sdists are kept: $AGENTRL_CACHE/swe/sdists or ~/.cache/agentrl/swe/sdists."""
    root = Path(env_vars.CACHE.get() or Path.home() / ".cache" / "agentrl")
    path = root / "swe" / "sdists"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(project: Project) -> Path:
    """Return the project's sdist from the cache, downloading it from PyPI when missing.

    The file's sha256 must equal the pinned one; a mismatch is an error and the file is
    not used.
    """
    cache = sdist_cache_dir()
    path = cache / project.sdist
    if not path.exists():
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
            "--dest", str(cache), f"{project.name}=={project.version}",
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0 or not path.exists():
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or [""]
            raise AgentrlError(
                f"swe: could not download {project.sdist} from PyPI ({tail[0]}); "
                f"put the file in {cache} or check the network"
            )
    actual = _sha256(path)
    if actual != project.sha256:
        raise AgentrlError(
            f"swe: {path} has sha256 {actual}, expected {project.sha256}; delete the file and retry"
        )
    return path
