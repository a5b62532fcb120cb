"""Held-out evaluation during training (`[eval]`): the policy on tasks it never trains on, while the loop runs.

Every `eval.every` steps (and once at the end) the orchestrator starts an evaluation of the
policy as inference serves it right after that step's weight push: `eval.tasks` tasks of the
environment's held-out split (`eval.split`), `eval.rollouts_per_task` rollouts each, through the
same servers and rollout workers as training, beside the training rollouts (the loop does not
stop). When it completes, the next step's metrics carry

    eval/step            the step whose weights were pushed when it started
    eval/mean_reward     mean reward over all its rollouts, with eval/mean_reward_low / _high
                         (95% bootstrap interval over tasks)
    eval/avg@k           mean over tasks of each task's mean reward
    eval/pass@1, pass@k  unbiased pass@k (a rollout passes when its reward reaches `eval.pass_threshold`)
    eval/errors          rollouts that ended in an error
    eval/versions        the policy versions its tokens came from (a long evaluation spans a push)

and the last step's metrics wait for the final one. The task set is the same at every
evaluation (seeded), so the curve compares like with like; the report and the plots show it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import Field

from agentrl.config import BaseConfig
from agentrl.errors import ConfigError

__all__ = ["EvalSection", "HeldOutEval"]


class EvalSection(BaseConfig):
    """`[eval]`: held-out evaluation during training."""

    every: int = Field(default=0, ge=0)
    """Evaluate after every this many steps and at the end (0: never)."""
    split: str = "test"
    """The environment's split the tasks come from (one the run does not train on)."""
    tasks: int = Field(default=32, ge=1)
    """Tasks per evaluation (the same ones every time)."""
    rollouts_per_task: int = Field(default=4, ge=1)
    """Rollouts per task (k of avg@k and pass@k)."""
    pass_threshold: float = 1.0
    """A rollout passes when its reward reaches this (pass@k)."""
    temperature: float | None = Field(default=None, ge=0)
    """Sampling temperature of the evaluation (None: the run's)."""
    concurrency: int = Field(default=16, ge=1)
    """Most evaluation rollouts in flight at once (beside the training rollouts)."""
    seed: int = 0
    """Seed of the task choice and of sampling."""


class HeldOutEval:
    """Runs evaluations for the orchestrator, one at a time, and hands each one's metrics over once."""

    def __init__(self, config: EvalSection, *, environment: Any, client: Any, sampling: Any,
                 train_split: str) -> None:
        if config.every and config.split == train_split:
            raise ConfigError(f"eval.split={config.split!r} is the split the run trains on "
                              "(orchestrator.task_split); evaluate on a held-out split")
        self.config = config
        self.environment = environment
        self.client = client
        self.sampling = sampling if config.temperature is None else sampling.model_copy(
            update={"temperature": config.temperature})
        self.tasks = environment.tasks(config.split, n=config.tasks, seed=config.seed) if config.every else []
        if config.every and not self.tasks:
            raise ConfigError(f"eval.split={config.split!r}: the environment has no tasks there; set eval.split")
        self._running: asyncio.Task | None = None
        self._started_step: int | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.config.every)

    def due(self, step: int, *, last: bool) -> bool:
        """Whether an evaluation starts after `step` (0-based) was pushed: every `every` steps and at the end."""
        return self.enabled and (last or (step + 1) % self.config.every == 0)

    def start(self, step: int) -> None:
        """Start evaluating the weights pushed after `step` (one at a time: a running evaluation is kept)."""
        if self._running is not None and not self._running.done():
            return
        self._started_step = step
        self._running = asyncio.ensure_future(self._evaluate(step))

    def take(self) -> dict[str, Any]:
        """The finished evaluation's metrics, once (empty while none finished since the last call)."""
        if self._running is None or not self._running.done():
            return {}
        running, self._running = self._running, None
        return running.result()

    async def finish(self) -> dict[str, Any]:
        """Wait for the running evaluation; its metrics (empty when none runs)."""
        if self._running is None:
            return {}
        await asyncio.wait({self._running})
        return self.take()

    def cancel(self) -> None:
        if self._running is not None and not self._running.done():
            self._running.cancel()

    async def _evaluate(self, step: int) -> dict[str, Any]:
        from agentrl.evaluation.summary import pass_at_k
        from agentrl.stats import bootstrap_interval

        started = time.monotonic()
        gate = asyncio.Semaphore(max(1, self.config.concurrency // self.config.rollouts_per_task))

        async def group(index: int, task: Any) -> list[Any]:
            async with gate:
                sampling = self.sampling.model_copy(update={"seed": self.config.seed * 100_003 + index})
                return await self.environment.run_group(self.client, task, n=self.config.rollouts_per_task,
                                                        sampling=sampling)

        groups = await asyncio.gather(*(group(index, task) for index, task in enumerate(self.tasks)))
        k = self.config.rollouts_per_task
        rewards = [rollout.reward for rollouts in groups for rollout in rollouts]
        per_task = [sum(r.reward for r in rollouts) / len(rollouts) for rollouts in groups if rollouts]
        low, high = bootstrap_interval(per_task, seed=self.config.seed) if per_task else (float("nan"),) * 2
        versions = sorted({version for rollouts in groups for rollout in rollouts for turn in rollout.turns
                           for version in (turn.completion.policy_versions or [])})
        metrics: dict[str, Any] = {
            "eval/step": step,
            "eval/tasks": len(groups),
            "eval/mean_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
            "eval/mean_reward_low": low,
            "eval/mean_reward_high": high,
            f"eval/avg@{k}": sum(per_task) / len(per_task) if per_task else float("nan"),
            "eval/errors": sum(1 for rollouts in groups for rollout in rollouts if rollout.error),
            "eval/versions": versions[:1] + versions[-1:] if len(versions) > 1 else versions,
            "eval/seconds": time.monotonic() - started,
        }
        for size in sorted({1, k}):
            scores = [pass_at_k(len(rollouts), sum(r.reward >= self.config.pass_threshold for r in rollouts), size)
                      for rollouts in groups if len(rollouts) >= size]
            metrics[f"eval/pass@{size}"] = sum(scores) / len(scores) if scores else float("nan")
        return metrics
