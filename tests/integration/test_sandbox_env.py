"""SandboxEnv end to end: a scripted policy (a real ChatClient that replays tool calls) solves
a small task with the sandbox tools in real sandboxes (Docker, and bubblewrap)."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.rubric import Rubric
from agentrl.sampling import SamplingConfig
from agentrl.sandbox import SandboxConfig, SandboxPool, create_sandbox
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
    assert tool_outputs[6] == "Error: cannot read missing.py: no such file"
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


@pytest.mark.parametrize("backend", [pytest.param("docker", marks=needs_docker), "bwrap"])
async def test_file_tools_read_in_the_sandbox_only_what_they_show(backend):
    """read_file and str_replace pulled whole files onto the host before cutting what they show (a red team's 250 MB
    sparse file took 1 GB of host memory, and none of the command budget), and a FIFO or /dev/zero held the call
    until its timeout. They now read in the sandbox the lines asked for, within the output cap, charged to the
    budget; special files are refused; str_replace edits files up to max_edit_bytes. The bytes that reach the host
    are counted on the sandbox's own channel."""
    env = SandboxEnv(sandbox=SandboxConfig(type=backend, owner=f"test-env-{uuid.uuid4().hex[:8]}",
                                           max_output_bytes=64_000), max_edit_bytes=1_000_000)
    async with create_sandbox(env.sandbox_config) as sandbox:
        made = await sandbox.exec("yes 0123456789 | head -c 20000000 > big.txt && printf 'a\\nb\\nc' > small.txt "
                                  "&& mkfifo pipe && echo ok", timeout=60)
        assert made.stdout == "ok\n", made
        received = []
        real_exec = sandbox.exec_bytes

        async def counted(*args, **kwargs):
            raw = await real_exec(*args, **kwargs)
            received.append(len(raw.stdout) + len(raw.stderr))
            return raw

        sandbox.exec_bytes = counted
        state = {"command_seconds": 0.0}
        assert await env.read_file("small.txt", sandbox, state, start_line=2) == "     2\tb\n     3\tc"
        assert await env.read_file("small.txt", sandbox, state, start_line=5) == \
            "Error: small.txt has 3 lines; start_line=5 is past the end"
        big = await env.read_file("big.txt", sandbox, state, start_line=1000)
        assert big.startswith("  1000\t0123456789\n  1001\t0123456789") and big.endswith("ask for a later start_line]")
        for special in ("pipe", "/dev/zero"):
            assert await env.read_file(special, sandbox, state) == f"Error: cannot read {special}: not a regular file"
        assert await env.str_replace("big.txt", "0123", "x", sandbox, state) == (
            "Error: big.txt is larger than 1000000 bytes, the most str_replace edits (use bash, e.g. sed, for larger "
            "ones)")
        assert await env.str_replace("pipe", "a", "b", sandbox, state) == "Error: cannot edit pipe: not a regular file"
        assert (await env.str_replace("small.txt", "b", "B", sandbox, state)).startswith("replaced 1 occurrence")
        assert sum(received) < 2_200_000, received  # not the 20 MB file (str_replace's read: 1 MB + 1 at most)
        assert state["command_seconds"] > 0
