"""Imports go one way: no circles, no arrow against the layering docs/DESIGN.md writes ("Which way imports go").

The graph is drawn from the source by import path (`tests/import_graph.py`), function-local imports
included. The planted tests copy the package's folders and add one import, to show each check fails.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from import_graph import PACKAGE_DIRS, ROOT, cycles, import_graph, read_layers, upward_arrows  # noqa: E402


def test_the_package_has_no_import_circle():
    assert cycles(import_graph()) == [], "cut each circle at its misplaced name (docs/DESIGN.md, section 1)"


def test_no_import_goes_against_the_layering():
    layers = read_layers()
    assert [name for name, _ in layers][:3] == ["core", "sandbox", "hub"]
    assert upward_arrows(import_graph(), layers) == []


@pytest.fixture
def copy(tmp_path):
    """The package's Python files and DESIGN.md in `tmp_path`, laid out as in the checkout."""
    def not_python(folder: str, names: list[str]) -> list[str]:
        return [name for name in names if name == "__pycache__" or (
            not name.endswith(".py") and not Path(folder, name).is_dir())]

    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=not_python)
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "DESIGN.md", tmp_path / "docs" / "DESIGN.md")
    return tmp_path


def _plant(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code + "\n")


def test_a_planted_function_local_cycle_is_found(copy):
    assert cycles(import_graph(copy)) == []
    # agentrl.config imports agentrl.errors; an import of config inside a function of errors closes a circle
    _plant(copy / "sdk" / "errors.py", "def _planted():\n    from agentrl.config import BaseConfig\n\n    return BaseConfig")
    assert ["agentrl.config", "agentrl.errors"] in cycles(import_graph(copy))


def test_an_import_only_for_type_checking_is_no_cycle(copy):
    _plant(copy / "sdk" / "errors.py", "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                         "    from agentrl.config import BaseConfig")
    assert cycles(import_graph(copy)) == []


def test_a_planted_upward_arrow_is_found(copy):
    _plant(copy / "sdk" / "types.py", "def _planted():\n    from agentrl.rl import orchestrator\n\n"
                                        "    return orchestrator")
    layers = read_layers(copy / "docs" / "DESIGN.md")
    assert ("agentrl.types", "agentrl.rl.orchestrator") in upward_arrows(import_graph(copy), layers)
