"""scripts/install.sh with Debian's own, externally managed python3 (PEP 668), as a new user runs it:
it makes the checkout's .venv, installs there, links `agentrl` onto PATH, touches nothing outside
that venv, and a second run is a no-op that still passes.

Run on a copy of the checkout (its .venv is the test's) with AGENTRL_EXTRAS=dev (the base
dependencies and the test tools: seconds from the index; the CPU extras' GBs are what the
default install adds, measured in the report, not here) and AGENTRL_BIN_DIR in the test's folder
(not /usr/local/bin). The Debian packages, the Docker engine and the base image are the
machine's: .ci/run's own install.sh put them there, so those steps find them done.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # minutes of pip: `-m slow`

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_PYTHON = Path("/usr/bin/python3")
_LIST = ("import importlib.metadata as m\n"
         "print(sorted({(d.metadata['Name'], d.version) for d in m.distributions()}))")


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "install.sh runs as root"
    if not DEBIAN_PYTHON.exists():
        return f"{DEBIAN_PYTHON} is missing"
    probe = subprocess.run([str(DEBIAN_PYTHON), "-c",
                            "import os, sys, sysconfig, venv, ensurepip; "
                            "sys.exit(0 if os.path.isfile(os.path.join(sysconfig.get_path('stdlib'), "
                            "'EXTERNALLY-MANAGED')) else 3)"], capture_output=True, text=True)
    if probe.returncode == 3:
        return f"{DEBIAN_PYTHON} is not externally managed here (no EXTERNALLY-MANAGED marker)"
    if probe.returncode != 0:
        return f"{DEBIAN_PYTHON} has no venv/ensurepip (Debian: apt-get install python3-venv)"
    return None


def _copy_checkout(target: Path) -> None:
    listing = ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    files = subprocess.run(listing, capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)


def _distributions(python: str) -> str:
    done = subprocess.run([python, "-c", _LIST], capture_output=True, text=True, check=True, timeout=120)
    return done.stdout


@pytest.mark.timeout(900)
def test_install_sh_with_debian_python_makes_a_venv_and_runs_again_as_a_no_op(tmp_path):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    checkout, bin_dir, outside = tmp_path / "checkout", tmp_path / "bin", tmp_path / "elsewhere"
    _copy_checkout(checkout)
    outside.mkdir()
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "AGENTRL_VENV", "PYTEST_ADDOPTS")}
    env.update(PYTHON=str(DEBIAN_PYTHON), AGENTRL_EXTRAS="dev", AGENTRL_BIN_DIR=str(bin_dir),
               PATH=f"{bin_dir}:{env.get('PATH', '')}", AGENTRL_HUB=str(tmp_path / "hub"))
    outer = {python: _distributions(python) for python in (sys.executable, str(DEBIAN_PYTHON))}
    install = ["bash", str(checkout / "scripts" / "install.sh")]

    started = time.monotonic()
    first = subprocess.run(install, cwd=outside, env=env, capture_output=True, text=True, timeout=600)
    first_s = time.monotonic() - started
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    venv = checkout / ".venv"
    assert f"{DEBIAN_PYTHON} is externally managed (PEP 668)" in first.stdout
    assert f"python -m venv {venv}" in first.stdout
    assert f"pip install -e .[dev] into {venv}/bin/python" in first.stdout
    link = bin_dir / "agentrl"
    assert link.is_symlink() and os.readlink(link) == str(venv / "bin" / "agentrl")
    assert f"the tests: {venv}/bin/python -m pytest" in first.stdout
    assert first.stdout.strip().splitlines()[-1] == "[install] done"

    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import agentrl; print(agentrl.__file__)"],
                           cwd=outside, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(checkout / "sdk" / "__init__.py")  # editable: this checkout
    listed = subprocess.run(["agentrl", "env", "list"], cwd=outside, env=env, capture_output=True, text=True,
                            timeout=120)  # the link on PATH, as `agentrl train` would be found
    assert listed.returncode == 0 and "reverse-text" in listed.stdout, listed.stderr[-2000:]

    started = time.monotonic()
    second = subprocess.run(install, cwd=outside, env=env, capture_output=True, text=True, timeout=300)
    second_s = time.monotonic() - started
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    lines = second.stdout.strip().splitlines()
    assert lines[-1] == "[install] done: nothing to do", second.stdout
    assert any("installed with dev; nothing to do" in line for line in lines)
    assert not any(step in second.stdout for step in ("-m venv", "pip install", "pip uninstall", "linked"))
    print(f"\ninstall.sh with {DEBIAN_PYTHON} (AGENTRL_EXTRAS=dev): first run {first_s:.1f} s, "
          f"second {second_s:.1f} s")

    for python, before in outer.items():  # nothing outside the venv was installed or removed
        assert _distributions(python) == before, f"{python}'s packages changed"
