"""verifiers v1 features run with verifiers' semantics, or refused at load in one line (verifiers >= 0.4).

- `@vf.stop` / `@vf.intercept` hooks (tests/fixtures/verifiers/v1_hooks): on the prompt, the reply, tool
  results and proposed tool calls, and on the trace; the rewritten messages are the ones the model sees, a
  fired stop is the trace's stop condition;
- an exported Env's `finalize` (v1_env_finalize): it judges the scored trace and its reward counts;
- refused, one line naming the feature: a user simulator, a multi-agent Env, a codex harness, an Env
  whose `run` adds turns, a task without a prompt.

The reference is verifiers itself: the conversation verifiers' interception would commit, written out
with verifiers' own types, scored by `Task.score` (and the Env's own `finalize` on a verifiers Episode);
every reward and metric must be equal, and the values are asserted too, so hooks that did not run fail.
Runs in `.venv-verifiers/0.4.0` (tests/integration/test_verifiers_venvs.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

verifiers = pytest.importorskip(
    "verifiers", reason="verifiers is not installed (tests/integration/test_verifiers_venvs.py runs this in its venv)"
)
from packaging.version import Version

if Version(verifiers.__version__) < Version("0.4.0"):
    pytest.skip(f"verifiers {verifiers.__version__} is installed; these tests need verifiers>=0.4 (its v1 API)",
                allow_module_level=True)
import verifiers.v1 as vf
from sandbox_backends import bwrap_ok

import agentrl
from agentrl.errors import AgentrlError
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.sampling import SamplingConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verifiers"


def _reference(vf_task, messages, stop=None):
    """verifiers' own score of `messages` (verifiers types, one chain) for `vf_task`: (reward, scores)."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    trace = Trace(task=TraceTask(type=type(vf_task).__name__, data=vf_task.data), agent=AgentInfo(config=AgentConfig()))
    for index, message in enumerate(messages):
        trace.nodes.append(MessageNode(parent=index - 1 if index else None, message=message,
                                       sampled=isinstance(message, vf.AssistantMessage)))
    if stop is not None:
        trace.stop(stop)
    asyncio.run(vf_task.score(trace))
    return trace


def _refused(folder: Path, module: str, source: str, message: str) -> None:
    """A v1 package `module` (source `source`) written in `folder`, whose load is refused in one line matching."""
    folder.mkdir()
    (folder / "pyproject.toml").write_text(f'[project]\nname = "{module}"\ndependencies = ["verifiers>=0.4"]\n')
    (folder / f"{module}.py").write_text("import verifiers.v1 as vf\n\n\n" + source + "\n\n__all__ = ['T']\n")
    with pytest.raises(AgentrlError, match=message) as caught:
        agentrl.load_environment(folder)
    assert "\n" not in str(caught.value)


def _scores(trace):
    return trace.reward, {**{name: r.score for name, r in trace.rewards.items()}, **trace.metrics}


def _hook_tasks(**config):
    import vf_v1_hooks

    return list(vf_v1_hooks.HookTaskset(vf_v1_hooks.HookConfig(**config)))


HOOK_CASES = [  # (task, reply, what verifiers commits as the reply, stop, reward)
    (0, "APPLE", "apple", None, 1.0),  # the response interceptor lowercases a shouted answer
    (1, "I give up", "I give up", "gave_up", 0.0),  # the response stop fires after the reply is committed
    (2, "plum", "plum", None, 1.0),
]


@pytest.mark.parametrize(("index", "reply", "committed", "stop", "reward"), HOOK_CASES,
                         ids=[case[1] for case in HOOK_CASES])
def test_hooks_at_the_model_boundary(index, reply, committed, stop, reward):
    env = agentrl.load_environment(FIXTURES / "v1_hooks")
    task = env.tasks("test")[index]
    [rollout] = asyncio.run(env.run_group(ScriptedPolicy([reply]), task, n=1, sampling=SamplingConfig()))
    assert rollout.error is None
    assert rollout.messages[0].content.endswith("\nPlease be brief.")  # the model saw the rewritten prompt
    assert rollout.messages[-1].content == committed
    vf_task = _hook_tasks()[index]
    prompt = f"{vf_task.data.prompt}\nPlease be brief."
    trace = _reference(vf_task, [vf.UserMessage(content=prompt), vf.AssistantMessage(content=committed)], stop)
    expected_reward, expected = _scores(trace)
    assert rollout.reward == pytest.approx(expected_reward) == reward
    assert {name: rollout.metrics[name] for name in expected} == pytest.approx(expected)
    assert rollout.metrics["saw_polite_line"] == 1.0
    assert rollout.metrics["stopped_by_hook"] == float(stop is not None)


