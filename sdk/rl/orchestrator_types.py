"""What the orchestrator is given and what it hands back: its config, the parts it drives, its records.

The trainer and the weight transport are protocols (`PolicyTrainer`, `WeightSync`): the
Ray launcher (`agentrl.rl.launch`) binds them to the trainer actor and to the
inference engineer's weight publisher; anything that implements them can be driven.
A `GroupsRecorder` (`on_groups`, the run's `agentrl.rl.rollout_log.RolloutLog`) picks which
rollouts of each step it keeps; the trainer is asked for those samples' per-token logprobs
(`train_step(..., logprobs_of=[sample indices])`, from the step's own forward pass) and the
recorder gets them with the step's groups after the step. `Environment` is the part of
`agentrl.environment.Environment` the orchestrator uses; `StepCallback` gets each step's metrics.

The records: a `ScoredGroup` is one task's scored rollouts with the policy versions that
produced them (its `oldest_version` bounds its staleness); `OrchestratorState` is what a
restart needs, saved with each checkpoint. `OrchestratorConfig` is the `[orchestrator]`
table of `agentrl train`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import Field

from agentrl.config import BaseConfig
from agentrl.errors import ConfigError
from agentrl.sampling import ChatClient, SamplingConfig
from agentrl.types import Rollout, Task, TrainingSample

__all__ = [
    "Environment",
    "GroupsRecorder",
    "OrchestratorConfig",
    "OrchestratorState",
    "PolicyTrainer",
    "ScoredGroup",
    "StepCallback",
    "WeightSync",
]


class OrchestratorConfig(BaseConfig):
    """How the asynchronous loop samples, bounds staleness and checkpoints."""

    max_steps: int = 20
    """Optimizer steps to run in total (a resumed run counts the steps already done)."""
    groups_per_step: int = 8
    """Tasks (groups) per optimizer step."""
    rollouts_per_group: int = 4
    """Rollouts per task; advantages are computed within a group."""
    max_concurrent_rollouts: int = 32
    """Most rollouts in flight against inference at once."""
    max_off_policy_steps: int = 1
    """Most optimizer steps a rollout's policy may lag behind the step it trains (0 = synchronous)."""
    normalize_advantages: bool = False
    """Divide group advantages by the group's reward standard deviation."""
    negative_advantage_scale: float = Field(default=1.0, ge=0.0, le=1.0)
    """Scale of negative advantages (rollouts worse than their group's mean): 1 is plain policy gradient; 0 trains
    only on rollouts that beat their group (on-policy rejection sampling), which keeps a small policy's tool-call
    format intact at learning rates where the push-down on failed rollouts breaks it."""
    task_split: str = "train"
    """Dataset split tasks are sampled from."""
    seed: int = 0
    """Seed of the task order (and of sampling seeds when set)."""
    checkpoint_every: int = 1
    """Save trainer and orchestrator state every this many steps (0: only at the end)."""
    max_failed_steps: int = 3
    """Stop the run (`RunFailedError`) after this many steps in a row whose rollouts all errored
    (no usable sample); >= 1. A failed step trains nothing; its metrics are still written."""

    def model_post_init(self, __context: Any) -> None:
        checks = {
            "max_steps": self.max_steps >= 1,
            "groups_per_step": self.groups_per_step >= 1,
            "rollouts_per_group": self.rollouts_per_group >= 1,
            "max_concurrent_rollouts": self.max_concurrent_rollouts >= 1,
            "max_off_policy_steps": self.max_off_policy_steps >= 0,
            "checkpoint_every": self.checkpoint_every >= 0,
            "max_failed_steps": self.max_failed_steps >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(
                    f"orchestrator.{name} = {getattr(self, name)!r} is out of range; "
                    f"use {'a value >= 0' if name in ('max_off_policy_steps', 'checkpoint_every') else 'a value >= 1'}"
                )
        if self.rollouts_per_group == 1:
            raise ConfigError("orchestrator.rollouts_per_group = 1: a group's advantages are each reward minus the "
                              "group's mean, so every advantage is 0 and nothing is learned; use at least 2")


class PolicyTrainer(Protocol):
    """The trainer side as the orchestrator sees it (bound to a Ray actor by the launcher)."""

    async def train_step(self, samples: list[TrainingSample], *, step: int,
                         logprobs_of: list[int] = ()) -> dict[str, Any]:
        """Run one optimizer step on these samples; return its metrics (loss, mismatch_kl, ...).

        Only called with `logprobs_of` (indices into `samples`) when a recorder keeps some of the
        step's rollouts; the metrics then carry ``token_logprobs``: {sample index: the trainer's
        logprob per token of that sample, None where it has none (the first token, non-loss tokens)}.
        """
        ...

    async def save_checkpoint(self, path: str, *, step: int) -> None:
        """Write the trainer's full state (model, optimizer, RNG) under `path`."""
        ...


class WeightSync(Protocol):
    """Moves the trainer's current weights into the inference servers."""

    async def push(self, *, version: int) -> Awaitable[None] | None:
        """Make inference serve the trainer's current weights, tagged as policy `version`.

        Returns once the weights are staged (the trainer may step again), with an awaitable
        that completes when inference serves them; None when the push is already complete.

        A weight sync may also have `async def watch()`, run beside the loop for the whole run
        (cancelled at its end): it keeps servers that restart between pushes on the pushed
        version (`agentrl.rl.transport.WeightPush.watch`); if it raises, the run ends with its error.
        It may also have `metrics() -> dict[str, float]`: the latest completed update's figures (the weight
        check, the servers' memory), added to each step's metrics; and `push_at_start` (True: the servers
        hold nothing of the policy until a push, e.g. a LoRA adapter served by name; the run pushes its
        starting version before the first step).
        """
        ...


class Environment(Protocol):  # the part of agentrl.environment.Environment used here
    async def run_group(self, client: ChatClient, task: Task, *, n: int, sampling: SamplingConfig) -> list[Rollout]:
        ...

    def tasks(self, split: str = "test", *, n: int | None = None, seed: int = 0) -> list[Task]:
        ...


StepCallback = Callable[[dict[str, Any]], Awaitable[None] | None]


class GroupsRecorder(Protocol):
    """Keeps some rollouts of each step (`agentrl.rl.rollout_log.RolloutLog`)."""

    def pick(self, groups: list[ScoredGroup]) -> list[tuple[int, int]]:
        """(group, member) of the rollouts `record` will keep (their trainer logprobs are asked for)."""
        ...

    def record(self, step: int, groups: list[ScoredGroup], advantages: list[list[float | None]], *,
               trainer_logprobs: dict[tuple[int, int], list[float | None]] | None = None) -> Any:
        """After the step: `advantages[g][m]` is the advantage rollout m of group g was trained with (None
        when it was not trained on: an error, no turns); `trainer_logprobs[(g, m)]` per token of its sample."""
        ...


@dataclass
class ScoredGroup:
    """One task's scored rollouts and the policy versions that produced them."""

    index: int
    """Order in which the group was started (task order)."""
    rollouts: list[Rollout]
    """The scored rollouts."""
    started_version: int
    """Inference policy version when the group started."""
    elapsed_s: float = 0.0
    """Wall time of the whole group."""

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that produced a token (the start version when unknown)."""
        versions = [v for r in self.rollouts for v in r.policy_versions]
        return min(versions) if versions else self.started_version


@dataclass
class OrchestratorState:
    """What the orchestrator must remember across a restart (saved with each checkpoint)."""

    step: int = 0
    """Next optimizer step to run (= steps done)."""
    dropped_stale_total: int = 0
    """Groups dropped for staleness so far."""
    rollout_errors_total: int = 0
    """Rollouts that ended with an error so far."""
    groups_started: int = 0
    """Groups started so far (the position in the task order)."""

    def to_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "dropped_stale_total": self.dropped_stale_total,
            "rollout_errors_total": self.rollout_errors_total,
            "groups_started": self.groups_started,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OrchestratorState:
        return cls(**{k: int(data[k]) for k in ("step", "dropped_stale_total", "rollout_errors_total",
                                                "groups_started") if k in data})
