"""The `sitecustomize` of a Harbor verifier's Pythons (`hub.interop.verifier_site`), on this host's Python, started
as the verifier's wrapper starts test.sh (`_python_site`): run from the agent's working directory, `python3 -m
unittest` or `-m pytest` and what they import come from the image, not from the agent's files of the same names
(the runner, a module it imports, a probed name, a pytest plugin, metadata declaring one, an `encodings` package
reached through the image's PYTHONPATH), while the agent's own modules still import and a script's own folder
outside the working directory keeps its place. Cases from the red team of 2026-12-07 (/work/redteam3)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from agentrl.hub.interop.harbor_verifier import _python_site, verifier_site_source
from agentrl.hub.interop.verifier_site import SITE_DIR


def _python(args, *, cwd, site, pythonpath=None, workdir=None):
    """`python3 ARGS` in `cwd` as test.sh runs it: after the wrapper's PYTHONPATH lines for the working directory
    `workdir` (default `cwd`; `site` stands for the sandbox's site folder); `site=None`: as Harbor runs it."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    command = " ".join(shlex.quote(part) for part in [sys.executable, *args])
    if site:
        command = _python_site(str(workdir or cwd)).replace(SITE_DIR, str(site)) + command
    return subprocess.run(["/bin/sh", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


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
    result = _python([str(tests / "check.py")], cwd=workdir, site=site, pythonpath=str(workdir))
    assert result.returncode == 0 and result.stdout.split() == ["True", "42"], result.stderr


@pytest.mark.parametrize("pythonpath", [":/opt/lib", "/opt/lib:", "{workdir}", ".", "/opt/*:{workdir}"])
def test_the_images_pythonpath_into_the_working_directory_reaches_no_start_up_import(tmp_path, pythonpath):
    """An image's `ENV PYTHONPATH` naming the working directory (or an empty or relative entry) put it before the
    standard library while the interpreter started: the agent's `encodings/` ran before any sitecustomize."""
    workdir, tests, site = _planted(tmp_path)
    (workdir / "encodings").mkdir()
    (workdir / "encodings" / "__init__.py").write_text("import os\nos._exit(0)\n")
    command = ["-m", "unittest", "discover", "-s", str(tests), "-p", "test_*.py"]
    path = pythonpath.format(workdir=workdir)
    assert _python(command, cwd=workdir, site=None, pythonpath=path).returncode == 0  # as Harbor runs it
    guarded = _python(command, cwd=workdir, site=site, pythonpath=path)
    assert guarded.returncode == 1 and "AssertionError: 1 != 2" in guarded.stderr, guarded.stderr[-500:]
    moved = _python(["-c", "import solution; print(solution.ANSWER)"], cwd=tests, site=site, pythonpath=str(workdir),
                    workdir=workdir)
    assert moved.stdout.strip() == "42", moved.stderr  # the image's entry is still on the path, behind the rules


@pytest.mark.parametrize("planted", ["msvcrt.py", "org/__init__.py"])
def test_names_the_standard_library_only_probes_for_never_come_from_the_working_directory(tmp_path, planted):
    """`subprocess` imports `msvcrt` when it can (a Windows module), `copy` probes Jython's `org`: found nowhere
    outside the working directory, they came from it."""
    workdir, tests, site = _planted(tmp_path)
    (workdir / planted).parent.mkdir(parents=True, exist_ok=True)
    (workdir / planted).write_text("import os\nos._exit(0)\n")
    (workdir / "difflib.py").unlink()
    (tests / "test_hello.py").write_text("import copy, subprocess, unittest\n\n\nclass T(unittest.TestCase):\n"
                                         "    def test_fails(self):\n        self.assertEqual(1, 2)\n")
    (workdir / "unittest.py").unlink()
    command = ["-m", "unittest", "discover", "-s", str(tests), "-p", "test_*.py"]
    guarded = _python(command, cwd=workdir, site=site)
    assert guarded.returncode == 1 and "AssertionError: 1 != 2" in guarded.stderr, guarded.stderr[-500:]


def test_pytest_its_plugins_and_plugin_metadata_come_from_the_image(tmp_path):
    pytest.importorskip("pytest_timeout")  # a pytest11 plugin of this environment (the dev extra)
    workdir, tests, site = _planted(tmp_path)
    (workdir / "unittest.py").unlink()
    (workdir / "difflib.py").unlink()
    exit0 = "import os\nos._exit(0)\n"
    (workdir / "pytest_timeout.py").write_text(exit0)  # pytest's assertion rewriting asks PathFinder directly
    (workdir / "pytest.py").write_text(exit0)
    (workdir / "evil-1.0.dist-info").mkdir()
    (workdir / "evil-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
    (workdir / "evil-1.0.dist-info" / "entry_points.txt").write_text("[pytest11]\nevil = zz_evil\n")
    (workdir / "zz_evil.py").write_text(exit0)
    command = ["-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "test_hello.py")]
    assert _python(command, cwd=workdir, site=None).returncode == 0  # as Harbor runs it
    guarded = _python(command, cwd=workdir, site=site)
    assert guarded.returncode == 1 and "1 failed" in guarded.stdout, guarded.stdout[-800:] + guarded.stderr[-500:]


def test_agentrls_own_import_installs_nothing():
    import importlib.machinery

    before = (list(sys.meta_path), importlib.machinery.PathFinder.find_spec)
    from agentrl.hub.interop import verifier_site

    assert (list(sys.meta_path), importlib.machinery.PathFinder.find_spec) == before and verifier_site.WORKDIR is None
    assert "\nWORKDIR = '/app' " in verifier_site_source("/app")


def test_a_second_red_teams_cases_hold(tmp_path):
    """The second red team (/work/redteam4): `usercustomize` (a start-up hook no image has) reached through the
    image's PYTHONPATH, that PYTHONPATH naming the working directory through a link, an installed namespace
    package whose path is recalculated after the tests change sys.path."""
    workdir, tests, site = _planted(tmp_path)
    command = ["-m", "unittest", "discover", "-s", str(tests), "-p", "test_*.py"]
    (workdir / "usercustomize.py").write_text("import os\nos._exit(0)\n")
    guarded = _python(command, cwd=workdir, site=site, pythonpath=str(workdir))
    assert guarded.returncode == 1 and "AssertionError: 1 != 2" in guarded.stderr, guarded.stderr[-500:]
    (workdir / "usercustomize.py").unlink()
    (workdir / "encodings").mkdir()
    (workdir / "encodings" / "__init__.py").write_text("import os\nos._exit(0)\n")
    link = tmp_path / "applink"
    link.symlink_to(workdir)
    for path in (str(link), "/" + str(workdir)):  # a link to it, `//tmp/...`
        guarded = _python(command, cwd=workdir, site=site, pythonpath=path)
        assert guarded.returncode == 1 and "AssertionError: 1 != 2" in guarded.stderr, (path, guarded.stderr[-500:])
    (workdir / "encodings" / "__init__.py").unlink()
    (workdir / "encodings").rmdir()
    try:
        import google.protobuf  # noqa: F401  (an installed namespace package: google)
    except ImportError:
        pytest.skip("no installed namespace package (google) here")
    (workdir / "google" / "rpc").mkdir(parents=True)
    (workdir / "google" / "rpc" / "__init__.py").write_text("import os\nos._exit(0)\n")
    (tests / "test_hello.py").write_text(
        f"import importlib, sys, unittest\nimport google.protobuf\nsys.path.insert(0, {str(workdir)!r})\n"
        "importlib.invalidate_caches()\ntry:\n    import google.rpc\nexcept ImportError:\n    pass\n\n\n"
        "class T(unittest.TestCase):\n    def test_fails(self):\n        self.assertEqual(1, 2)\n")
    guarded = _python(command, cwd=workdir, site=site)
    assert guarded.returncode == 1 and "AssertionError: 1 != 2" in guarded.stderr, guarded.stderr[-500:]


def test_a_working_directory_of_root_leaves_the_interpreter_its_own_modules(tmp_path):
    """A task whose image sets no WORKDIR works in `/`: every path is under it, the interpreter's too."""
    workdir, tests, site = _planted(tmp_path)
    (site / "sitecustomize.py").write_text(verifier_site_source("/"))
    (tests / "test_hello.py").write_text("import json, unittest\n\n\nclass T(unittest.TestCase):\n"
                                         "    def test_passes(self):\n        self.assertEqual(json.loads('1'), 1)\n")
    command = ["-m", "unittest", "discover", "-s", str(tests), "-p", "test_*.py"]
    passed = _python(command, cwd=tests, site=site, workdir="/", pythonpath="/opt/lib")
    assert passed.returncode == 0, passed.stderr[-500:]
