"""Harbor import: task.toml read field by field (honoured, warned or refused in one line), fixtures checked
with harbor 0.25's own models, dataset folders and registry lists as one package, and an imported task that
builds, pushes and pulls through the local hub and scores its oracle 1 and a no-op 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import harbor_tasks
import pytest

from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.hub.interop.harbor import find_harbor_tasks, import_harbor_task, read_harbor_task
from agentrl.hub.interop.harbor_verifier import combine_rewards, parse_rewards
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


def write_harbor_task(folder: Path, *, test_sh: str = TEST_SH, toml: str = TASK_TOML) -> Path:
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "solution").mkdir()
    (folder / "task.toml").write_text(toml)
    (folder / "instruction.md").write_text("Create the file /app/hello.txt containing exactly: "
                                           "Hello, world!\n")
    (folder / "environment" / "Dockerfile").write_text("FROM agentrl-base:bookworm\nWORKDIR /app\n"
                                                       "COPY seed.txt /app/seed.txt\n")
    (folder / "environment" / "seed.txt").write_text("build context is environment/\n")
    (folder / "tests" / "test.sh").write_text(test_sh)
    (folder / "solution" / "solve.sh").write_text("#!/bin/bash\necho 'Hello, world!' > /app/hello.txt\n")
    return folder


@pytest.fixture(scope="module")
def base_image(docker_client):  # noqa: F811
    """The project's sandbox base image (built once by the sandbox layer when missing)."""
    from agentrl.sandbox.base_image import BASE_IMAGE_TAG, build_base_image

    build_base_image()
    return BASE_IMAGE_TAG


def _cli(*args, env):
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "env", *args], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(not harbor_tasks.harbor_available(), reason="harbor 0.25 venv (python3.12) missing: "
                    "python3.12 -m venv /tmp/harbor-venv && /tmp/harbor-venv/bin/pip install harbor==0.25.0")
def test_fixtures_are_tasks_harbor_itself_accepts(tmp_path):
    folders = [harbor_tasks.named(tmp_path / "named"), harbor_tasks.steps(tmp_path / "steps"),
               harbor_tasks.installs(tmp_path / "installs"), harbor_tasks.slow(tmp_path / "slow"),
               write_harbor_task(tmp_path / "hello"),
               *(harbor_tasks.network(tmp_path / m, m) for m in ("public", "no-network", "allowlist")),
               harbor_tasks.compose(tmp_path / "compose")]
    out = harbor_tasks.harbor_validate(folders)
    assert f"{tmp_path / 'steps'} 1.4 2" in out and len(out.splitlines()) == len(folders)


def test_task_toml_fields_map_as_harbor_means_them(tmp_path):
    legacy = read_harbor_task(write_harbor_task(tmp_path / "hello"))
    assert (legacy.memory_mb, legacy.storage_mb, legacy.cpus, legacy.workdir) == (512, 1024, 1.0, "/app")
    [step] = legacy.steps
    assert step.agent_network.mode == step.verifier_network.mode == "no-network"  # allow_internet = false
    assert (step.verifier_timeout_s, step.agent_timeout_s) == (60.0, 120.0) and "files" in legacy.tags
    named = read_harbor_task(harbor_tasks.named(tmp_path / "named"))
    [step] = named.steps
    assert named.workdir == "/work"  # [environment] workdir over the Dockerfile's WORKDIR /app
    assert (step.agent_user, step.verifier_user, named.primary_reward) == ("1000", "root", "correctness")
    assert step.instruction.startswith("Write hello.txt")  # the canary line is not shown to the agent
    assert named.healthcheck.retries == 2 and named.solution_env == {"ANSWER_FILE": "answer.txt"}
    public = read_harbor_task(harbor_tasks.network(tmp_path / "public", "public")).steps[0]
    assert (public.agent_network.mode, public.verifier_network.mode) == ("public", "no-network")
    allow = read_harbor_task(harbor_tasks.network(tmp_path / "allow", "allowlist")).steps[0]
    assert allow.agent_network.allowed_hosts == ["pypi.org", "*.pythonhosted.org"]
    default = read_harbor_task(harbor_tasks.slow(tmp_path / "slow"))
    assert default.steps[0].verifier_timeout_s == 600.0 and default.schema_version == "1.4"
    two = read_harbor_task(harbor_tasks.steps(tmp_path / "steps"))
    assert [s.name for s in two.steps] == ["write", "extend"] and two.steps[0].min_reward == 1.0


