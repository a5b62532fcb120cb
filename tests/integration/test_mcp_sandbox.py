"""A stdio MCP server inside the agent's sandbox (Docker runc, gVisor, bubblewrap), its tools called by a policy.

`SandboxEnv(mcp_servers=[...])` starts tests/fixtures/mcp/notes_server.py in each rollout's sandbox through
agentrl's relay; a scripted policy calls its tools beside the env's own. Checked: the tools are offered to
the model with their schemas, calls and results are the rollout's tool calls and tool messages (its
record, as `rollouts.jsonl` and the viewer get it), the server keeps its state across calls, runs inside the
sandbox (it reads a file only the sandbox has), a tool error reaches the model as `Error: ...`, and a relay
the agent killed comes back at the next call (under bubblewrap the agent's commands cannot see it).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from sandbox_backends import BACKENDS, config

from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.sampling import SamplingConfig
from agentrl.sandbox_env import SandboxEnv
from agentrl.types import Task

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SERVER = Path(__file__).resolve().parents[1] / "fixtures" / "mcp" / "notes_server.py"


class NotesEnv(SandboxEnv):
    async def setup_sandbox(self, sandbox, task, state):
        await sandbox.write_file("/tmp/notes_server.py", SERVER.read_text())
        await sandbox.write_file("words.txt", "only the sandbox has these five words")


def _calls(*calls):
    return {"tool_calls": [tool_call(name, **arguments) for name, arguments in calls]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_stdio_server_in_the_sandbox(backend):
    env = NotesEnv(sandbox=config(backend), mcp_servers=[
        {"name": "notes", "command": "python3", "args": ["/tmp/notes_server.py"]}])
    seen_tools = []

    class Policy(ScriptedPolicy):
        async def chat(self, messages, *, tools=None, **kwargs):
            seen_tools.append([tool["function"]["name"] for tool in tools or []])
            return await super().chat(messages, tools=tools, **kwargs)

    policy = Policy([
        _calls(("add_note", {"text": "first"}), ("add_note", {"text": "second"})),
        _calls(("list_notes", {}), ("count_words", {"path": "words.txt"}), ("fail", {})),
        _calls(("bash", {"command": "pkill -f 'relay[.]py serve'; sleep 0.2; echo killed"})),
        _calls(("list_notes", {})),
        "done",
    ])
    task = Task(prompt=[{"role": "user", "content": "take notes"}])
    rollout = asyncio.run(env.rollout(policy, task, sampling=SamplingConfig()))
    assert rollout.error is None, rollout.error
    assert {"add_note", "list_notes", "count_words", "fail", "bash", "submit"} <= set(seen_tools[0])
    results = [message.content for message in rollout.messages if message.role == "tool"]
    assert results[:5] == ["noted (1)", "noted (2)", "first\nsecond", "7", "Error: this tool always fails"]
    assert "killed" in results[5]
    if backend["type"] == "bwrap":  # each command has its own pid namespace: the agent cannot see the relay
        assert results[6] == "first\nsecond"
    else:  # the relay came back at the next call, with a new session: the notes were the old server's
        assert results[6] == ""
    assert rollout.state["mcp_calls"] == 6 and rollout.state["mcp_tools"] == ["add_note", "count_words", "fail",
                                                                              "list_notes"]
    record = json.loads(json.dumps(rollout.record()))
    calls = [call["function"]["name"] for message in record["messages"] for call in message.get("tool_calls") or []]
    assert calls[:5] == ["add_note", "add_note", "list_notes", "count_words", "fail"]
    assert len(rollout.turns) == 5 and rollout.sample().token_ids  # the results are in the token stream


def test_a_server_that_cannot_start_is_one_line():
    from sandbox_backends import bwrap_ok

    if not bwrap_ok():
        pytest.skip("bubblewrap or base rootfs missing")
    env = NotesEnv(sandbox=config({"type": "bwrap"}), mcp_servers=[{"name": "gone", "command": "no-such-server"}])
    task = Task(prompt=[{"role": "user", "content": "x"}])
    rollout = asyncio.run(env.rollout(ScriptedPolicy(["done"]), task, sampling=SamplingConfig()))
    assert rollout.error is not None and "MCP server 'gone' did not start in the sandbox" in rollout.error
    assert "\n" not in rollout.error


def test_tool_names_that_clash_after_prefixing_are_refused_in_one_line():
    """Servers 'a' and 'b' both offer `add_note` (offered as `a_add_note` and `b_add_note`); server 'c' offers
    `a_add_note` itself. Without the check, c's tool took a's route: the model's call of a's tool reached c."""
    from sandbox_backends import bwrap_ok

    if not bwrap_ok():
        pytest.skip("bubblewrap or base rootfs missing")
    servers = [{"name": "a", "command": "python3", "args": ["/tmp/notes_server.py"]},
               {"name": "b", "command": "python3", "args": ["/tmp/notes_server.py"]},
               {"name": "c", "command": "python3", "args": ["/tmp/notes_server.py", "--tool-prefix", "a_"]}]
    env = NotesEnv(sandbox=config({"type": "bwrap"}), mcp_servers=servers)
    task = Task(prompt=[{"role": "user", "content": "x"}])
    rollout = asyncio.run(env.rollout(ScriptedPolicy(["done"]), task, sampling=SamplingConfig()))
    assert rollout.error is not None and "\n" not in rollout.error
    assert ("MCP tool name 'a_add_note' would be both server 'a''s tool 'add_note' and server 'c''s tool "
            "'a_add_note'") in rollout.error
    # the same servers without c: every tool has a route of its own
    env = NotesEnv(sandbox=config({"type": "bwrap"}), mcp_servers=servers[:2])
    rollout = asyncio.run(env.rollout(ScriptedPolicy([_calls(("a_add_note", {"text": "x"})), "done"]), task,
                                      sampling=SamplingConfig()))
    assert rollout.error is None, rollout.error
    assert "a_add_note" in rollout.state["mcp_tools"] and "b_add_note" in rollout.state["mcp_tools"]
    assert [message.content for message in rollout.messages if message.role == "tool"][0] == "noted (1)"