def _as_vf(messages):
    converted = []
    for message in messages:  # what agentrl's loop committed, as verifiers' types
        if message.role == "system":
            converted.append(vf.SystemMessage(content=message.content))
        elif message.role == "user":
            converted.append(vf.UserMessage(content=message.content))
        elif message.role == "tool":
            converted.append(vf.ToolMessage(tool_call_id=message.tool_call_id, content=message.content))
        else:
            converted.append(vf.AssistantMessage(content=message.content, tool_calls=[
                vf.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                for c in message.tool_calls or []] or None))
    return converted


def _bash_rollout(script):
    env = agentrl.load_environment(FIXTURES / "v1_hooks", with_tools=True, harness="bash", sandbox={"type": "bwrap"})
    task = env.tasks("test")[0]
    policy = ScriptedPolicy([{"tool_calls": [tool_call("bash", command=c)]} if i < len(script) - 1 else c
                             for i, c in enumerate(script)])
    [rollout] = asyncio.run(env.run_group(policy, task, n=1, sampling=SamplingConfig()))
    assert rollout.error is None, rollout.error
    return rollout


@pytest.mark.skipif(not bwrap_ok(), reason="bubblewrap cannot run here")
def test_hooks_on_tool_calls_and_results():
    """A denied call does not run and the model sees the hook's result; a tool result is rewritten before the
    model sees it."""
    rollout = _bash_rollout(["touch ran; cat /etc/shadow", "ls ran; echo SECRET-42", "found"])
    tools = [message.content for message in rollout.messages if message.role == "tool"]
    assert tools[0] == "denied"
    assert "No such file" in tools[1] and "[redacted]-42" in tools[1] and "SECRET" not in tools[1]
    assert rollout.state["stop_reason"] == "completed" and len(rollout.turns) == 3
    vf_task = _hook_tasks(with_tools=True)[0]
    expected_reward, expected = _scores(_reference(vf_task, _as_vf(rollout.messages), "agent_completed"))
    assert rollout.reward == pytest.approx(expected_reward) == 1.0
    assert {name: rollout.metrics[name] for name in expected} == pytest.approx(expected)
    assert rollout.metrics["saw_redacted"] == 1.0 and rollout.metrics["stopped_by_hook"] == 0.0


@pytest.mark.skipif(not bwrap_ok(), reason="bubblewrap cannot run here")
def test_trace_stop_ends_before_the_next_call():
    """As verifiers refuses the request, the tool result after the last reply never reaches the trace."""
    rollout = _bash_rollout(["echo a", "echo b", "echo c", "found"])
    assert rollout.state["stop_reason"] == "three_turns" and len(rollout.turns) == 3
    assert rollout.messages[-1].role == "assistant" and rollout.messages[-1].tool_calls
    vf_task = _hook_tasks(with_tools=True)[0]
    expected_reward, expected = _scores(_reference(vf_task, _as_vf(rollout.messages), "three_turns"))
    assert rollout.reward == pytest.approx(expected_reward) == 0.0
    assert {name: rollout.metrics[name] for name in expected} == pytest.approx(expected)
    assert rollout.metrics["stopped_by_hook"] == 1.0


@pytest.mark.skipif(not bwrap_ok(), reason="bubblewrap cannot run here")
def test_request_stop_ends_before_the_call_runs():
    env = agentrl.load_environment(FIXTURES / "v1_hooks", with_tools=True, harness="bash", sandbox={"type": "bwrap"})
    task = env.tasks("test")[0]
    policy = ScriptedPolicy([{"tool_calls": [tool_call("bash", command="rm -rf /tmp/x")]}, "found"])
    [rollout] = asyncio.run(env.run_group(policy, task, n=1, sampling=SamplingConfig()))
    assert rollout.error is None, rollout.error
    assert rollout.state["stop_reason"] == "no_rm" and len(rollout.turns) == 1
    assert not [message for message in rollout.messages if message.role == "tool"]  # never ran
    assert rollout.metrics["stopped_by_hook"] == 1.0 and rollout.reward == 0.0


@pytest.mark.parametrize("reply", ["one", "one, surely"])
def test_env_finalize_counts(reply):
    from verifiers.v1.episode import EnvInfo, Episode
    from verifiers.v1.trace import TraceTask

    env = agentrl.load_environment(FIXTURES / "v1_env_finalize")
    task = env.tasks("test")[0]
    [rollout] = asyncio.run(env.run_group(ScriptedPolicy([reply]), task, n=1, sampling=SamplingConfig()))
    import vf_v1_env_finalize as package

    vf_env = package.BonusEnv(vf.SingleAgentEnvConfig(taskset={"id": "vf_v1_env_finalize"}))
    vf_task = next(iter(vf_env.taskset))
    trace = _reference(vf_task, [vf.UserMessage(content=vf_task.data.prompt), vf.AssistantMessage(content=reply)])
    episode = Episode(env=EnvInfo(id="x"), task=TraceTask(type="EchoTask", data=vf_task.data), traces=[trace])
    asyncio.run(vf_env.finalize(vf_task, episode))
    expected_reward, expected = _scores(trace)
    assert rollout.reward == pytest.approx(expected_reward) == (1.5 if reply == "one" else 0.0)
    assert {name: rollout.metrics[name] for name in expected} == pytest.approx(expected)
    assert rollout.metrics["episode_traces"] == 1.0


