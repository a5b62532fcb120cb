"""Imports copy only the task: no link followed, links out refused in one line, loops refused, nothing
half-written; Harbor's `${VAR}` templates take host variables only where the user named them.

On main, `shutil.copytree` followed a link to a host file into the package (and from there into the
image and the hub), a link loop gave a traceback and left a half-written package, and any `${VAR}`
took the host's value.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.errors import ConfigError

TASK_TOML = """version = "1.0"
[verifier]
timeout_sec = 60.0
[agent]
timeout_sec = 60.0
[environment]
cpus = 1
memory = "512M"
storage = "1G"
env = { TOKEN = "${AGENTRL_TEST_SECRET}", MODE = "${AGENTRL_TEST_MODE:-plain}" }
"""


def write_task(folder: Path) -> Path:
    for name, text in {"task.toml": TASK_TOML, "instruction.md": "Do it.\n",
                       "environment/Dockerfile": "FROM agentrl-base:bookworm\nWORKDIR /app\n",
                       "tests/test.sh": "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
                       "tests/data.txt": "data\n"}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "env", "import", *args], capture_output=True,
                          text=True, timeout=120, env=env or dict(os.environ))


def test_a_link_out_of_the_task_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("root-only host file\n")
    task = write_task(tmp_path / "task")
    (task / "tests" / "secret.txt").symlink_to(secret)
    result = _cli("harbor", str(task), "--out", str(tmp_path / "pkg"))
    assert result.returncode == 2, result.stderr
    assert "leads out of the task folder" in result.stderr and "secret.txt" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "pkg").exists() and not list(tmp_path.glob(".pkg.partial-*"))


@pytest.mark.parametrize("kind", ["two_links", "ancestor"])
def test_a_link_loop_is_refused_in_one_line_and_nothing_is_written(tmp_path, kind):
    task = write_task(tmp_path / "task")
    if kind == "two_links":
        (task / "tests" / "a").symlink_to("b")
        (task / "tests" / "b").symlink_to("a")
    else:
        (task / "tests" / "up").symlink_to("..")
    result = _cli("harbor", str(task), "--out", str(tmp_path / "pkg"))
    assert result.returncode == 2 and "loop" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "pkg").exists() and not list(tmp_path.glob(".pkg.partial-*"))


def test_a_link_inside_the_task_stays_a_link_and_the_package_is_complete(tmp_path):
    from agentrl.hub.interop.harbor import import_harbor_task

    task = write_task(tmp_path / "task")
    (task / "tests" / "same.txt").symlink_to("data.txt")
    package = import_harbor_task(task, out=tmp_path / "pkg", name="links-inside")
    copied = package / "tests" / "same.txt"
    assert copied.is_symlink() and os.readlink(copied) == "data.txt" and copied.read_text() == "data\n"
    assert (package / "environment.toml").is_file() and (package / "data" / "tasks.jsonl").is_file()


def test_verifiers_import_refuses_a_link_out_of_the_project(tmp_path):
    from agentrl.hub.interop.verifiers import import_verifiers_package

    project = tmp_path / "proj"
    project.mkdir()
    (project / "pyproject.toml").write_text('[project]\nname = "proj"\nversion = "0.1.0"\n'
                                            'dependencies = ["verifiers"]\n')
    (project / "proj.py").write_text("def load_environment():\n    pass\n")
    (project / "leak.txt").symlink_to("/etc/hostname")
    with pytest.raises(ConfigError, match="leads out of the task folder"):
        import_verifiers_package(project, out=tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists() and not list(tmp_path.glob(".pkg.partial-*"))


def test_env_templates_take_host_variables_only_when_allowed(tmp_path, monkeypatch):
    import agentrl
    from agentrl.hub.interop.harbor import import_harbor_task

    monkeypatch.setenv("AGENTRL_TEST_SECRET", "host-secret")
    monkeypatch.setenv("AGENTRL_TEST_MODE", "from-host")
    closed = import_harbor_task(write_task(tmp_path / "task"), out=tmp_path / "closed", name="closed")
    env = agentrl.load_environment(closed)
    [task] = env.tasks("train")
    with pytest.raises(ConfigError, match="AGENTRL_TEST_SECRET, which this package does not let through; "
                                          "import it with --allow-env AGENTRL_TEST_SECRET"):
        env.sandbox_config(task)
    opened = import_harbor_task(tmp_path / "task", out=tmp_path / "open", name="opened",
                                allow_env=["AGENTRL_TEST_SECRET"])
    env = agentrl.load_environment(opened)
    [task] = env.tasks("train")
    assert env.sandbox_config(task).env == {"TOKEN": "host-secret", "MODE": "plain"}  # MODE was not named
