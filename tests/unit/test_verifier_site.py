"""The `sitecustomize` of a Harbor verifier's Pythons (`hub.interop.verifier_site`), on this host's Python: run from
the agent's working directory, `python3 -m unittest` and the modules it imports come from the standard library, not
from the agent's files of the same names, while the agent's own modules (no installed namesake) still import, and a
script's own folder outside the working directory keeps its place."""

from __future__ import annotations

import os
import subprocess
import sys

from agentrl.hub.interop.harbor_verifier import _PYTHON_SITE, verifier_site_source


def _python(args, *, cwd, site):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site) if site else ""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def _planted(tmp_path):
    workdir = tmp_path / "app"
    workdir.mkdir()
    (workdir / "unittest.py").write_text("import sys\nprint('agent unittest')\nsys.exit(0)\n")
    (workdir / "difflib.py").write_text("import os\nos._exit(0)\n")  # unittest.case imports difflib
    (workdir / "solution.py").write_text("ANSWER = 42\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_hello.py").write_text("import unittest\n\n\nclass T(unittest.TestCase):\n"
                                         "    def test_fails(self):\n        self.assertEqual(1, 2)\n")
    (tests / "helpers.py").write_text("HELPED = True\n")
    (tests / "check.py").write_text("import helpers, solution\nprint(helpers.HELPED, solution.ANSWER)\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(verifier_site_source(str(workdir)))
    return workdir, tests, site


def test_unittest_run_from_the_working_directory_is_the_standard_librarys(tmp_path):
    workdir, tests, site = _planted(tmp_path)
    command = ["-m", "unittest", "discover", "-s", str(tests), "-p", "test_*.py"]
    without = _python(command, cwd=workdir, site=None)
    assert without.returncode == 0 and "agent unittest" in without.stdout  # what Harbor runs: a pass
    guarded = _python(command, cwd=workdir, site=site)
    assert guarded.returncode == 1 and "AssertionError: 1 != 2" in guarded.stderr, guarded.stderr[-500:]
    where = _python(["-c", "import difflib, json, solution; print(difflib.__file__); print(solution.ANSWER)"],
                    cwd=workdir, site=site)
    assert where.returncode == 0, where.stderr
    assert not where.stdout.splitlines()[0].startswith(str(workdir)) and where.stdout.splitlines()[1] == "42"


def test_a_test_scripts_folder_and_the_agents_modules_still_import(tmp_path):
    workdir, tests, site = _planted(tmp_path)
    env_path = f"{workdir}"  # a test.sh that puts the agent's folder on the path for its solution
    result = subprocess.run([sys.executable, str(tests / "check.py")], cwd=workdir, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": f"{site}:{env_path}"})
    assert result.returncode == 0 and result.stdout.split() == ["True", "42"], result.stderr


def test_agentrls_own_import_installs_nothing_and_the_wrapper_puts_the_site_first():
    import importlib.machinery

    before = list(sys.meta_path)
    from agentrl.hub.interop import verifier_site

    assert sys.meta_path == before and verifier_site.WORKDIR is None
    assert importlib.machinery.PathFinder in sys.meta_path
    assert _PYTHON_SITE == 'export PYTHONPATH="/tmp/agentrl-verifier-site${PYTHONPATH:+:$PYTHONPATH}"; '
    assert "\nWORKDIR = '/app' " in verifier_site_source("/app")
