"""arithmetic through its real tool loop with scripted (oracle and wrong) policies."""

from __future__ import annotations

import pytest

import agentrl
from agentrl.hub.entrypoint import import_package_attr
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.sampling import SamplingConfig

SAMPLING = SamplingConfig(max_tokens=128)


def _oracle_policy(env):
    return import_package_attr(env.path, "arithmetic:oracle_policy", package_name=env.name)()


@pytest.fixture(scope="module")
def env():
    return agentrl.load_environment("arithmetic", num_train=20, num_test=6)


def test_splits_are_deterministic_and_disjoint(env):
    test = env.get_dataset("test")
    train = env.get_dataset("train")
    train_prompts = {row["prompt"][-1]["content"] for row in train}
    assert not train_prompts & {row["prompt"][-1]["content"] for row in test}
    again = agentrl.load_environment("arithmetic", num_train=20, num_test=6)
    assert list(again.get_dataset("test")["answer"]) == list(test["answer"])


async def test_oracle_with_calculator_gets_reward_one(env):
    for task in env.tasks("test"):
        (rollout,) = await env.run_group(_oracle_policy(env), task, n=1, sampling=SAMPLING)
        assert rollout.error is None and not rollout.truncated
        assert [m.role for m in rollout.messages[-3:]] == ["assistant", "tool", "assistant"]
        assert rollout.messages[-2].content == task.answer
        assert rollout.reward == 1.0
        assert rollout.metrics["tool_calls"] == 1.0
        assert rollout.metrics["used_answer_tags"] == 1.0
        sample = rollout.sample()  # the tool result is part of the prompt tokens, not trained on
        assert sample.loss_mask.count(True) == sum(len(t.completion.token_ids) for t in rollout.turns)


async def test_wrong_or_missing_answers_get_zero(env):
    task = env.tasks("test")[0]
    wrong = str(int(task.answer) + 1)
    cases = [[f"<answer>{wrong}</answer>"], [f"I think it is {wrong}"], ["no idea"]]
    for script in cases:
        (rollout,) = await env.run_group(ScriptedPolicy(script), task, n=1, sampling=SAMPLING)
        assert rollout.reward == 0.0, script
    (untagged,) = await env.run_group(ScriptedPolicy([f"it is {task.answer}"]), task, n=1, sampling=SAMPLING)
    assert untagged.reward == 1.0 and untagged.metrics["used_answer_tags"] == 0.0


async def test_calculator_errors_reach_the_model_and_loop_stops_at_max_turns(env):
    task = env.tasks("test")[0]
    policy = ScriptedPolicy(lambda messages, tools: {"tool_calls": [tool_call("calculator", expression="__import__('os')")]})
    (rollout,) = await env.run_group(policy, task, n=1, sampling=SAMPLING)
    assert rollout.truncated and rollout.state["stop_reason"] == "max_turns"
    assert len(rollout.turns) == env.max_turns
    tool_messages = [m for m in rollout.messages if m.role == "tool"]
    assert tool_messages and all(m.content.startswith("Error: unsupported syntax") for m in tool_messages)
    assert rollout.reward == 0.0


@pytest.mark.parametrize(
    ("expression", "expected"),
    [("(3 + 4) * 12", "84"), ("7 / 2", "3.5"), ("2 ** 10", "1024"), ("-5 + 2", "-3"), ("17 // 5 % 2", "1")],
)
def test_calculator_evaluates(env, expression, expected):
    calculator = env.tools["calculator"].func
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "error"),
    [("1 / 0", "division by zero"), ("2 ** 1000", "exponent"), ("abs(-1)", "unsupported syntax"),
     ("x + 1", "unsupported syntax"), ("1 +", "cannot parse"), ("9" * 300, "longer than")],
)
def test_calculator_refuses(env, expression, error):
    calculator = env.tools["calculator"].func
    result = calculator(expression)
    assert result.startswith("Error:") and error in result
