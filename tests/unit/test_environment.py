"""Environments through their real rollout loop, driven by ScriptedPolicy.

Covers single-turn, multi-turn budgets (turns, tokens, wall-clock), the tool loop with bad
calls, error capture, group scoring, and token extension across turns via Rollout.sample().
"""

from __future__ import annotations

import asyncio

import pytest

from agentrl.environment import MultiTurnEnv, SingleTurnEnv
from agentrl.errors import AgentrlError, NotFoundError
from agentrl.policies import ScriptedPolicy, render_tokens, tool_call
from agentrl.rubric import Rubric
from agentrl.sampling import SamplingConfig
from agentrl.tool_env import ToolEnv
from agentrl.types import Message, Rollout, Task

SAMPLING = SamplingConfig(max_tokens=64)
ROWS = [{"prompt": f"say {word}", "answer": word, "info": {"n": i}} for i, word in enumerate(["red", "green", "blue", "gold"])]


def said_answer(completion, answer) -> float:
    return float(completion[-1].content.strip() == answer)


class RecordingPolicy(ScriptedPolicy):
    """A ScriptedPolicy that also records the sampling settings and tools of each call."""

    def __init__(self, script):
        super().__init__(script)
        self.samplings: list[SamplingConfig] = []
        self.tools_seen: list = []

    async def chat(self, messages, *, tools=None, sampling, previous=None):
        self.samplings.append(sampling)
        self.tools_seen.append(tools)
        return await super().chat(messages, tools=tools, sampling=sampling, previous=previous)


def _single_env(**kwargs) -> SingleTurnEnv:
    return SingleTurnEnv(name="say", dataset=ROWS, eval_dataset=ROWS[:2], rubric=Rubric(funcs=[said_answer]), **kwargs)


# ----- datasets and tasks -----------------------------------------------------------------------
def test_datasets_and_tasks():
    env = _single_env(system_prompt="Be brief.")
    data = env.get_dataset("train")
    assert data.column_names[:3] == ["prompt", "answer", "info"] and len(data) == 4
    assert data[0]["info"] == '{"n": 0}'  # verifiers convention: info as a JSON string
    assert len(env.get_dataset("eval")) == 2  # alias of test
    tasks = env.tasks("train")
    assert [t.answer for t in tasks] == ["red", "green", "blue", "gold"]
    assert tasks[1].info == {"n": 1} and tasks[1].example_id == 1
    assert [m.role for m in tasks[0].prompt] == ["system", "user"]
    assert tasks[0].prompt[0].content == "Be brief."
    picked = [t.answer for t in env.tasks("train", n=2, seed=3)]
    assert picked == [t.answer for t in env.tasks("train", n=2, seed=3)] and len(picked) == 2
    assert len({tuple(t.answer for t in env.tasks("train", n=2, seed=s)) for s in range(10)}) > 1


@pytest.mark.parametrize(
    ("row", "fragment"),
    [({"answer": "x"}, "KeyError: 'prompt'"), ({"prompt": [{"role": "robot", "content": "x"}]}, "role"),
     ({"prompt": "p", "info": "{not json"}, "JSONDecodeError")],
)
def test_bad_rows_are_one_line_errors(row, fragment):
    env = SingleTurnEnv(name="bad", dataset=[{"prompt": "fine"}])
    with pytest.raises(AgentrlError) as info:
        env.make_task(row, index=3)
    message = str(info.value)
    assert message.startswith("environment 'bad': bad task row 3: ") and fragment in message and "\n" not in message


def test_unknown_split_lists_available():
    with pytest.raises(NotFoundError, match=r"no 'dev' split; available splits: test, train"):
        _single_env().get_dataset("dev")


