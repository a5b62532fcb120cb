"""`agentrl env swebench-image`: a SWE-bench row's image built from the row with a local source mirror, then graded.

Offline, as the Django tests are: the "project" is the tiny Django-style testbed (swebench_django/), published as
a bare git mirror made here; the environment image stands in for SWE-bench's env image (the conda env `testbed`
with the project's python). The row names an image under a namespace of its own that nothing else builds.

1. Before the image exists, a rollout's error is one line carrying the command.
2. `agentrl env swebench-image PACKAGE --source MIRROR --env-image ENV` (the CLI) builds it: the repository at the
   row's base_commit in /testbed, no network; a source without that commit is one line.
3. The package's default oracle (short calls: `git apply` of the gold patch the environment put in its sandbox)
   scores 1 at the default sampling (max_tokens 128), the empty patch 0, graded through the row's eval script and
   swebench's Django log parser, under runc and runsc.
4. `--task-repo`: swebench's task-repo layout (tasks/<id>/Dockerfile and its context) builds the same image.
"""

from __future__ import annotations

import sys
from pathlib import Path

for _folder in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import json
import os
import shutil
import subprocess

import pytest
from swe_testlib import (
    DJANGO_FAIL_TO_PASS,
    DJANGO_INSTANCE_ID,
    DJANGO_PASS_TO_PASS,
    SWEBENCH_FIXTURE,
    build_sample_images,
    django_eval_script,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "integration"))
from sandbox_backends import runsc_ok  # noqa: E402

pytest.importorskip("swebench", reason="the swebench extra is not installed")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NAMESPACE = "agentrl-test-built"
IMAGE = f"{NAMESPACE}/sweb.eval.x86_64.django_1776_django-11099:latest"
ENV_IMAGE = "agentrl-test/swebench-env-django:latest"
ENV_DOCKERFILE = """ARG BASE_IMAGE=agentrl-base:bookworm
FROM ${BASE_IMAGE}
COPY activate /opt/miniconda3/bin/activate
RUN mkdir -p /opt/miniconda3/envs/testbed/bin && ln -s /usr/bin/python3 /opt/miniconda3/envs/testbed/bin/python
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONHASHSEED=0
"""


def _git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def mirror(tmp_path_factory) -> tuple[Path, str]:
    """A bare git mirror of the Django-style project (two commits: the row's base, then a later one) and the base."""
    work = tmp_path_factory.mktemp("project") / "django"
    shutil.copytree(SWEBENCH_FIXTURE / "testbed", work)
    (work / "tests" / "runtests.py").chmod(0o755)
    _git("init", "-q", "-b", "main", cwd=work)
    _git("add", "-A", cwd=work)
    _git("-c", "user.name=agentrl", "-c", "user.email=agentrl@localhost", "commit", "-q", "-m", "base", cwd=work)
    base = _git("rev-parse", "HEAD", cwd=work).strip()
    (work / "NEWS").write_text("a later commit the image must not hold\n")
    _git("add", "-A", cwd=work)
    _git("-c", "user.name=agentrl", "-c", "user.email=agentrl@localhost", "commit", "-q", "-m", "later", cwd=work)
    bare = work.parent / "django.git"
    _git("clone", "-q", "--bare", str(work), str(bare), cwd=work.parent)
    return bare, base


@pytest.fixture(scope="module")
def env_image(tmp_path_factory) -> str:
    from swe_images import build_folder_image

    build_sample_images()  # the base image
    folder = tmp_path_factory.mktemp("env-image")
    (folder / "Dockerfile").write_text(ENV_DOCKERFILE)
    shutil.copy(SWEBENCH_FIXTURE / "activate", folder / "activate")
    return build_folder_image(folder, tag=ENV_IMAGE)


@pytest.fixture(scope="module")
def package(tmp_path_factory, mirror, docker_client):
    from agentrl.hub.interop.swebench import import_swebench_rows

    _, base = mirror
    test_patch = (SWEBENCH_FIXTURE / "test.patch").read_text()
    row = {
        "repo": "django/django", "instance_id": DJANGO_INSTANCE_ID, "base_commit": base, "version": "3.0",
        "patch": (SWEBENCH_FIXTURE / "gold.patch").read_text(), "test_patch": test_patch,
        "problem_statement": "UsernameValidator allows a trailing newline in usernames.", "hints_text": "",
        "FAIL_TO_PASS": json.dumps(DJANGO_FAIL_TO_PASS), "PASS_TO_PASS": json.dumps(DJANGO_PASS_TO_PASS),
        "environment_setup_commit": base, "image": IMAGE, "eval_script": django_eval_script(base, test_patch),
        "log_parser": "parse_log_django", "eval_type": "pass_and_fail",
    }
    folder = tmp_path_factory.mktemp("rows")
    (folder / "rows.jsonl").write_text(json.dumps(row) + "\n")
    docker_client.images.remove(IMAGE, force=True) if _exists(docker_client, IMAGE) else None
    yield import_swebench_rows(folder / "rows.jsonl", out=folder / "pkg")
    if _exists(docker_client, IMAGE):
        docker_client.images.remove(IMAGE, force=True)


