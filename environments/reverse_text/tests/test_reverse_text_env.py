"""reverse-text through its real rollout loop with scripted (oracle and wrong) policies."""

from __future__ import annotations

import agentrl
from agentrl.hub.entrypoint import import_package_attr
from agentrl.policies import ScriptedPolicy
from agentrl.sampling import SamplingConfig

SAMPLING = SamplingConfig(max_tokens=64)


def _oracle_policy(env):
    return import_package_attr(env.path, "reverse_text:oracle_policy", package_name=env.name)()


def test_loads_by_name_with_deterministic_disjoint_splits():
    env = agentrl.load_environment("reverse-text", num_train=50, num_test=20)
    assert env.name == "reverse-text"
    train = env.get_dataset("train")
    test = env.get_dataset("test")
    assert (len(train), len(test)) == (50, 20)
    train_texts = {row["answer"] for row in train}
    assert not train_texts & {row["answer"] for row in test}
    assert all(len(row["answer"]) <= 24 and row["answer"] for row in train)
    again = agentrl.load_environment("reverse-text", num_train=50, num_test=20)
    assert list(again.get_dataset("train")["answer"]) == list(train["answer"])
    other = agentrl.load_environment("reverse-text", num_train=50, num_test=20, seed=7)
    assert list(other.get_dataset("train")["answer"]) != list(train["answer"])


def test_longer_texts_on_request():
    import pytest

    from agentrl.errors import AgentrlError

    env = agentrl.load_environment("reverse-text", num_train=50, num_test=10, max_words=12, max_chars=96)
    answers = list(env.get_dataset("train")["answer"])
    assert all(len(a) <= 96 for a in answers) and max(len(a) for a in answers) > 48
    assert max(a.count(" ") for a in answers) > 3  # more than the default 4 words
    long = agentrl.load_environment("reverse-text", num_train=20, num_test=5, min_words=10, max_words=12, max_chars=96)
    assert all(a.count(" ") >= 9 for a in long.get_dataset("train")["answer"])
    with pytest.raises(AgentrlError, match=r"max_chars=3: need 1 <= min_words <= max_words and max_chars >= 6 \* min_words - 1"):
        agentrl.load_environment("reverse-text", max_chars=3)
    with pytest.raises(AgentrlError, match="min_words=5, max_words=4"):
        agentrl.load_environment("reverse-text", min_words=5)


async def test_oracle_gets_reward_one():
    env = agentrl.load_environment("reverse-text", num_train=10, num_test=8)
    for task in env.tasks("test"):
        rollouts = await env.run_group(_oracle_policy(env), task, n=2, sampling=SAMPLING)
        for rollout in rollouts:
            assert rollout.error is None
            assert rollout.reward == 1.0
            assert rollout.metrics["exact_match"] == 1.0
            assert rollout.sample().loss_mask.count(True) == len(rollout.turns[0].completion.token_ids)


async def test_tagged_and_think_replies_are_parsed():
    env = agentrl.load_environment("reverse-text", num_train=10, num_test=4)
    task = env.tasks("test")[0]
    reply = f"<think>reverse it</think><answer>{task.answer}</answer>"
    (rollout,) = await env.run_group(ScriptedPolicy([reply]), task, n=1, sampling=SAMPLING)
    assert rollout.reward == 1.0


async def test_wrong_answers_score_below_one():
    env = agentrl.load_environment("reverse-text", num_train=10, num_test=4)
    task = env.tasks("test")[0]
    unreversed = (await env.run_group(ScriptedPolicy(lambda m, t: m[-1].content + "x"), task, n=1, sampling=SAMPLING))[0]
    half = (await env.run_group(ScriptedPolicy([task.answer[: len(task.answer) // 2]]), task, n=1, sampling=SAMPLING))[0]
    empty = (await env.run_group(ScriptedPolicy([""]), task, n=1, sampling=SAMPLING))[0]
    assert unreversed.reward < 1.0
    assert 0.0 < half.reward < 1.0
    assert empty.reward == 0.0
    assert unreversed.metrics["exact_match"] == 0.0