# ----- single turn --------------------------------------------------------------------------------
async def test_single_turn_group_scored_with_distinct_seeds():
    env = _single_env()
    task = env.tasks("train")[0]
    policy = RecordingPolicy(lambda messages, tools: "red" if policy.calls % 2 else "blue")
    rollouts = await env.run_group(policy, task, n=4, sampling=SamplingConfig(max_tokens=8, seed=10))
    assert sorted(r.reward for r in rollouts) == [0.0, 0.0, 1.0, 1.0]
    assert sorted(s.seed for s in policy.samplings) == [10, 11, 12, 13]
    assert policy.tools_seen == [None] * 4
    for rollout in rollouts:
        assert rollout.error is None and not rollout.truncated and rollout.state["stop_reason"] == "completed"
        assert [m.role for m in rollout.messages] == ["user", "assistant"]
        assert rollout.metrics["said_answer"] == rollout.reward


async def test_single_turn_cut_at_max_tokens_is_truncated():
    env = _single_env()
    (rollout,) = await env.run_group(ScriptedPolicy(["a much longer answer"]), env.tasks("train")[0], n=1,
                                     sampling=SamplingConfig(max_tokens=4))
    assert rollout.truncated and rollout.state["stop_reason"] == "length"
    assert rollout.completion_tokens == 4 and rollout.messages[-1].content == "a mu"


# ----- multi turn -----------------------------------------------------------------------------------
class GuessEnv(MultiTurnEnv):
    """Guess a number; the environment says higher or lower."""

    def __init__(self, *, delay_s: float = 0.0, **kwargs):
        super().__init__(dataset=[{"prompt": "guess 1-9", "answer": "7"}], **kwargs)
        self.delay_s = delay_s
        self.cleaned: list[dict] = []

    def setup_state(self, task):
        return {"target": int(task.answer), "guesses": 0}

    async def is_completed(self, messages, state):
        return messages[-1].content.strip() == str(state["target"])

    async def env_response(self, messages, state):
        await asyncio.sleep(self.delay_s)
        state["guesses"] += 1
        guess = int(messages[-1].content)
        return [Message(role="user", content="higher" if guess < state["target"] else "lower")]

    def cleanup_state(self, state):
        self.cleaned.append(state)


async def _guess(env: MultiTurnEnv, script, sampling=SAMPLING) -> Rollout:
    return await env.rollout(ScriptedPolicy(script), env.tasks("train")[0], sampling=sampling)


async def test_multi_turn_completes_and_tokens_extend_across_turns():
    env = GuessEnv(max_turns=5)
    rollout = await _guess(env, ["3", "9", "7"])
    assert rollout.error is None and not rollout.truncated
    assert [m.content for m in rollout.messages[1:]] == ["3", "higher", "9", "lower", "7"]
    assert rollout.state["guesses"] == 2 and env.cleaned == [rollout.state]
    for before, after in zip(rollout.turns, rollout.turns[1:]):
        previous = before.prompt_token_ids + before.completion.token_ids
        assert after.prompt_token_ids[: len(previous)] == previous
    sample = rollout.sample()
    last = rollout.turns[-1]
    assert sample.token_ids == last.prompt_token_ids + last.completion.token_ids
    generated = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
    assert generated == [t for turn in rollout.turns for t in turn.completion.token_ids]
    assert sample.token_ids[: len(render_tokens(rollout.messages[:1]))] == render_tokens(rollout.messages[:1])


async def test_non_extending_history_is_detected_by_sample():
    class RewritingEnv(GuessEnv):
        async def env_response(self, messages, state):
            messages[-1].content = messages[-1].content + " (edited)"  # rewrites history: breaks extension
            return [Message(role="user", content="higher")]

    rollout = await _guess(RewritingEnv(max_turns=3), ["3", "7"])
    assert rollout.error is None
    with pytest.raises(ValueError, match="turn 1: prompt does not extend"):
        rollout.sample()


async def test_max_turns_budget():
    env = GuessEnv(max_turns=2)
    rollout = await _guess(env, ["1", "2", "7"])
    assert rollout.truncated and rollout.state["stop_reason"] == "max_turns"
    assert len(rollout.turns) == 2 and rollout.messages[-1].role == "assistant"
    assert env.cleaned  # cleaned up on truncation too


