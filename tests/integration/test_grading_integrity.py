"""Grading out of the agent's reach, on a Harbor-style task under runc and gVisor.

The task's oracle runs an executable script that the image puts in the working directory
(so the workspace must allow exec in every disk mode), and its verifier writes
/logs/verifier/reward.txt and then takes a second to finish. Three policies: the oracle
scores 1, a do-nothing policy 0, and a policy that leaves a loop rewriting the reward file
to 1 scores 0 (the verifier runs in a fresh sandbox where that loop does not exist).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harbor_tasks import built_package
from sandbox_backends import DOCKER_BACKENDS

from tests.fakes.hub_fixtures import docker_client, remove_images  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TASK_TOML = """version = "1.0"
[verifier]
timeout_sec = 60.0
[agent]
timeout_sec = 120.0
[environment]
cpus = 1
memory = "512M"
storage = "1G"
"""
DOCKERFILE = """FROM agentrl-base:bookworm
WORKDIR /app
COPY make_output.sh /app/make_output.sh
RUN chmod 755 /app/make_output.sh
"""
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/output.txt 2>/dev/null)" = "expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
sleep 1
"""
REWRITER = ("nohup sh -c 'while true; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
            "sleep 0.05; done' >/dev/null 2>&1 & echo planted")


def write_task(folder: Path) -> Path:
    (folder / "environment").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "solution").mkdir()
    (folder / "task.toml").write_text(TASK_TOML)
    (folder / "instruction.md").write_text("Run /app/make_output.sh to write /app/output.txt.\n")
    (folder / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (folder / "environment" / "make_output.sh").write_text("#!/bin/sh\necho expected > /app/output.txt\n")
    (folder / "tests" / "test.sh").write_text(TEST_SH)
    (folder / "solution" / "solve.sh").write_text("#!/bin/bash\ncd /app && ./make_output.sh\n")
    return folder


def bash_call(command: str) -> dict:
    import json

    return {"content": "", "tool_calls": [{"id": "call_0", "type": "function",
                                           "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]}


@pytest.fixture(scope="module")
def harbor_package(tmp_path_factory, docker_client):  # noqa: F811
    root = tmp_path_factory.mktemp("grading")
    yield from built_package(write_task(root / "exec-task"), root / "pkg", name="harbor-exec-task", docker_client=docker_client)


@pytest.mark.parametrize("backend", DOCKER_BACKENDS)
async def test_oracle_one_idle_zero_reward_rewriter_zero(backend, harbor_package):
    import agentrl
    from agentrl.hub.interop.harbor_env import harbor_oracle_policy
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    env = agentrl.load_environment(harbor_package, runtime=backend["runtime"])
    [task] = env.tasks("train")
    sampling = SamplingConfig(max_tokens=1024)  # the scripted tool calls fit in one reply
    [solved] = await env.run_group(harbor_oracle_policy(harbor_package), task, n=1, sampling=sampling)
    [idle] = await env.run_group(ScriptedPolicy(["I did nothing."]), task, n=1, sampling=sampling)
    [cheat] = await env.run_group(ScriptedPolicy([bash_call(REWRITER), "done"]), task, n=1, sampling=sampling)
    assert solved.error is None and solved.reward == 1.0, (solved.error, solved.state.get("verifier_output"))
    assert "[exit code 0]" in solved.messages[-2].content  # ./make_output.sh ran from the workspace
    assert idle.error is None and idle.reward == 0.0
    assert "planted" in cheat.messages[-2].content  # the loop was running when the episode ended
    assert cheat.error is None and cheat.reward == 0.0, cheat.state.get("verifier_output")
    assert cheat.state["verifier_exit_code"] == 0 and "verifier_error" not in cheat.state
