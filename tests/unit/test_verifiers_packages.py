"""Finding verifiers packages, importing them as agentrl packages; one-line errors (no verifiers needed)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import agentrl
from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.hub.interop.verifiers import find_verifiers_project, import_verifiers_package

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


def test_without_verifiers_the_error_names_env_install(tmp_path, monkeypatch):
    from agentrl.hub.interop.verifiers import installed_verifiers

    monkeypatch.setenv("AGENTRL_VENVS", str(tmp_path / "venvs"))  # no venv made for it yet
    package = "legacy_qa" if installed_verifiers() and installed_verifiers() >= "0.4" else "v1_reverse"
    with pytest.raises(AgentrlError, match=r"run `agentrl env install .*"
                       + package + r"` \(its own venv; agentrl's environment is left unchanged\)") as caught:
        agentrl.load_environment(FIXTURES / package)
    assert "\n" not in str(caught.value)


def _project(folder: Path, module: str, source: str, dependencies: str = "[]") -> Path:
    folder.mkdir()
    (folder / "pyproject.toml").write_text(
        f'[project]\nname = "{module.replace("_", "-")}"\ndependencies = {dependencies}\n'
    )
    (folder / f"{module}.py").write_text(source)
    return folder


def test_api_detected_by_what_the_module_defines(tmp_path):
    """A v1 package that does not list verifiers is still found, by its imports and classes."""
    v1 = _project(tmp_path / "a", "vf_undeclared", "import verifiers.v1 as vf\n\n"
                  "class T(vf.Taskset):\n    pass\n\n__all__ = ['T']\n")
    project = find_verifiers_project(v1)
    assert project is not None and project.api == "v1"
    from_import = _project(tmp_path / "b", "vf_from", "from verifiers import v1 as vf\n")
    assert find_verifiers_project(from_import).api == "v1"
    legacy = _project(tmp_path / "c", "vf_old", "import verifiers as vf\n\n"
                      "def load_environment(**kwargs):\n    return vf.SingleTurnEnv()\n")
    assert find_verifiers_project(legacy).api == "legacy"
    assert find_verifiers_project(_project(tmp_path / "d", "plain", "import json\n")) is None
    assert find_verifiers_project(FIXTURES / "v1_reverse").api == "v1"
    assert find_verifiers_project(FIXTURES / "legacy_tools").api == "legacy"


def test_venv_requirements_pin_the_api(tmp_path):
    from agentrl.hub.install import install_target
    from agentrl.hub.interop.verifiers_venv import venv_requirements

    v1 = find_verifiers_project(_project(tmp_path / "a", "vf_one", "import verifiers.v1 as vf\n__all__ = []\n",
                                         '["numpy"]'))
    assert venv_requirements(v1) == ["numpy", "verifiers>=0.4.0"]
    legacy = find_verifiers_project(_project(tmp_path / "b", "vf_two", "import verifiers as vf\n"
                                             "def load_environment():\n    return None\n", '["verifiers"]'))
    assert venv_requirements(legacy) == ["verifiers", "verifiers>=0.1.9,<0.4"]
    line = install_target(tmp_path / "b", dry_run=True)
    assert line == "would make a venv for vf-two with: verifiers verifiers>=0.1.9,<0.4"
    imported = import_verifiers_package(tmp_path / "a", out=tmp_path / "pkg")
    assert install_target(imported, dry_run=True) == "would make a venv for vf-one with: numpy verifiers>=0.4.0"


def test_missing_dependency_is_named(tmp_path):
    """The hint names the third-party module the package lacks, not a verifiers API."""
    from agentrl.hub.interop.verifiers import installed_verifiers

    if not installed_verifiers() or installed_verifiers() < "0.4":
        pytest.skip("needs verifiers>=0.4 in this environment (tests/integration/test_verifiers_venvs.py runs it)")
    folder = _project(tmp_path / "a", "vf_needs_dep", "import verifiers.v1 as vf\nimport left_pad_xyz\n")
    with pytest.raises(AgentrlError, match=r"needs the module 'left_pad_xyz', which is not installed and not "
                       r"among its \[project\] dependencies") as caught:
        agentrl.load_environment(folder)
    assert "\n" not in str(caught.value)
    listed = _project(tmp_path / "b", "vf_lists_dep", "import verifiers.v1 as vf\nimport left_pad_xyz\n",
                      '["left-pad-xyz>=1"]')
    with pytest.raises(AgentrlError, match=r"its dependencies list it: run `agentrl env install"):
        agentrl.load_environment(listed)


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


def test_train_takes_a_verifiers_package_folder_as_eval_does(tmp_path, capsys):
    """docs/ENVIRONMENTS.md says train and eval both take the folder; train refused it ("no environment.toml in this
    folder"), found by an ecosystem walk-through. A folder that is neither still gets that one line."""
    from agentrl.cli import main

    assert main(["train", "--env", str(FIXTURES / "legacy_qa"), "--model", "tiny-moe", "--dry-run"]) == 0
    assert f"# agentrl train: env {FIXTURES / 'legacy_qa'}" in capsys.readouterr().out
    assert main(["train", "--env", str(tmp_path), "--model", "tiny-moe", "--dry-run"]) == 2
    assert f"{tmp_path}: no environment.toml in this folder" in capsys.readouterr().err


@pytest.mark.parametrize(("module", "source", "said"), [
    ("vf_noload", "import verifiers as vf\ndef make_env():\n    return None\n",
     r"vf_noload.py: defines no load_environment\(\) and no __all__"),
    ("vf_syntax", "import verifiers as vf\ndef load_environment(:\n", "vf_syntax.py:2: syntax error: "),
])
def test_install_checks_the_module_before_making_its_venv(tmp_path, module, source, said):
    """`agentrl env install` made a venv for a package with no load_environment, a syntax error or no module of
    its name, and said nothing until the first eval (an ecosystem walk-through)."""
    from agentrl.hub.install import install_target

    folder = _project(tmp_path / "pkg", module, source, '["verifiers"]')
    with pytest.raises(ConfigError, match=said) as caught:
        install_target(folder, dry_run=True)
    assert "\n" not in str(caught.value)
    (folder / f"{module}.py").rename(folder / "other_name.py")
    with pytest.raises(NotFoundError, match=f"has no module {module}.py or {module}/__init__.py"):
        install_target(folder, dry_run=True)
    (folder / f"{module}.py").write_text("import verifiers as vf\nfrom .envs import load_environment\n")
    assert install_target(folder, dry_run=True).startswith("would make a venv for")