@pytest.mark.parametrize(("package", "message"), [
    ("v1_user_sim", r"its Env AskEnv has a user simulator \(seats: assistant, user\), which agentrl does not run"),
    ("v1_multi_agent", r"its Env PairEnv is a multi-agent Env \(seats: solver, critic\)"),
    ("v1_codex_harness", r"its Env CodexEnv runs the harness 'codex' \(a third-party agent program\)"),
    ("v1_extra_turns", r"its Env CheckEnv overrides run\(\) \(its own turns or interactions\)"),
])
def test_refused_features_are_one_line(package, message):
    with pytest.raises(AgentrlError, match=message) as caught:
        agentrl.load_environment(FIXTURES / package)
    assert "\n" not in str(caught.value)


def test_task_without_a_prompt_is_refused(tmp_path):
    _refused(tmp_path / "noprompt", "vf_noprompt",
             "class T(vf.Taskset[vf.Task, vf.TasksetConfig]):\n    def load(self):\n"
             "        return [vf.Task(vf.TaskData(prompt=None), self.config.task)]\n",
             r"task 0 has no prompt .* start from an empty conversation")


def test_mcp_toolsets_are_offered_and_called():
    """The taskset's toolset (shared) and the task's (a fresh instance per rollout) as MCP servers in-process:
    their tools are offered, called through the mcp client, results reach the model and verifiers' scoring."""
    env = agentrl.load_environment(FIXTURES / "v1_toolset")
    task = env.tasks("test")[0]
    seen = []

    class Policy(ScriptedPolicy):
        async def chat(self, messages, *, tools=None, **kwargs):
            seen.append(sorted(tool["function"]["name"] for tool in tools or []))
            return await super().chat(messages, tools=tools, **kwargs)

    policy = Policy([{"tool_calls": [tool_call("capital", country="France"), tool_call("tick")]},
                     {"tool_calls": [tool_call("tick")]}, "Paris"])
    group = asyncio.run(env.run_group(policy, task, n=2, sampling=SamplingConfig()))
    import vf_v1_toolset

    vf_task = next(iter(vf_v1_toolset.AtlasTaskset(vf.TasksetConfig())))
    assert seen[0] == ["capital", "tick"]
    for rollout in group:
        assert rollout.error is None, rollout.error
        assert [m.content for m in rollout.messages if m.role == "tool"] == ["Paris", "count 1", "count 2"]
        expected_reward, expected = _scores(_reference(vf_task, _as_vf(rollout.messages)))
        assert rollout.reward == pytest.approx(expected_reward) == 1.0
        assert {name: rollout.metrics[name] for name in expected} == pytest.approx(expected)
        assert rollout.state["mcp_calls"] == 3


@pytest.mark.parametrize(("config", "message"), [
    ('url="https://tools.example.com/mcp"', (r"MCP toolset Remote is a remote server at "
                                             r"'https://tools.example.com/mcp'; it would need the internet")),
    ("colocated=True", r"MCP toolset Remote is colocated \(verifiers installs the package in the task's box"),
])
def test_toolsets_agentrl_cannot_serve_are_refused(tmp_path, config, message):
    _refused(tmp_path / "pkg", "vf_remote_tools_" + config.split("=")[0],  # one module name per process
             "class Remote(vf.Toolset[vf.ToolsetConfig]):\n    pass\n\n\n"
             "class T(vf.Taskset[vf.Task, vf.TasksetConfig]):\n    @classmethod\n    def toolsets(cls, config):\n"
             f"        return [Remote(vf.ToolsetConfig({config}))]\n\n    def load(self):\n"
             "        return [vf.Task(vf.TaskData(prompt='x'), self.config.task)]\n", message)


def test_a_judge_on_the_internet_is_refused(tmp_path):
    _refused(tmp_path / "judged", "vf_judged",
             "class T(vf.Taskset[vf.Task, vf.TasksetConfig]):\n    def load(self):\n"
             "        config = self.config.task.model_copy(update={'judges': [vf.JudgeConfig(name='grader')]})\n"
             "        return [vf.Task(vf.TaskData(prompt='x'), config)]\n",
             r"plug the judge 'grader' \(model .* at https://.*\), which agentrl's scoring cannot reach \(no network\)")