@pytest.mark.parametrize("extra, message", [
    ('[environment]\nos = "windows"\n', r"environment.os = 'windows' cannot be run by agentrl"),
    ("[environment]\ngpus = 1\n", r"environment.gpus = 1 cannot be run by agentrl: GPU"),
    ('[[environment.mcp_servers]]\nname = "x"\ntransport = "streamable-http"\nurl = "https://mcp.example.com/mcp"\n',
     r"environment.mcp_servers\[0\]: MCP server 'x' at 'https://mcp.example.com/mcp' is not on the sandbox's own "
     r"network \(no services\); it would need the internet"),
    ('[[environment.mcp_servers]]\nname = "x"\ntransport = "sse"\nurl = "http://x/sse"\n',
     r"environment.mcp_servers\[0\]: transport 'sse' cannot be run by agentrl"),
    ('[[environment.mcp_servers]]\nname = "x"\n', r"environment.mcp_servers\[0\]: MCP server 'x' \(stdio\) has no command"),
    ('[verifier.environment]\ndocker_image = "other"\n', r"verifier.environment cannot be run by agentrl"),
    ('[[verifier.collect]]\ncommand = "true"\n', r"verifier.collect cannot be run by agentrl"),
    ('[environment.tpu]\ntype = "v6e"\ntopology = "2x2"\n', r"environment.tpu cannot be run by agentrl"),
    ('[agent]\nnetwork_mode = "sometimes"\n', r"\[agent\] network_mode = 'sometimes'; use 'public'"),
    ("[environment.healthcheck]\nretries = 2\n", r"environment.healthcheck.command: Field required"),
    ('[agent]\ntimeout_sec = "soon"\n', r"\[agent\] timeout_sec = 'soon': must be a valid number"),
    ('[environment]\ncpus = "two"\n', r"\[environment\] cpus = 'two': must be a valid number"),
    # imported, then every rollout failed with "cleanup failed: SandboxError: exec timeout -5.0" (a walk-through)
    ("[verifier]\ntimeout_sec = -5\n", r"\[verifier\] timeout_sec = -5: must be greater than 0"),
    ("[environment]\nmemory_mb = 0\n", r"\[environment\] memory_mb = 0: must be greater than 0"),  # was 2048
    ('[environment.healthcheck]\ncommand = "true"\nretries = "many"\n',
     r"environment.healthcheck.retries: Input"),
])
def test_fields_agentrl_cannot_honour_are_refused_in_one_line(tmp_path, extra, message):
    folder = write_harbor_task(tmp_path / "task", toml='version = "1.4"\n' + extra)
    with pytest.raises(ConfigError, match=message) as raised:
        import_harbor_task(folder, out=tmp_path / "out")
    assert "\n" not in str(raised.value) and "task.toml" in str(raised.value)


def test_fields_run_without_are_warned_one_line_each(tmp_path):
    toml = ('version = "1.4"\nartifacts = ["/app/log.txt"]\nfancy = 1\n'
            '[verifier]\nenvironment_mode = "shared"\n'
            '[environment]\nskills_dir = "/skills"\nbuild_timeout_sec = 900.0\nmemroy_mb = 512\n[agnet]\nuser = 1\n')
    folder = write_harbor_task(tmp_path / "task", toml=toml)
    lines: list[str] = []
    import_harbor_task(folder, out=tmp_path / "out", log=lines.append)
    assert len(lines) == 7 and all("\n" not in line for line in lines)
    for field in ("artifacts ignored", "fancy is not a field of Harbor 0.25's task.toml; ignored",
                  # a typo gets the field it was meant to be (a walk-through: `memroy_mb` kept the default limits)
                  "environment.memroy_mb is not a field of Harbor 0.25's task.toml (did you mean "
                  "'environment.memory_mb'?); ignored", "agnet is not a field of Harbor 0.25's task.toml (did you "
                  "mean 'agent'?); ignored",
                  "verifier.environment_mode = 'shared'", "environment.skills_dir ignored",
                  "environment.build_timeout_sec ignored"):
        assert any(field in line for line in lines), (field, lines)


