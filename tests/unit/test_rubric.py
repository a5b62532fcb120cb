"""Rubric: weighted sums, metrics, async and group functions, argument selection, errors."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.errors import AgentrlError
from agentrl.parsers import XMLParser
from agentrl.rubric import Rubric, RubricGroup, group_reward
from agentrl.types import Message, Rollout, Task


def _rollout(reply: str, *, answer: str = "42", info: dict | None = None) -> Rollout:
    task = Task(prompt=[Message(role="user", content="q?")], answer=answer, info=info or {})
    return Rollout(
        task=task,
        messages=[*task.prompt, Message(role="assistant", content=reply)],
        state={"turns": 1},
    )


def exact(completion, answer) -> float:
    return float(completion[-1].content == answer)


def length_penalty(completion) -> float:
    return -len(completion[-1].content) / 10


async def async_bonus(answer, info) -> float:
    await asyncio.sleep(0)
    return info.get("bonus", 0.0)


async def test_weighted_sum_by_hand():
    rubric = Rubric(funcs=[exact, length_penalty, async_bonus], weights=[2.0, 0.5, 3.0])
    right, wrong = _rollout("42", info={"bonus": 0.25}), _rollout("seven")
    await rubric.score_group([right, wrong])
    # right: 2*1 + 0.5*(-0.2) + 3*0.25 = 2.65 ; wrong: 2*0 + 0.5*(-0.5) + 0 = -0.25
    assert right.reward == pytest.approx(2.65)
    assert wrong.reward == pytest.approx(-0.25)
    assert right.metrics == pytest.approx({"exact": 1.0, "length_penalty": -0.2, "async_bonus": 0.25})


async def test_zero_weight_functions_are_metrics_only():
    rubric = Rubric(funcs=[exact, length_penalty], weights=[1.0, 0.0])
    rollout = await rubric.score_rollout(_rollout("4"))
    assert rollout.reward == 0.0
    assert rollout.metrics["length_penalty"] == pytest.approx(-0.1)


async def test_default_weights_are_one_and_arguments_are_selected_by_name():
    seen = {}

    def everything(completion, answer, prompt, state, task, info, parser, rollout) -> float:
        seen.update(completion=completion, answer=answer, prompt=prompt, state=state, task=task,
                    info=info, parser=parser, rollout=rollout)
        return 0.5

    def kwargs_only(**kwargs) -> float:
        seen["kwargs"] = sorted(kwargs)
        return 0.25

    parser = XMLParser(fields=["answer"])
    rubric = Rubric(funcs=[everything, kwargs_only], parser=parser)
    rollout = await rubric.score_rollout(_rollout("x", info={"k": 1}))
    assert rollout.reward == pytest.approx(0.75)
    assert [m.role for m in seen["completion"]] == ["assistant"]
    assert [m.role for m in seen["prompt"]] == ["user"]
    assert seen["answer"] == "42" and seen["info"] == {"k": 1} and seen["state"] == {"turns": 1}
    assert seen["parser"] is parser and seen["rollout"] is rollout and seen["task"] is rollout.task
    assert seen["kwargs"] == ["answer", "completion", "info", "parser", "prompt", "rollout", "state", "task"]


async def test_group_function_sees_the_whole_group():
    calls = []

    def shortest_correct(completions, answers) -> list[float]:
        calls.append(len(completions))
        correct = [c[-1].content == a for c, a in zip(completions, answers)]
        lengths = [len(c[-1].content) if ok else 10**9 for c, ok in zip(completions, correct)]
        return [float(ok and length == min(lengths)) for ok, length in zip(correct, lengths)]

    @group_reward
    async def rank(rollouts) -> list[float]:
        return [index / 10 for index in range(len(rollouts))]

    rubric = Rubric(funcs=[shortest_correct, rank], weights=[1.0, 1.0])
    group = [_rollout("42"), _rollout(" 42"), _rollout("42")]
    group[1].task.answer = " 42"
    await rubric.score_group(group)
    assert calls == [3]
    assert [r.metrics["shortest_correct"] for r in group] == [1.0, 0.0, 1.0]
    assert [r.reward for r in group] == pytest.approx([1.0, 0.1, 1.2])


async def test_erroring_function_gives_zero_and_a_note():
    def broken(completion) -> float:
        raise RuntimeError("reward bug")

    def bad_group(completions) -> list[float]:
        return [1.0]  # wrong length for a group of two

    def not_a_number(completion) -> float:
        return float("nan")

    rubric = Rubric(funcs=[exact, broken, bad_group, not_a_number])
    group = [_rollout("42"), _rollout("no")]
    await rubric.score_group(group)
    assert [r.reward for r in group] == [1.0, 0.0]
    assert group[0].state["reward_errors"]["not_a_number"] == "ValueError: returned nan, not a finite number"
    for rollout in group:
        assert rollout.metrics["broken"] == 0.0 and rollout.metrics["broken_error"] == 1.0
        assert rollout.state["reward_errors"]["broken"] == "RuntimeError: reward bug"
        assert rollout.metrics["bad_group_error"] == 1.0
        assert "1 values for a group of 2" in rollout.state["reward_errors"]["bad_group"]


async def test_failed_rollout_gets_zero_reward():
    rollout = _rollout("42")
    rollout.error = "ConnectError: inference down"
    await Rubric(funcs=[exact]).score_rollout(rollout)
    assert rollout.reward == 0.0 and rollout.metrics["rollout_error"] == 1.0


async def test_rubric_group_adds_rewards_and_merges_metrics():
    group = RubricGroup([Rubric(funcs=[exact], weights=[2.0]), Rubric(funcs=[length_penalty], weights=[1.0])])
    rollout = await group.score_rollout(_rollout("42"))
    assert rollout.reward == pytest.approx(2.0 - 0.2)
    assert set(rollout.metrics) == {"exact", "length_penalty"}


def test_construction_errors_are_one_line():
    def needs_unknown(completion, gold) -> float:
        return 0.0

    with pytest.raises(AgentrlError, match="2 reward functions but 1 weights"):
        Rubric(funcs=[exact, length_penalty], weights=[1.0])
    with pytest.raises(AgentrlError, match=r"'needs_unknown' needs argument\(s\) gold"):
        Rubric(funcs=[needs_unknown])
    with pytest.raises(AgentrlError, match="repeated: exact"):
        Rubric(funcs=[exact, exact])
    with pytest.raises(AgentrlError, match="not callable"):
        Rubric(funcs=[3])


async def test_async_functions_score_a_group_concurrently():
    in_flight = {"now": 0, "max": 0}

    async def slow_judge(answer) -> float:
        in_flight["now"] += 1
        in_flight["max"] = max(in_flight["max"], in_flight["now"])
        await asyncio.sleep(0.01)
        in_flight["now"] -= 1
        return 1.0

    group = [_rollout("42") for _ in range(5)]
    await Rubric(funcs=[slow_judge]).score_group(group)
    assert in_flight["max"] == 5 and [r.reward for r in group] == [1.0] * 5
