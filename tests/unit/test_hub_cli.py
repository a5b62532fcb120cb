"""`agentrl env` commands end to end in subprocesses: init (a scaffold whose own test passes), validate,
build, install, list --installed, and their one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentrl.errors import ConfigError
from agentrl.hub.install import install_requirements
from tests.fakes.toy_package import write_toy_package


def _run(*args, cwd=None, hub_root=None):
    env = dict(os.environ)
    if hub_root is not None:
        env["AGENTRL_HUB"] = str(hub_root)
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "env", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def test_init_scaffold_validates_and_its_own_test_passes(tmp_path):
    made = _run("init", "my-env", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    folder = tmp_path / "my-env"
    assert {p.name for p in folder.iterdir()} >= {"environment.toml", "my_env.py", "README.md", "data", "tests"}
    checked = _run("validate", str(folder))
    assert checked.returncode == 0 and "ok: my-env 0.1.0 (test=2, train=3)" in checked.stdout, checked.stderr
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=folder,
                           capture_output=True, text=True, timeout=180)
    assert tests.returncode == 0, tests.stdout[-2000:]
    again = _run("init", "my-env", cwd=tmp_path)
    assert again.returncode == 2 and "not empty" in again.stderr
    bad = _run("init", "My Env", cwd=tmp_path)
    assert bad.returncode == 2 and "lowercase" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    digit = _run("init", "1abc", cwd=tmp_path)  # its module 1abc.py could be no entrypoint: refused, nothing made
    assert digit.returncode == 2 and "must start with a lowercase letter" in digit.stderr
    assert not (tmp_path / "1abc").exists()
    oracle = subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", "--env", str(folder), "--oracle", "-r", "1",
                             "-o", str(tmp_path / "oracle")], capture_output=True, text=True, timeout=180)
    assert oracle.returncode == 0 and "oracle: all 2 rollouts passed" in oracle.stdout, oracle.stderr[-2000:]


def test_validate_imports_the_entrypoint_before_anything_is_published(tmp_path):
    """A published version is immutable: a module that cannot be imported, or an entrypoint that names no function,
    fails validate (and so push) in one line, not first the user who pulled it."""
    package = write_toy_package(tmp_path / "pkg")
    with open(package / "toy_echo.py", "a") as module:
        module.write("\ndef oops(:\n")
    checked = _run("validate", str(package))
    assert checked.returncode == 2 and len(checked.stderr.strip().splitlines()) == 1, checked.stderr
    assert checked.stderr.startswith(f"error: {package / 'toy_echo.py'}: import failed: SyntaxError: "), checked.stderr
    pushed = _run("push", str(package), hub_root=tmp_path / "hub")
    assert pushed.returncode == 2 and "import failed: SyntaxError" in pushed.stderr
    assert not (tmp_path / "hub" / "packages").exists() or not any((tmp_path / "hub" / "packages").rglob("*.json"))
    constant = write_toy_package(tmp_path / "constant")
    with open(constant / "toy_echo.py", "a") as module:
        module.write("\nload_environment = 3\n")
    named = _run("validate", str(constant))
    assert named.returncode == 2 and "entrypoint 'toy_echo:load_environment' is a int, not a function" in named.stderr


def test_validate_takes_an_environments_name_and_says_when_there_is_none(tmp_path):
    """`env list` shows key-hunt and `eval --env key-hunt` takes the name; `env validate key-hunt` said "no
    environment.toml" (a newcomer's walk-through, 2026-12-07)."""
    named = _run("validate", "key-hunt", cwd=tmp_path)
    assert named.returncode == 0 and named.stdout.startswith("ok: key-hunt "), named.stderr
    missing = _run("validate", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.startswith(f"error: no such folder '{tmp_path / 'nowhere'}'")
    empty = _run("validate", cwd=tmp_path)
    assert empty.returncode == 2 and "no environment.toml in this folder" in empty.stderr, empty.stderr


def test_build_writes_the_published_form(tmp_path):
    package = write_toy_package(tmp_path / "pkg", rows=4)
    built = _run("build", str(package), "--out", str(tmp_path / "out"))
    assert built.returncode == 0, built.stderr
    assert "splits {'train': 4}" in built.stdout
    assert (tmp_path / "out" / "dataset" / "train.parquet").is_file()
    assert (tmp_path / "out" / "agentrl-package.json").is_file()


def test_install_requirements(tmp_path):
    package = write_toy_package(tmp_path / "pkg", extra_manifest='requirements = ["tomli-w>=1.0"]')
    command = install_requirements(package, dry_run=True)
    assert command[-1] == "tomli-w>=1.0" and command[1:4] == ["-m", "pip", "install"]
    installed = _run("install", str(package))  # already satisfied here: pip checks and returns
    assert installed.returncode == 0, installed.stderr
    empty = write_toy_package(tmp_path / "empty")
    assert install_requirements(empty) == []
    broken = write_toy_package(tmp_path / "broken", extra_manifest='requirements = ["numpy >>= 1"]')
    with pytest.raises(ConfigError, match=r"requirements\[0\] 'numpy >>= 1' is not a pip requirement"):
        install_requirements(broken)


def test_malformed_data_file_is_one_line_error(tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    with open(package / "data" / "train.jsonl", "a") as handle:
        handle.write("{not json\n")
    checked = _run("validate", str(package))
    assert checked.returncode == 2 and "train.jsonl: malformed JSON" in checked.stderr
    assert len(checked.stderr.strip().splitlines()) == 1


def test_list_installed_after_pull(tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    hub_root = tmp_path / "hub"
    assert _run("push", str(package), "--repo", "bob/toy-echo", hub_root=hub_root).returncode == 0
    listed = _run("list", hub_root=hub_root)
    assert "bob/toy-echo" in listed.stdout
    assert _run("pull", "bob/toy-echo@0.1.0", hub_root=hub_root).returncode == 0
    assert _run("list", "--installed", hub_root=hub_root).stdout.split() == ["bob/toy-echo@0.1.0"]


def test_list_shows_the_environments_loadable_by_name(tmp_path):
    """`agentrl env list` on an empty local hub still lists the built-ins, with the folder each loads from."""
    from agentrl.hub.loader import builtin_environments_dir

    listed = _run("list", hub_root=tmp_path / "hub")
    assert listed.returncode == 0, listed.stderr
    assert "no packages published to the local hub yet" in listed.stdout and "loadable by name" in listed.stdout
    assert listed.stdout.index("loadable by name") < listed.stdout.index("no packages published")  # loadable first
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in listed.stdout.splitlines() if line.startswith("│")}
    assert {"reverse-text", "arithmetic", "swe"} <= set(rows)
    assert rows["reverse-text"][1] == "builtin" and rows["reverse-text"][3] == str(builtin_environments_dir() / "reverse_text")
    single = _run("list", "--tag", "single-turn", hub_root=tmp_path / "hub")
    assert "reverse-text" in single.stdout and "arithmetic" not in single.stdout