async def test_total_completion_token_budget():
    env = GuessEnv(max_turns=10, max_completion_tokens=5)
    policy = RecordingPolicy(["1", "2", "3", "7"])
    rollout = await env.rollout(policy, env.tasks("train")[0], sampling=SAMPLING)
    # each reply costs 2 tokens (digit + end marker); max_tokens shrinks to what is left: 5, 3, 1
    assert [s.max_tokens for s in policy.samplings] == [5, 3, 1]
    assert rollout.truncated and rollout.completion_tokens == 5
    assert rollout.state["stop_reason"] == "length"


async def test_cut_completion_continues_without_stop_on_length():
    env = GuessEnv(max_turns=3, stop_on_length=False)
    rollout = await _guess(env, ["123", "456", "7"], sampling=SamplingConfig(max_tokens=2))
    assert [t.completion.finish_reason for t in rollout.turns] == ["length", "length", "stop"]
    assert [m.content for m in rollout.messages if m.role == "assistant"] == ["12", "45", "7"]
    assert not rollout.truncated and rollout.state["stop_reason"] == "completed"


async def test_wall_clock_budget():
    env = GuessEnv(max_turns=50, max_seconds=0.3, delay_s=0.2)
    rollout = await _guess(env, lambda messages, tools: "1")
    assert rollout.truncated and rollout.state["stop_reason"] == "max_seconds"
    assert 0.25 < rollout.elapsed_s < 2.0 and len(rollout.turns) <= 2
    assert env.cleaned


async def test_failures_end_up_on_the_rollout_not_raised():
    env = GuessEnv(max_turns=5)
    out_of_script = await _guess(env, ["1"])
    assert out_of_script.error.startswith("AgentrlError: ScriptedPolicy 'scripted': the script has 1 replies")
    not_a_number = await _guess(env, ["seven"])
    assert not_a_number.error.startswith("ValueError: invalid literal for int()")
    assert len(env.cleaned) == 2
    scored = await env.score([not_a_number])
    assert scored[0].reward == 0.0 and scored[0].metrics["rollout_error"] == 1.0


def test_budget_validation():
    with pytest.raises(AgentrlError, match="max_turns must be >= 1"):
        GuessEnv(max_turns=0)


# ----- tools --------------------------------------------------------------------------------------
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


async def shout(text: str) -> str:
    """Upper-case a text."""
    await asyncio.sleep(0)
    return text.upper() * 50


def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(reason)


def _tool_env(**kwargs) -> ToolEnv:
    return ToolEnv(
        dataset=[{"prompt": "add 2 and 3", "answer": "5"}], tools=[add, shout, explode],
        rubric=Rubric(funcs=[said_answer]), max_tool_output_chars=20, **kwargs,
    )


async def test_tool_loop_runs_tools_and_reports_bad_calls():
    env = _tool_env(max_turns=4)
    script = [
        {"tool_calls": [tool_call("add", a=2, b="3"), tool_call("shout", text="hi")]},
        {"content": "oops", "tool_calls": [tool_call("multiply", a=1), tool_call("add", a=1),
                                           tool_call("explode", reason="boom")]},
        "5",
    ]
    policy = RecordingPolicy(script)
    sampling = SamplingConfig(max_tokens=512)  # rendered tool calls are long in byte tokens
    (rollout,) = await env.run_group(policy, env.tasks("train")[0], n=1, sampling=sampling)
    assert rollout.error is None and not rollout.truncated and rollout.reward == 1.0
    names = {tool["function"]["name"] for tool in policy.tools_seen[0]}
    assert names == {"add", "shout", "explode"}
    tool_messages = [m for m in rollout.messages if m.role == "tool"]
    assert [m.name for m in tool_messages] == ["add", "shout", "multiply", "add", "explode"]
    assert tool_messages[0].content == "5"  # "3" coerced to 3
    assert tool_messages[1].content == "HI" * 10 + "\n... [80 characters cut]"
    assert tool_messages[2].content == "Error: unknown tool 'multiply'; available tools: add, explode, shout"
    assert tool_messages[3].content == "Error: add: bad arguments: b: Field required"
    assert tool_messages[4].content == "Error: explode raised RuntimeError: boom"
    calls = [c for m in rollout.messages if m.tool_calls for c in m.tool_calls]
    assert [m.tool_call_id for m in tool_messages] == [c.id for c in calls]
    assert rollout.state["tool_calls"] == 5 and rollout.state["tool_errors"] == 1
    sample = rollout.sample()  # tool results are prompt tokens between the turns
    assert len(rollout.turns) == 3 and sum(sample.loss_mask) == rollout.completion_tokens


