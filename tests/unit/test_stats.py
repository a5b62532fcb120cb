"""Intervals of means and of differences (agentrl.stats): coverage on known distributions, determinism."""

from __future__ import annotations

import random

import pytest

from agentrl.stats import bootstrap_interval, paired_delta, window_delta


def test_the_interval_of_a_mean_covers_the_true_mean_about_as_often_as_it_says():
    rng = random.Random(0)
    covered = 0
    for trial in range(200):
        sample = [rng.gauss(0.5, 0.2) for _ in range(40)]
        low, high = bootstrap_interval(sample, seed=trial, resamples=500)
        covered += low <= 0.5 <= high
    assert 0.88 <= covered / 200 <= 0.99, covered  # a 95% interval (percentile bootstrap runs slightly narrow)


def test_a_real_rise_is_shown_and_noise_is_not():
    rng = random.Random(1)
    rising = [0.5 + 0.004 * step + rng.gauss(0, 0.02) for step in range(80)]
    up = window_delta(rising, 20)
    assert up.significant and up.low > 0 and up.delta == pytest.approx(0.004 * 60, abs=0.02)
    flat_runs = [[0.5 + rng.gauss(0, 0.02) for _ in range(80)] for _ in range(100)]
    false_alarms = sum(window_delta(run, 20, seed=index).significant for index, run in enumerate(flat_runs))
    assert false_alarms <= 12, false_alarms  # about 5 in 100 at a 95% interval
    assert window_delta(rising, 20) == up  # seeded: the same interval every time
    assert "95% CI" in up.text() and up.n == 20


def test_short_series_shrink_the_window_or_give_none():
    assert window_delta([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 20).n == 3
    assert window_delta([0.1, 0.2, 0.3], 20) is None
    assert window_delta([0.1, float("nan"), 0.2, 0.3, 0.4], 20).n == 2  # failed steps (NaN) left out


def test_paired_delta_uses_the_pairs():
    before = [0.1 * i for i in range(20)]
    after = [value + 0.05 for value in before]  # every task better by 0.05, a wide spread between tasks
    delta = paired_delta(before, after)
    assert delta.delta == pytest.approx(0.05) and delta.low == pytest.approx(0.05) == delta.high
    with pytest.raises(ValueError, match="the same items"):
        paired_delta([1.0], [1.0, 2.0])


def _summary(rewards_per_task: list[list[float]], model: str):
    from agentrl.evaluation.engine import EvalConfig
    from agentrl.evaluation.summary import summarize
    from agentrl.types import Message, Rollout, Task

    groups = [[Rollout(task=Task(prompt=[Message(role="user", content=str(index))], example_id=index), reward=reward)
               for reward in rewards] for index, rewards in enumerate(rewards_per_task)]
    config = EvalConfig(model=model, rollouts_per_task=len(rewards_per_task[0]))
    return summarize(groups, config=config, env_name="toy", elapsed_s=1.0, client="token", base_url="http://x")


def test_a_checkpoint_against_its_base_gets_paired_intervals_per_metric():
    from agentrl.evaluation.compare import Comparison, comparison_table

    base = _summary([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]] * 6, "base")
    ckpt = _summary([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]] * 6, "step_80")
    assert base.per_task["reward"][:3] == [0.25, 0.0, 0.75] and len(base.per_task["pass@4"]) == 18
    comparison = Comparison(checkpoint=ckpt, baseline=base)
    delta = comparison.task_delta("reward")
    assert delta.delta == pytest.approx(comparison.reward_delta) and delta.significant  # +1/3, no task worse
    assert comparison.task_delta("pass@1").delta == pytest.approx((0.5 + 0.25 + 0.25) / 3)
    other = _summary([[1.0] * 4] * 5, "other")  # a different task set: no paired interval
    assert Comparison(checkpoint=other, baseline=base).task_delta("reward") is None
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(comparison_table(comparison))
    text = console.export_text()
    assert "delta (checkpoint - baseline)" in text and "95% CI of the delta" in text and "+0.3333" in text


def test_a_paired_ratio_and_its_interval():
    import numpy as np

    from agentrl.stats import paired_ratio

    rng = np.random.default_rng(1)
    denominator = rng.uniform(1.0, 2.0, 40)
    ratio, low, high = paired_ratio(denominator * 10 + rng.normal(0, 0.5, 40), denominator)
    assert low < ratio < high and 9.0 < low and high < 11.0  # about 10x, and the interval says so
    noisy = paired_ratio(rng.uniform(0, 2, 6), rng.uniform(0, 2, 6))
    assert noisy[2] - noisy[1] > 0.3  # six noisy pairs: a wide interval
    with pytest.raises(ValueError, match="paired_ratio"):
        paired_ratio([1.0], [0.0])


def test_rollouts_the_grader_gave_no_reward_are_counted_apart_from_failures():
    """A Harbor task whose test.sh wrote `PASSED` to reward.txt scored every rollout 0 and `agentrl eval` said
    nothing (an ecosystem walk-through); the reason was only in results.jsonl's state."""
    from agentrl.evaluation.engine import EvalConfig
    from agentrl.evaluation.summary import summarize
    from agentrl.types import Message, Rollout, Task

    task = Task(prompt=[Message(role="user", content="p")])
    rollouts = [Rollout(task=task, grader_error="reward.txt: could not convert string to float: 'PASSED'"),
                Rollout(task=task, reward=1.0),
                Rollout(task=task, error="sandbox died", grader_error="no reward")]  # a failure, counted as one
    summary = summarize([rollouts], config=EvalConfig(rollouts_per_task=3), env_name="toy", elapsed_s=1.0,
                        client="token", base_url="http://x")
    assert (summary.errors, summary.grader_errors) == (1, 1)
    assert summary.first_grader_error == "reward.txt: could not convert string to float: 'PASSED'"
