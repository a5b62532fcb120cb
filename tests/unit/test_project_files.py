"""agentrl.project_files: environments/ and cookbook/ from a checkout, from a wheel's package data,
and through a package folder of links to the checkout (scripts/gpu_run.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from agentrl.hub.loader import builtin_environments_dir
from agentrl.project_files import PROJECT_DIRS, project_path, project_root, resolve_project_path
from agentrl.rl.config import CPU_DEFAULT_RECIPE, TINY_MOE_SFT, load_run_config

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "sdk"

_PROBE = (
    "import json, agentrl, agentrl.project_files as p\n"
    "print(json.dumps({'file': agentrl.__file__, 'root': str(p.project_root()),"
    " 'envs': str(p.project_path('environments'))}))"
)


def _probe(site: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=site, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_checkout_finds_its_own_folders():
    if not (SDK / "__init__.py").is_file():
        pytest.skip("not run from a checkout")
    assert project_root() == ROOT
    assert builtin_environments_dir() == ROOT / "environments"
    assert TINY_MOE_SFT == ROOT / "cookbook" / "cpu-default" / "tiny-moe-sft"
    assert (TINY_MOE_SFT / "config.json").is_file() and CPU_DEFAULT_RECIPE.is_file()


def test_recipe_paths_resolve_inside_the_project_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no cookbook/ here
    warm = project_path("cookbook", "cpu-default", "tiny-moe-sft")
    assert resolve_project_path("cookbook/cpu-default/tiny-moe-sft") == warm
    (tmp_path / "cookbook").mkdir()  # a folder of the caller's own wins
    (tmp_path / "cookbook" / "mine.toml").write_text("")
    assert resolve_project_path("cookbook/mine.toml") == Path("cookbook/mine.toml")
    assert resolve_project_path("nowhere/at/all") == Path("nowhere/at/all")
    config = load_run_config("cookbook/cpu-default/ci.toml")  # --config cookbook/... outside a checkout
    assert config.orchestrator.max_steps == 24
    assert config.starting_weights() == TINY_MOE_SFT


def test_a_wheel_layout_finds_the_shipped_copies(tmp_path):
    """As pip lays out a wheel: site/agentrl/ holds the modules and, as package data, both folders."""
    package = tmp_path / "site" / "agentrl"
    package.mkdir(parents=True)
    for module in ("__init__.py", "errors.py", "project_files.py"):
        (package / module).write_bytes((SDK / module).read_bytes())  # real files, as a wheel has
    for name in PROJECT_DIRS:
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
    seen = _probe(package.parent)
    assert Path(seen["file"]).parent == package
    assert Path(seen["root"]) == package and Path(seen["envs"]) == package / "environments"


def test_a_package_folder_of_links_finds_the_checkout(tmp_path):
    """scripts/gpu_run.sh imports agentrl through a folder of links to sdk/: they lead to the checkout."""
    package = tmp_path / "site" / "agentrl"
    package.mkdir(parents=True)
    for module in ("__init__.py", "errors.py", "project_files.py"):
        (package / module).symlink_to(SDK / module)
    seen = _probe(package.parent)
    assert Path(seen["root"]) == ROOT and Path(seen["envs"]) == ROOT / "environments"


def test_the_wheel_config_ships_both_folders():
    """pyproject.toml maps both folders into the package and takes every file in them as package data."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for name in PROJECT_DIRS:
        assert setuptools["package-dir"][f"agentrl.{name}"] == name
        assert f"agentrl.{name}" in setuptools["packages"]
        assert setuptools["package-data"][f"agentrl.{name}"] == ["**/*"]
