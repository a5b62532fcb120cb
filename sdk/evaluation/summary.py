"""What an evaluation comes to: `EvalSummary`, pass@k and the aggregation of scored groups.

`summarize` turns the scored groups of `agentrl.evaluate` (one group per task, k rollouts each)
into an `EvalSummary`: mean and spread of the reward, avg@k, pass@k for k = 1, 2, 4, ... up to
the rollouts per task (the unbiased estimator of Chen et al. 2021: a rollout passes when its
reward reaches the config's `pass_threshold`), the mean of every rubric metric, errors,
truncations, token counts and throughput. It is what `summary.json` holds.
"""

from __future__ import annotations

import math
import platform
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from agentrl.types import Rollout

if TYPE_CHECKING:
    from agentrl.evaluation.engine import EvalConfig

__all__ = ["EvalSummary", "pass_at_k", "summarize"]


class EvalSummary(BaseModel):
    """The outcome of one evaluation."""

    env: str
    """Environment name."""
    model: str
    """Model evaluated."""
    split: str
    """Split the tasks came from."""
    num_tasks: int
    """Tasks evaluated."""
    rollouts_per_task: int
    """Rollouts per task (k)."""
    num_rollouts: int
    """Rollouts run."""
    mean_reward: float
    """Mean reward over all rollouts."""
    std_reward: float
    """Standard deviation of the reward over all rollouts."""
    avg_at_k: float
    """Mean over tasks of the mean reward of the task's k rollouts."""
    pass_at_k: dict[str, float]
    """pass@k for k = 1, 2, 4, ... up to rollouts_per_task (unbiased estimator)."""
    metrics: dict[str, float]
    """Mean of every rubric metric."""
    errors: int
    """Rollouts that ended with an error."""
    truncated: int
    """Rollouts cut by a budget (tokens, turns, time)."""
    prompt_tokens: int
    """Prompt tokens of all model calls."""
    completion_tokens: int
    """Generated tokens of all model calls."""
    elapsed_s: float
    """Wall time of the rollouts (server start-up excluded)."""
    completion_tokens_per_s: float
    """Generated tokens per second of wall time."""
    server_startup_s: float | None = None
    """Start-up time of the server started for the run (None with --base-url)."""
    client: str
    """Client used: token or openai."""
    base_url: str
    """Server the rollouts ran against."""
    output_dir: str | None = None
    """Folder with results.jsonl and summary.json."""
    sampling: dict[str, Any]
    """Sampling settings."""
    machine: str = Field(default_factory=lambda: f"{platform.node()} {platform.machine()}")
    """Machine the evaluation ran on."""
    first_error: str | None = None
    """The first rollout error, to show what went wrong."""
    grader_errors: int = 0
    """Rollouts the grader gave no reward of its own (`Rollout.grader_error`)."""
    first_grader_error: str | None = None
    """The first of those reasons."""
    per_task: dict[str, list[float]] = {}
    """Per task in task order: its mean reward ("reward") and its pass@k ("pass@1", ...), for paired
    comparisons of two evaluations of the same tasks (`agentrl.stats.paired_delta`)."""


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k: 1 - C(n - c, k) / C(n, k)."""
    if k > num_samples:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def _k_values(rollouts_per_task: int) -> list[int]:
    values = [1]
    while values[-1] * 2 <= rollouts_per_task:
        values.append(values[-1] * 2)
    if values[-1] != rollouts_per_task:
        values.append(rollouts_per_task)
    return values


def summarize(
    groups: list[list[Rollout]], *, config: EvalConfig, env_name: str, elapsed_s: float, client: str,
    base_url: str,
) -> EvalSummary:
    """Aggregate scored groups into an EvalSummary."""
    rollouts = [r for group in groups for r in group]
    rewards = [r.reward for r in rollouts]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)) if rewards else 0.0
    per_task = [sum(r.reward for r in g) / len(g) for g in groups if g]
    passes: dict[str, float] = {}
    per_task_passes: dict[str, list[float]] = {}
    for k in _k_values(config.rollouts_per_task):
        scores = [
            pass_at_k(len(g), sum(r.reward >= config.pass_threshold for r in g), k) for g in groups if len(g) >= k
        ]
        passes[str(k)] = sum(scores) / len(scores) if scores else 0.0
        if len(scores) == len(per_task):
            per_task_passes[f"pass@{k}"] = scores
    metric_names = sorted({name for r in rollouts for name in r.metrics})
    metrics = {
        name: sum(r.metrics.get(name, 0.0) for r in rollouts) / len(rollouts) for name in metric_names
    } if rollouts else {}
    prompt_tokens = sum(len(t.prompt_token_ids) for r in rollouts for t in r.turns)
    completion_tokens = sum(
        max(len(t.completion.token_ids), len(t.completion.logprobs)) for r in rollouts for t in r.turns
    )
    errors = [r.error for r in rollouts if r.error]
    grader_errors = [r.grader_error for r in rollouts if r.grader_error and not r.error]
    return EvalSummary(
        env=env_name, model=config.model, split=config.split, num_tasks=len(groups),
        rollouts_per_task=config.rollouts_per_task, num_rollouts=len(rollouts), mean_reward=mean,
        std_reward=std, avg_at_k=sum(per_task) / len(per_task) if per_task else 0.0, pass_at_k=passes,
        metrics=metrics, errors=len(errors), truncated=sum(r.truncated for r in rollouts),
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, elapsed_s=elapsed_s,
        completion_tokens_per_s=completion_tokens / elapsed_s if elapsed_s > 0 else 0.0,
        client=client, base_url=base_url, sampling=config.sampling.model_dump(mode="json"),
        first_error=errors[0] if errors else None, grader_errors=len(grader_errors),
        first_grader_error=grader_errors[0] if grader_errors else None,
        per_task={"reward": per_task, **per_task_passes},
    )