async def test_tool_loop_stops_at_max_turns():
    env = _tool_env(max_turns=2)
    rollout = await env.rollout(ScriptedPolicy(lambda m, t: {"tool_calls": [tool_call("add", a=1, b=1)]}),
                                env.tasks("train")[0], sampling=SamplingConfig(max_tokens=512))
    assert rollout.truncated and len(rollout.turns) == 2 and rollout.state["stop_reason"] == "max_turns"


def test_duplicate_tool_names_are_rejected():
    with pytest.raises(AgentrlError, match="two tools are named 'add'"):
        ToolEnv(tools=[add, add])


async def test_rollout_keeps_the_task_prompt_untouched():
    env = _single_env()
    task = env.tasks("train")[0]
    rollout = await env.rollout(ScriptedPolicy(["red"]), task, sampling=SAMPLING)
    assert len(task.prompt) == 1 and rollout.task is task
    assert isinstance(rollout.task, Task)


async def test_hidden_tool_arguments_and_ordered_calls():
    from agentrl.tools import Tool

    def remember(key: str, value: str, state) -> str:
        """Store a value."""
        state.setdefault("memory", {})[key] = value
        return "ok"

    def recall(key: str, store: dict) -> str:
        """Read a value back."""
        return store.get("memory", {}).get(key, "missing")

    class MemoryEnv(ToolEnv):
        def hidden_tool_args(self, tool, state):
            return {"state": state, "store": state}

    env = MemoryEnv(dataset=[{"prompt": "p", "answer": "v"}], tools=[remember, Tool(recall, hidden=("store",))])
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in env.tool_schemas}
    assert sorted(schemas["remember"]["properties"]) == ["key", "value"]
    assert sorted(schemas["recall"]["properties"]) == ["key"]
    script = [{"tool_calls": [tool_call("remember", key="k", value="v"), tool_call("recall", key="k")]}, "v"]
    rollout = await env.rollout(ScriptedPolicy(script), env.tasks("train")[0], sampling=SamplingConfig(max_tokens=512))
    assert rollout.error is None
    assert [m.content for m in rollout.messages if m.role == "tool"] == ["ok", "v"]  # run in order
    assert rollout.state["memory"] == {"k": "v"}

    class ForgetfulEnv(ToolEnv):
        def hidden_tool_args(self, tool, state):
            return {}

    broken = ForgetfulEnv(dataset=[{"prompt": "p", "answer": "v"}], tools=[Tool(recall, hidden=("store",))])
    rollout = await broken.rollout(ScriptedPolicy([{"tool_calls": [tool_call("recall", key="k")]}, "x"]),
                                   broken.tasks("train")[0], sampling=SamplingConfig(max_tokens=512))
    assert rollout.error == "AgentrlError: ForgetfulEnv.hidden_tool_args gave no store for tool 'recall'"
    with pytest.raises(AgentrlError, match="hidden argument\\(s\\) sandbox are not parameters"):
        Tool(recall, hidden=("sandbox",))


def test_sdk_environment_modules_import_light():
    import subprocess
    import sys

    code = (
        "import agentrl.environment, agentrl.tool_env, agentrl.rubric, agentrl.parsers, agentrl.tools, "
        "agentrl.hub.loader, agentrl.policies, sys\n"
        "print(','.join(m for m in ('torch', 'vllm', 'ray', 'transformers', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
