"""The package docstrings are maps: `agentrl.rl`'s names every module of the package."""

from __future__ import annotations

from pathlib import Path

import agentrl.rl

RL = Path(__file__).resolve().parents[2] / "sdk" / "rl"


def test_the_rl_docstring_names_every_module_of_the_package():
    modules = {path.name for path in RL.glob("*.py") if path.name != "__init__.py"}
    named = {name for name in modules if f"`{name}`" in agentrl.rl.__doc__}
    assert modules - named == set(), "add each module to sdk/rl/__init__.py's docstring, under its role"