def test_bad_harbor_folders_are_one_line_errors(tmp_path):
    folder = write_harbor_task(tmp_path / "hello")
    (folder / "tests" / "test.sh").unlink()
    with pytest.raises(NotFoundError, match="not a Harbor task, tests/test.sh is missing"):
        import_harbor_task(folder, out=tmp_path / "out")
    lots = TASK_TOML.replace('memory = "512M"', 'memory = "lots"')
    folder = write_harbor_task(tmp_path / "hello2", toml=lots)
    with pytest.raises(AgentrlError, match=r"\[environment\] memory = 'lots' is not a size"):
        import_harbor_task(folder, out=tmp_path / "out2")
    folder = write_harbor_task(tmp_path / "compose")
    compose = folder / "environment" / "docker-compose.yaml"
    compose.write_text("services:\n  main:\n    build: .\n  db:\n    image: postgres\n"
                       "    ports: ['5432:5432']\n")
    with pytest.raises(ConfigError, match=r"services.db.ports cannot be run by agentrl \(its services may"):
        import_harbor_task(folder, out=tmp_path / "out3")
    compose.write_text("services:\n  a:\n    image: x\n    depends_on: [b]\n"
                       "  b:\n    image: y\n    depends_on: [a]\n")
    with pytest.raises(ConfigError, match="services depend on each other in a cycle: a -> b -> a"):
        import_harbor_task(folder, out=tmp_path / "out5")
    steps = harbor_tasks.steps(tmp_path / "steps")
    toml = (steps / "task.toml").read_text()
    (steps / "task.toml").write_text(toml + '[steps.agent]\nuser = "root"\n')
    with pytest.raises(ConfigError, match=r"steps\[1\].agent.user = 'root' differs from the first step's"):
        import_harbor_task(steps, out=tmp_path / "out6")
    (steps / "task.toml").write_text(toml + '[steps.agent]\nnetwork_mode = "public"\n')
    with pytest.raises(ConfigError, match=r"steps\[1\].agent.network_mode differs from the first step's"):
        import_harbor_task(steps, out=tmp_path / "out7")
    (steps / "task.toml").write_text(toml)
    (steps / "steps" / "extend" / "instruction.md").unlink()
    with pytest.raises(NotFoundError, match=r"steps/extend: not a Harbor task, instruction.md is missing"):
        import_harbor_task(steps, out=tmp_path / "out4")


def test_carry_paths_are_absolute_folders(tmp_path):
    from agentrl.hub.interop.harbor_config import check_carry_paths

    assert check_carry_paths(["/root/", " /srv ", ""]) == ["/root", "/srv"]
    for bad in ("relative/dir", "/", "/srv/../etc"):
        with pytest.raises(ConfigError, match="give an absolute folder other than /"):
            check_carry_paths([bad])
    task = write_harbor_task(tmp_path / "task")
    result = _cli("import", "harbor", str(task), "--out", str(tmp_path / "pkg"), "--carry", "/root",
                  "--carry", "/srv", env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert 'carry_paths = "/root,/srv"' in (tmp_path / "pkg" / "environment.toml").read_text()


def test_rewards_are_read_as_harbor_reads_them():
    assert parse_rewards('{"correctness": 1, "performance": 0.5}', "reward.json") == {"correctness": 1.0,
                                                                                    "performance": 0.5}
    assert parse_rewards("0.75\n", "reward.txt") == {"reward": 0.75} == parse_rewards("0.75", "reward.json")
    for bad in ('{"correctness": "yes"}', '{"x": NaN}', '{"x": true}'):
        with pytest.raises(ValueError, match="is not a finite number"):
            parse_rewards(bad, "reward.json")
    with pytest.raises(ValueError, match="empty"):
        parse_rewards("", "reward.txt")
    named = {"correctness": 1.0, "performance": 0.5}
    assert combine_rewards(named, "correctness") == 1.0 and combine_rewards(named, None) == 0.75
    assert combine_rewards({"reward": 0.2, "extra": 1.0}, None) == 0.2 and combine_rewards({}, None) == 0.0


def test_a_dataset_folder_and_a_registry_list_become_one_package(tmp_path):
    import json

    import agentrl

    dataset = tmp_path / "dataset"
    harbor_tasks.named(dataset / "named")
    harbor_tasks.steps(dataset / "steps")
    assert [f.name for f in find_harbor_tasks(dataset)] == ["named", "steps"]
    package = import_harbor_task(dataset, out=tmp_path / "pkg")
    env = agentrl.load_environment(package)
    rows = env.tasks("train")
    assert [r.info["harbor_dir"] for r in rows] == ["tasks/named-rewards", "tasks/two-steps"]
    assert [r.info["image"] for r in rows] == ["harbor-dataset-named-rewards:0.1.0",
                                              "harbor-dataset-two-steps:0.1.0"]
    assert (package / "tasks" / "two-steps" / "steps" / "extend" / "workdir" / "setup.sh").is_file()
    assert env.harbor_task(rows[1]).multi_step and rows[1].prompt[-1].content.startswith("Write 'one'")
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps([{"name": "mini", "version": "1.0", "description": "",
                                     "tasks": [{"name": "named", "path": "dataset/named"}]}]))
    from_registry = import_harbor_task(registry, out=tmp_path / "pkg2")
    assert len(agentrl.load_environment(from_registry).tasks("train")) == 1
    registry.write_text(json.dumps({"datasets": [{"name": "remote", "tasks": [
        {"name": "x", "git_url": "https://example.com/x.git", "path": "tasks/x"}]}]}))
    with pytest.raises(ConfigError, match=r"datasets\[0\].tasks\[0\] lives in https://example.com/x.git"):
        import_harbor_task(registry, out=tmp_path / "pkg3", log=lambda line: None)


