"""Harbor import: a Harbor task folder becomes a package whose reward runs tests/test.sh in a real Docker
sandbox; the package builds, pushes and pulls through the local hub and scores the oracle 1 and a no-op 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.hub.harbor import import_harbor_task, read_harbor_task
from tests.fakes.hub_fixtures import docker_client, remove_images  # noqa: F401

pytestmark = pytest.mark.integration

TASK_TOML = """version = "1.0"

[metadata]
author_name = "agentrl tests"
difficulty = "easy"
category = "file-operations"
tags = ["trivial", "files"]

[verifier]
timeout_sec = 60.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 600.0
cpus = 1
memory = "512M"
storage = "1G"
allow_internet = false
"""

TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/hello.txt 2>/dev/null)" = "Hello, world!" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def write_harbor_task(folder: Path, *, test_sh: str = TEST_SH, base: str = "agentrl-base:bookworm") -> Path:
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "solution").mkdir()
    (folder / "task.toml").write_text(TASK_TOML)
    (folder / "instruction.md").write_text("Create the file /app/hello.txt containing exactly: Hello, world!\n")
    (folder / "environment" / "Dockerfile").write_text(f"FROM {base}\nWORKDIR /app\nCOPY seed.txt /app/seed.txt\n")
    (folder / "environment" / "seed.txt").write_text("build context is environment/\n")
    (folder / "tests" / "test.sh").write_text(test_sh)
    (folder / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'Hello, world!' > /app/hello.txt\n")
    return folder


@pytest.fixture(scope="module")
def base_image(docker_client):
    """The project's sandbox base image (built once by the sandbox layer when missing)."""
    from agentrl.sandbox.base_image import BASE_IMAGE_TAG, build_base_image

    build_base_image()
    return BASE_IMAGE_TAG


def _cli(*args, env):
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "env", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_read_harbor_task_maps_config(tmp_path):
    task = read_harbor_task(write_harbor_task(tmp_path / "hello"))
    assert (task["memory_mb"], task["storage_mb"], task["cpus"], task["network"]) == (512, 1024, 1.0, False)
    assert task["workdir"] == "/app" and task["verifier_timeout_s"] == 60.0 and "files" in task["tags"]


def test_bad_harbor_folders_are_one_line_errors(tmp_path):
    folder = write_harbor_task(tmp_path / "hello")
    (folder / "tests" / "test.sh").unlink()
    with pytest.raises(NotFoundError, match="not a Harbor task, tests/test.sh is missing"):
        import_harbor_task(folder, out=tmp_path / "out")
    folder = write_harbor_task(tmp_path / "hello2")
    (folder / "task.toml").write_text(TASK_TOML.replace('memory = "512M"', 'memory = "lots"'))
    with pytest.raises(AgentrlError, match=r"\[environment\] memory = 'lots' is not a size"):
        import_harbor_task(folder, out=tmp_path / "out2")


async def test_imported_task_builds_publishes_and_rewards_by_its_test_script(tmp_path, base_image, remove_images):
    import agentrl
    from agentrl.loader import import_package_attr
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    env_vars = dict(os.environ, AGENTRL_HUB=str(tmp_path / "hub"))
    harbor_dir = write_harbor_task(tmp_path / "hello-task")
    package = tmp_path / "pkg"
    imported = _cli("import", "harbor", str(harbor_dir), "--out", str(package), env=env_vars)
    assert imported.returncode == 0, imported.stderr
    assert (package / "tests" / "test.sh").read_text() == TEST_SH
    remove_images.append("harbor-hello-task:0.1.0")
    built = _cli("build", str(package), "--out", str(tmp_path / "build"), env=env_vars)
    assert built.returncode == 0, built.stderr
    assert _cli("push", str(package), "--repo", "alice/harbor-hello-task", env=env_vars).returncode == 0
    pulled = _cli("pull", "alice/harbor-hello-task", env=env_vars)
    assert pulled.returncode == 0, pulled.stderr
    pulled_dir = Path(pulled.stdout.strip().splitlines()[-1])

    env = agentrl.load_environment(pulled_dir)
    [task] = env.tasks("test")
    assert "hello.txt" in task.prompt[-1].content
    oracle = import_package_attr(pulled_dir, "harbor_task:oracle_policy", package_name=env.name)()
    sampling = SamplingConfig()
    [solved] = await env.run_group(oracle, task, n=1, sampling=sampling)
    assert solved.error is None, solved.error
    assert solved.reward == 1.0 and solved.state["verifier_exit_code"] == 0
    assert "[exit code 0]" in solved.messages[-2].content  # the bash tool ran solve.sh in the sandbox
    [idle] = await env.run_group(ScriptedPolicy(["I did nothing."]), task, n=1, sampling=sampling)
    assert idle.error is None and idle.reward == 0.0


async def test_missing_reward_file_scores_zero_with_an_error(tmp_path, base_image, remove_images):
    import agentrl
    from agentrl.hub.images import build_image
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    harbor_dir = write_harbor_task(tmp_path / "no-reward", test_sh="#!/bin/bash\necho 'forgot the reward'\n")
    package = import_harbor_task(harbor_dir, out=tmp_path / "pkg")
    remove_images.append("harbor-no-reward:0.1.0")
    build_image(package, dockerfile="environment/Dockerfile", tag="harbor-no-reward:0.1.0")
    env = agentrl.load_environment(package)
    [task] = env.tasks("train")
    [rollout] = await env.run_group(ScriptedPolicy(["done"]), task, n=1, sampling=SamplingConfig())
    assert rollout.reward == 0.0 and rollout.metrics["verifier_ran"] == 0.0
    assert "wrote no reward" in rollout.state["verifier_error"]
