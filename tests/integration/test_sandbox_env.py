"""SandboxEnv end to end: a scripted policy (a real ChatClient that replays tool calls) solves
a small task with the sandbox tools in real sandboxes (Docker, and bubblewrap)."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.rubric import Rubric
from agentrl.sampling import SamplingConfig
from agentrl.sandbox import SandboxConfig, SandboxPool
from agentrl.sandbox_env import SandboxEnv
from agentrl.types import Message, Task

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

needs_docker = pytest.mark.skipif(
    subprocess.run(["docker", "info"], capture_output=True).returncode != 0, reason="no Docker engine"
)


class FixTheBug(SandboxEnv):
    """The task's file has a bug; the reward checks the answer and runs the fixed program."""

    async def setup_sandbox(self, sandbox, task, state):
        await sandbox.write_file("calc.py", "def add(a, b):\n    return a - b\n\nprint(add(2, 3))\n")


def submitted_answer(completion, answer, state, **_):
    return 1.0 if state.get("submission") == answer else 0.0


def oracle_script() -> list:
    return [
        {"content": "", "tool_calls": [tool_call("bash", command="python3 calc.py")]},
        {"content": "", "tool_calls": [tool_call("read_file", path="calc.py", start_line=1, end_line=2)]},
        {"content": "", "tool_calls": [tool_call("str_replace", path="calc.py", old="a - b", new="a + b")]},
        {"content": "", "tool_calls": [
            tool_call("bash", command="python3 calc.py", timeout_s=5),
            tool_call("write_file", path="notes/done.txt", content="fixed"),
            tool_call("str_replace", path="calc.py", old="nope", new="x"),
            tool_call("read_file", path="missing.py"),
        ]},
        {"content": "", "tool_calls": [tool_call("submit", answer="5")]},
        "never reached",
    ]


def make_task() -> Task:
    return Task(prompt=[Message(role="user", content="calc.py prints the wrong sum; fix it and submit the output")],
                answer="5")


def check_rollout(rollout) -> None:
    assert rollout.error is None, rollout.error
    tool_outputs = [m.content for m in rollout.messages if m.role == "tool"]
    assert tool_outputs[0] == "exit code: 0\n-1"
    assert tool_outputs[1] == "     1\tdef add(a, b):\n     2\t    return a - b"
    assert tool_outputs[2].startswith("replaced 1 occurrence in calc.py at line 2")
    assert tool_outputs[3] == "exit code: 0\n5"
    assert tool_outputs[4] == "wrote 5 bytes to notes/done.txt"
    assert tool_outputs[5].startswith("Error: old text not found")
    assert tool_outputs[6].startswith("Error: read_file raised SandboxError: read_file /workspace/missing.py:")
    assert "No such file" in tool_outputs[6]
    assert tool_outputs[7] == "submitted"
    assert rollout.state["submitted"] and rollout.state["submission"] == "5"
    assert rollout.reward == 1.0
    assert rollout.state["stop_reason"] == "completed"


@pytest.mark.parametrize("backend", [pytest.param("docker", marks=needs_docker), "bwrap"])
async def test_sandbox_env_oracle_solves_task(backend):
    owner = f"test-env-{uuid.uuid4().hex[:8]}"
    env = FixTheBug(sandbox=SandboxConfig(type=backend, owner=owner), rubric=Rubric(funcs=[submitted_answer]))
    [rollout] = await env.run_group(ScriptedPolicy(oracle_script()), make_task(), n=1, sampling=SamplingConfig(max_tokens=4096))
    check_rollout(rollout)
    if backend == "docker":  # the rollout's sandbox is gone
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.owner={owner}"],
                              capture_output=True, text=True).stdout.split()
        assert left == []


@needs_docker
async def test_sandbox_env_budgets_and_pool():
    owner = f"test-env-{uuid.uuid4().hex[:8]}"
    async with SandboxPool(SandboxConfig(owner=owner), size=2) as pool:
        env = FixTheBug(pool=pool, max_command_timeout_s=1.5, max_total_command_s=2.5,
                        rubric=Rubric(funcs=[submitted_answer]))
        script = [
            {"content": "", "tool_calls": [tool_call("bash", command="sleep 30", timeout_s=100)]},
            {"content": "", "tool_calls": [tool_call("bash", command="sleep 30")]},
            {"content": "", "tool_calls": [tool_call("bash", command="echo hi")]},
            "I give up",
        ]
        rollouts = await env.run_group(ScriptedPolicy(script), make_task(), n=2, sampling=SamplingConfig(max_tokens=4096))
        for rollout in rollouts:
            outputs = [m.content for m in rollout.messages if m.role == "tool"]
            assert outputs[0].startswith("exit code: 137 (timed out)")  # capped at 1.5 s, not 100
            assert outputs[1].startswith("exit code: 137 (timed out)")  # the 1 s left of the budget
            assert outputs[2].startswith("Error: the command time budget")
            assert rollout.reward == 0.0 and not rollout.state["submitted"]
        assert rollouts[0].state["sandbox_id"] != rollouts[1].state["sandbox_id"]
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.owner={owner}"],
                          capture_output=True, text=True).stdout.split()
    assert left == []