def test_a_dataset_imports_what_can_run_and_says_what_it_skipped(tmp_path):
    """A refused task of a dataset (or a registry entry in a git repository) is skipped with its one-line reason;
    a summary line names them, the package's README lists them; a dataset where nothing can run is one line."""
    import json

    import agentrl

    dataset = tmp_path / "dataset"
    harbor_tasks.named(dataset / "named")
    write_harbor_task(dataset / "gpu", toml='version = "1.4"\n[environment]\ngpus = 1\n')
    write_harbor_task(dataset / "broken", toml="[environment\n")
    harbor_tasks.steps(dataset / "steps")
    lines: list[str] = []
    package = import_harbor_task(dataset, out=tmp_path / "pkg", log=lines.append)
    assert [r.info["harbor_task"] for r in agentrl.load_environment(package).tasks("train")] == [
        "agentrl/named-rewards", "agentrl/two-steps"]
    skipped = [line for line in lines if line.startswith("skipped ")]
    assert len(skipped) == 2 and all("\n" not in line for line in lines)
    assert skipped[0].startswith("skipped broken: ") and "malformed TOML" in skipped[0]
    assert skipped[1].startswith("skipped gpu: ") and "environment.gpus = 1 cannot be run by agentrl" in skipped[1]
    assert lines[-1] == f"{dataset}: imported 2 of 4 tasks; skipped 2 (broken, gpu), each for the reason above"
    assert "## Skipped at import" in (package / "README.md").read_text()
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps([{"name": "mixed", "tasks": [
        {"name": "named", "path": "dataset/named"},
        {"name": "remote", "git_url": "https://example.com/x.git", "path": "tasks/x"}]}]))
    lines.clear()
    from_registry = import_harbor_task(registry, out=tmp_path / "pkg2", log=lines.append)
    assert len(agentrl.load_environment(from_registry).tasks("train")) == 1
    assert any(line.startswith("skipped remote: ") and "agentrl downloads nothing" in line for line in lines)
    only_refused = tmp_path / "refused"
    write_harbor_task(only_refused / "gpu", toml='version = "1.4"\n[environment]\ngpus = 1\n')
    with pytest.raises(ConfigError, match=r"none of its 1 Harbor tasks can run here .* the first: .*gpus") as caught:
        import_harbor_task(only_refused, out=tmp_path / "pkg3", log=lines.append)
    assert "\n" not in str(caught.value)


async def test_imported_task_builds_publishes_and_rewards_by_its_test_script(
        tmp_path, base_image, remove_images):  # noqa: F811
    import agentrl
    from agentrl.hub.entrypoint import import_package_attr
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
    sampling = SamplingConfig()  # default max_tokens: the oracle's one short call is not cut
    [solved] = await env.run_group(oracle, task, n=1, sampling=sampling)
    assert solved.error is None, solved.error
    assert solved.reward == 1.0 and solved.state["verifier_exit_code"] == 0
    assert "[exit code 0]" in solved.messages[-2].content  # /solution/solve.sh ran in the sandbox
    [idle] = await env.run_group(ScriptedPolicy(["I did nothing."]), task, n=1, sampling=sampling)
    assert idle.error is None and idle.reward == 0.0


