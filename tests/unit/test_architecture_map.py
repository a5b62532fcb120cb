"""docs/ARCHITECTURE.md is a true map: every package module has its line, every path it names exists, one line
of at most 120 columns each, about 2,000 words in all (2,100 at most) (issue 40)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
PACKAGE_FOLDERS = ("sdk", "hub", "inference", "trainer")


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def _module_lines() -> dict[str, str]:
    """`- `path`: what it is` lines of the package sections: path -> the line."""
    return {match.group(1): match.group(0) for match in re.finditer(r"^- `([^`]+)`: .*$", MAP, flags=re.MULTILINE)
            if match.group(1).split("/")[0] in PACKAGE_FOLDERS}


def test_every_package_module_has_its_line():
    named = _module_lines()
    modules = [path for path in _tracked() if path.endswith(".py") and path.split("/")[0] in PACKAGE_FOLDERS
               and Path(path).name != "__init__.py"]  # a package's __init__ is named where it holds more than names
    missing = [path for path in modules if path not in named
               and not any(name.endswith("/") and path.startswith(name) for name in named)]
    assert not missing, f"modules without a line in docs/ARCHITECTURE.md: {missing}"


def test_every_path_named_exists():
    for path in re.findall(r"`((?:sdk|hub|inference|trainer|environments|bench|scripts|cookbook|tests|docs)/[^`*]*)`",
                           MAP):
        assert (ROOT / path).exists(), f"docs/ARCHITECTURE.md names {path}, which does not exist"


def test_one_short_line_per_module_in_a_short_map():
    lines = _module_lines().values()
    assert len(lines) >= 150
    assert all(len(line) <= 120 for line in lines), [line for line in lines if len(line) > 120]
    assert len(MAP.split()) <= 2100, len(MAP.split())
