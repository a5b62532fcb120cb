"""load_environment: built-in names, paths, $AGENTRL_ENV_PATH, private imports, one-line errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import agentrl
from agentrl.environment import SingleTurnEnv
from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.hub.loader import builtin_environments_dir, list_environments, load_environment

ENV_MODULE = '''
from agentrl.environment import SingleTurnEnv
from . import helper


def load_environment(*, greeting: str = "hi", repeat: int = 1):
    env = SingleTurnEnv(dataset=[{"prompt": greeting * repeat, "answer": helper.ANSWER}])
    env.settings = {"greeting": greeting, "repeat": repeat}
    return env
'''


def _package(root: Path, folder: str, *, name: str, answer: str = "42", manifest_extra: str = "",
             module: str = ENV_MODULE) -> Path:
    path = root / folder
    path.mkdir(parents=True)
    (path / "environment.toml").write_text(
        f'name = "{name}"\nversion = "0.2.0"\ndescription = "test env"\nentrypoint = "envmod:load_environment"\n'
        + manifest_extra
    )
    (path / "envmod.py").write_text(module)
    (path / "helper.py").write_text(f"ANSWER = {answer!r}\n")
    return path


def test_builtin_by_name_and_underscore_alias():
    assert (builtin_environments_dir() / "reverse_text" / "environment.toml").is_file()
    env = agentrl.load_environment("reverse-text", num_train=5, num_test=3)
    assert isinstance(env, SingleTurnEnv) and env.name == "reverse-text"
    assert env.manifest.name == "reverse-text" and env.path == builtin_environments_dir() / "reverse_text"
    assert len(env.get_dataset("test")) == 3
    assert load_environment("reverse_text", num_train=5, num_test=3).name == "reverse-text"


def test_by_path_with_env_args_kwargs_and_no_sys_path_change(tmp_path):
    folder = _package(tmp_path, "pkg", name="my-env", manifest_extra='[env_args]\ngreeting = "yo"\nrepeat = 2\n')
    path_before = list(sys.path)
    env = load_environment(folder)
    assert sys.path == path_before
    assert "envmod" not in sys.modules and "helper" not in sys.modules
    assert env.name == "my-env" and env.manifest.version == "0.2.0"
    assert env.settings == {"greeting": "yo", "repeat": 2}
    assert env.tasks("train")[0].prompt[0].content == "yoyo" and env.tasks("train")[0].answer == "42"
    assert load_environment(folder, repeat=3).settings == {"greeting": "yo", "repeat": 3}  # kwargs win
    assert load_environment(folder / "environment.toml").name == "my-env"


def test_same_module_names_in_two_packages_do_not_collide(tmp_path):
    first = load_environment(_package(tmp_path, "a", name="env-a", answer="A"))
    second = load_environment(_package(tmp_path, "b", name="env-b", answer="B"))
    assert first.tasks("train")[0].answer == "A" and second.tasks("train")[0].answer == "B"


def test_agentrl_env_path_and_listing(tmp_path, monkeypatch):
    _package(tmp_path / "extra", "custom_env", name="custom-env")
    monkeypatch.setenv("AGENTRL_ENV_PATH", str(tmp_path / "extra"))
    assert load_environment("custom-env").name == "custom-env"
    found = {info.name: info for info in list_environments()}
    assert {"reverse-text", "arithmetic", "custom-env"} <= set(found)
    assert found["custom-env"].source == "env-path" and found["custom-env"].version == "0.2.0"
    assert found["reverse-text"].source == "builtin"


def test_unknown_name_lists_available():
    with pytest.raises(NotFoundError) as info:
        load_environment("reverse-txt")
    message = str(info.value)
    assert message.startswith("unknown environment 'reverse-txt'; did you mean 'reverse-text'; available environments: ")
    assert "arithmetic" in message and "reverse-text" in message and "\n" not in message


def test_missing_path_and_folder_without_manifest(tmp_path):
    with pytest.raises(NotFoundError, match="no such folder"):
        load_environment(str(tmp_path / "nope") + "/")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFoundError, match="no environment.toml in this folder"):
        load_environment(tmp_path / "empty")


def test_bare_name_is_looked_up_even_when_a_local_folder_has_that_name(tmp_path, monkeypatch):
    (tmp_path / "arithmetic").mkdir()  # e.g. a results folder in the working directory
    monkeypatch.chdir(tmp_path)
    assert load_environment("arithmetic", num_train=1, num_test=1).name == "arithmetic"
    with pytest.raises(NotFoundError, match="no environment.toml in this folder"):
        load_environment("./arithmetic")


def test_bad_manifest_is_a_one_line_config_error(tmp_path):
    folder = _package(tmp_path, "bad", name="Bad Name")
    with pytest.raises(ConfigError, match=r"environment.toml:1: name = 'Bad Name': must be lowercase"):
        load_environment(folder)


@pytest.mark.parametrize(
    ("module", "manifest_entry", "error", "fragment"),
    [
        ("raise ImportError('needs numpy 9')\n", None, AgentrlError, "envmod.py: import failed: ImportError: needs numpy 9"),
        ("def load_environment():\n    return 3\n", None, AgentrlError, "returned int, not an agentrl Environment"),
        ("def other():\n    pass\n", None, NotFoundError, "envmod.py: has no 'load_environment'"),
        ("def load_environment():\n    raise KeyError('x')\n", None, AgentrlError, "failed: KeyError"),
        (ENV_MODULE, "missing:load_environment", NotFoundError, "entrypoint module 'missing' not found"),
    ],
)
def test_broken_packages_give_one_line_errors(tmp_path, module, manifest_entry, error, fragment):
    folder = _package(tmp_path, "broken", name="broken", module=module)
    if manifest_entry:
        manifest = folder / "environment.toml"
        manifest.write_text(manifest.read_text().replace("envmod:load_environment", manifest_entry))
    with pytest.raises(error) as info:
        load_environment(folder)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_bad_keyword_argument(tmp_path):
    folder = _package(tmp_path, "pkg", name="kw-env")
    with pytest.raises(AgentrlError, match="bad arguments to envmod:load_environment"):
        load_environment(folder, colour="red")


def test_hub_installed_packages_by_reference_and_bare_name(tmp_path, monkeypatch):
    from agentrl.hub.refs import installed_root

    monkeypatch.setenv("AGENTRL_HUB", str(tmp_path / "hub"))
    root = installed_root()
    assert str(root).startswith(str(tmp_path))
    _package(root / "alice" / "hub-env", "0.1.0", name="hub-env", answer="old")
    _package(root / "alice" / "hub-env", "0.2.0", name="hub-env", answer="new")
    assert load_environment("alice/hub-env").tasks("train")[0].answer == "new"  # latest version
    assert load_environment("alice/hub-env@0.1.0").tasks("train")[0].answer == "old"
    assert load_environment("hub-env").path == root / "alice" / "hub-env" / "0.2.0"
    with pytest.raises(NotFoundError, match=r"'alice/other' is not a folder nor an installed hub package .*not installed"):
        load_environment("alice/other")


BARE_IMPORT_MODULE = '''
from agentrl.environment import SingleTurnEnv
import shared_name


def load_environment():
    return SingleTurnEnv(dataset=[{"prompt": "p", "answer": shared_name.ANSWER}])
'''


def test_bare_sibling_imports_work_without_leaving_traces(tmp_path):
    answers = []
    for folder, answer in (("one", "first"), ("two", "second")):
        package = _package(tmp_path, folder, name=f"bare-{folder}", module=BARE_IMPORT_MODULE)
        (package / "shared_name.py").write_text(f"ANSWER = {answer!r}\n")
        path_before = list(sys.path)
        answers.append(load_environment(package).tasks("train")[0].answer)
        assert sys.path == path_before
        assert "shared_name" not in sys.modules
    assert answers == ["first", "second"]