def test_cli_import_prints_warnings_and_refusals_as_lines(tmp_path):
    toml = TASK_TOML + 'skills_dir = "/skills"\n'
    folder = write_harbor_task(tmp_path / "task", toml=toml)
    result = _cli("import", "harbor", str(folder), "--out", str(tmp_path / "pkg"), env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "warning: " in result.stdout and "environment.skills_dir ignored" in result.stdout
    bad = write_harbor_task(tmp_path / "bad", toml=TASK_TOML + "gpus = 2\n")
    refused = _cli("import", "harbor", str(bad), "--out", str(tmp_path / "pkg2"), env=dict(os.environ))
    assert refused.returncode == 2 and "environment.gpus = 2 cannot be run by agentrl" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_env_templates_resolve_from_the_host_or_name_the_missing_variable(monkeypatch):
    from agentrl.hub.interop.harbor_config import resolve_env

    monkeypatch.setenv("AGENTRL_HARBOR_SET", "from-host")
    monkeypatch.delenv("AGENTRL_HARBOR_UNSET", raising=False)
    values = {"A": "${AGENTRL_HARBOR_SET}", "B": "${AGENTRL_HARBOR_UNSET:-fallback}", "C": "literal ${x}"}
    allowed = ["AGENTRL_HARBOR_SET", "AGENTRL_HARBOR_UNSET"]
    assert resolve_env(values, where="task", allowed=allowed) == {"A": "from-host", "B": "fallback", "C": "literal ${x}"}
    with pytest.raises(ConfigError, match=r"B = '\$\{AGENTRL_HARBOR_UNSET\}' needs the host environment"):
        resolve_env({"B": "${AGENTRL_HARBOR_UNSET}"}, where="task.toml: [verifier] env", allowed=allowed)


async def test_a_sandbox_asking_for_network_it_cannot_get_says_so_or_is_refused(docker_client, base_image):  # noqa: F811
    from agentrl.sandbox import SandboxConfig, create_sandbox
    from agentrl.sandbox.docker_backend import network_unavailable

    why = network_unavailable(docker_client, "runc")
    if why is None:
        pytest.skip("this engine gives sandboxes a bridge network")
    async with create_sandbox(SandboxConfig(network=True, memory_mb=256)) as sandbox:
        note = sandbox.network_note
        assert note is not None and why in note and "\n" not in note
        interfaces = await sandbox.exec("tail -n +3 /proc/net/dev | grep -vc '^ *lo:'")
        assert interfaces.stdout.strip() == "0"
    from agentrl.errors import SandboxError

    with pytest.raises(SandboxError, match="sandbox network: asked for, but this host gives sandboxes none"):
        await create_sandbox(SandboxConfig(network=True, unenforceable_limits="refuse")).start()


def test_an_import_whose_image_fails_to_build_leaves_no_package_and_can_run_again(tmp_path, remove_images):  # noqa: F811
    """A failed `--build` left the package behind, and the same import after fixing the Dockerfile was refused
    ("folder exists and is not empty"), found by an ecosystem walk-through."""
    task = harbor_tasks.named(tmp_path / "task")
    dockerfile = task / "environment" / "Dockerfile"
    good = dockerfile.read_text()
    dockerfile.write_text(good + "RUN false\n")
    name = f"agentrl-test-badbuild-{os.getpid()}"
    failed = _cli("import", "harbor", str(task), "--out", str(tmp_path / "pkg"), "--name", name, "--build",
                  env=dict(os.environ))
    assert failed.returncode == 2 and f"{task}: an image did not build, so {tmp_path / 'pkg'} was not kept" in \
        failed.stderr, failed.stderr
    assert not (tmp_path / "pkg").exists()
    dockerfile.write_text(good)
    remove_images.append(f"{name}:0.1.0")
    again = _cli("import", "harbor", str(task), "--out", str(tmp_path / "pkg"), "--name", name, "--build",
                 env=dict(os.environ))
    assert again.returncode == 0, again.stderr