@pytest.fixture(scope="module")
def docker_client():
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
    except Exception:  # noqa: BLE001
        pytest.skip("no Docker engine")
    return client


def _exists(client, image: str) -> bool:
    import docker

    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "env", "swebench-image", *args],
                          capture_output=True, text=True, timeout=600, check=False)


async def test_missing_image_names_the_command_then_the_built_image_grades(package, mirror, env_image, docker_client):
    import agentrl
    from agentrl.hub.entrypoint import import_package_attr
    from agentrl.policies import ScriptedPolicy, tool_call
    from agentrl.sampling import SamplingConfig

    env = agentrl.load_environment(package)
    [task] = env.tasks("test")
    [missing] = await env.run_group(ScriptedPolicy(["x"]), task, n=1, sampling=SamplingConfig())
    assert f"agentrl env swebench-image {package} --instance {DJANGO_INSTANCE_ID}" in missing.error
    assert "\n" not in missing.error

    bare, base = mirror
    wrong = _cli(str(package), "--source", str(SWEBENCH_FIXTURE), "--env-image", env_image)  # not a git repo
    assert wrong.returncode != 0 and "git clone failed" in wrong.stderr and "\n" not in wrong.stderr.strip()
    built = _cli(str(package), "--source", str(bare), "--env-image", env_image)
    assert built.returncode == 0, built.stderr
    assert f"built {IMAGE}: django/django at {base[:12]}" in built.stdout
    head = docker_client.containers.run(IMAGE, "git rev-parse HEAD", remove=True, network_disabled=True)
    assert head.decode().strip() == base  # the row's base_commit, not the mirror's later commit

    oracle = import_package_attr(package, "swebench_rows:oracle_policy", package_name=env.name)()
    idle = ScriptedPolicy([{"tool_calls": [tool_call("submit", answer="nothing to change")]}])
    for runtime in ["runc", *(["runsc"] if runsc_ok() else [])]:
        runtime_env = agentrl.load_environment(package, runtime=runtime)
        [solved] = await runtime_env.run_group(oracle, task, n=1, sampling=SamplingConfig())  # max_tokens 128
        assert solved.error is None and not solved.truncated, solved.error
        assert solved.reward == 1.0 and solved.metrics["fail_to_pass"] == 1.0, solved.state.get("grade")
        [empty] = await runtime_env.run_group(idle, task, n=1, sampling=SamplingConfig())
        assert empty.reward == 0.0 and empty.metrics["empty_patch"] == 1.0


def test_a_source_without_the_base_commit_is_one_line(package, env_image, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    _git("init", "-q", "-b", "main", cwd=other)
    (other / "README").write_text("unrelated\n")
    _git("add", "-A", cwd=other)
    _git("-c", "user.name=a", "-c", "user.email=a@b", "commit", "-q", "-m", "x", cwd=other)
    result = _cli(str(package), "--source", str(other), "--env-image", env_image)
    assert result.returncode != 0 and "the source has no commit" in result.stderr
    result = _cli(str(package), "--source", str(other))
    assert result.returncode != 0 and "--source and --env-image go together" in result.stderr


def test_task_repo_layout_builds_the_rows_image(package, mirror, env_image, tmp_path, docker_client):
    """swebench 5's task repo: tasks/<instance_id>/Dockerfile with its own build context."""
    bare, base = mirror
    task_dir = tmp_path / "task-repo" / "tasks" / DJANGO_INSTANCE_ID
    task_dir.mkdir(parents=True)
    _git("clone", "-q", str(bare), str(task_dir / "testbed"), cwd=tmp_path)
    _git("checkout", "-q", "--detach", base, cwd=task_dir / "testbed")
    (task_dir / "Dockerfile").write_text(f"FROM {env_image}\nCOPY testbed /testbed\nWORKDIR /testbed\n")
    (task_dir / "task.yaml").write_text(f"instance_id: {DJANGO_INSTANCE_ID}\nrepo: django/django\n")
    docker_client.images.remove(IMAGE, force=True) if _exists(docker_client, IMAGE) else None
    result = _cli(str(package), "--task-repo", str(tmp_path / "task-repo"), "--instance", DJANGO_INSTANCE_ID)
    assert result.returncode == 0, result.stderr
    head = docker_client.containers.run(IMAGE, "git -C /testbed rev-parse HEAD", remove=True, network_disabled=True)
    assert head.decode().strip() == base
    missing = _cli(str(package), "--task-repo", str(tmp_path / "nowhere"))
    assert missing.returncode != 0 and "\n" not in missing.stderr.strip()
