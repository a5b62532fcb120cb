"""Finding verifiers packages, importing them as agentrl packages; one-line errors (no verifiers needed)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import agentrl
from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.hub.verifiers import find_verifiers_project, import_verifiers_package

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verifiers"


def test_finds_both_layouts():
    flat = find_verifiers_project(FIXTURES / "legacy_qa")
    assert (flat.name, flat.module, flat.module_file().name) == (
        "vf-legacy-qa",
        "vf_legacy_qa",
        "vf_legacy_qa.py",
    )
    package = find_verifiers_project(FIXTURES / "v1_reverse")
    assert package.module_file() == FIXTURES / "v1_reverse" / "vf_v1_reverse" / "__init__.py"
    assert package.version == "0.2.0"


def test_other_folders_are_not_verifiers_packages(tmp_path):
    assert find_verifiers_project(tmp_path) is None
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["verifiers-extra", "numpy"]\n'
    )
    assert find_verifiers_project(tmp_path) is None  # a name that only starts with verifiers
    builtin = Path(agentrl.__file__).resolve().parents[1] / "environments" / "reverse_text"
    assert find_verifiers_project(builtin) is None


def test_malformed_pyproject_is_one_line(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project\n")
    with pytest.raises(ConfigError, match="pyproject.toml: malformed TOML"):
        find_verifiers_project(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = ["verifiers"]\n')
    with pytest.raises(ConfigError, match=r"\[project\] name is missing"):
        find_verifiers_project(tmp_path)


def test_missing_module_is_named(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "vf-gone"\ndependencies = ["verifiers"]\n')
    with pytest.raises(NotFoundError, match=r"no module vf_gone.py or vf_gone/__init__.py"):
        import_verifiers_package(tmp_path, out=tmp_path / "out")


def test_without_verifiers_the_error_names_the_extra():
    try:
        import verifiers  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("verifiers is installed here; the missing-package message cannot be shown")
    with pytest.raises(AgentrlError, match=r"needs the verifiers package.*agentrl\[verifiers\]") as caught:
        agentrl.load_environment(FIXTURES / "v1_reverse")
    assert "\n" not in str(caught.value)


def test_import_writes_an_agentrl_package(tmp_path):
    out = import_verifiers_package(FIXTURES / "v1_reverse", out=tmp_path / "pkg")
    manifest = tomllib.loads((out / "environment.toml").read_text())
    assert manifest["name"] == "vf-v1-reverse" and manifest["version"] == "0.2.0"
    assert manifest["requirements"] == ["verifiers>=0.4.0"]
    assert manifest["entrypoint"] == "verifiers_entry:load_environment"
    copied = out / "verifiers_package" / "vf_v1_reverse" / "taskset.py"
    assert copied.read_text() == (FIXTURES / "v1_reverse" / "vf_v1_reverse" / "taskset.py").read_text()
    with pytest.raises(AgentrlError, match="exists and is not empty"):
        import_verifiers_package(FIXTURES / "v1_reverse", out=out)


def test_cli_import(tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    result = CliRunner().invoke(
        app,
        [
            "env",
            "import",
            "verifiers",
            str(FIXTURES / "legacy_qa"),
            "--out",
            str(tmp_path / "qa"),
            "--name",
            "capitals",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "created" in result.output
    assert tomllib.loads((tmp_path / "qa" / "environment.toml").read_text())["name"] == "capitals"
    result = CliRunner().invoke(app, ["env", "import", "verifiers", str(tmp_path)])
    assert isinstance(result.exception, NotFoundError)  # agentrl's main() prints it as one line
    assert "not a verifiers package" in str(result.exception)
