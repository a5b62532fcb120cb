"""The asynchronous RL loop: rollouts in, optimizer steps out, weights back to inference.

The orchestrator (docs/DESIGN.md section 2) keeps groups of rollouts running against the
inference policy with bounded concurrency while the trainer works, and for each step:

1. takes `groups_per_step` scored groups off the queue, dropping (and counting) every
   group whose oldest token came from a policy older than `step - max_off_policy_steps`;
2. turns rewards into group advantages and rollouts into `TrainingSample`s;
3. runs one trainer step, then pushes the new weights to inference while the rollouts
   that are already running continue (in-flight weight update); the trainer goes on to the
   next step as soon as its weights are staged, while inference loads them;
4. logs reward, mismatch KL, the staleness histogram, tokens/s, step time and whether the
   step was trainer-bound or inference-bound, the rollouts' generation and sandbox time and
   tool calls (parse failures included; `agentrl.rl.rollout_stats`), and checkpoints every
   `checkpoint_every`;
5. with a `heldout` evaluation (`[eval]`), starts one every `every` steps once the new weights are
   pushed, beside the training rollouts, and adds its `eval/*` figures to the step it finishes in (the
   last step waits for the final one; `agentrl.rl.heldout`).

Failing runs fail: a step none of whose rollouts gave a usable sample is a failed step (its
metrics are still delivered, with `failed_steps` counting the streak); after
`max_failed_steps` of them in a row the run raises `RunFailedError`, one line naming the
first error, how many rollouts had it, and what to do about it.

Router Replay never turns itself off silently: while samples carry routed experts every
step's metrics hold `r3/replayed_fraction` (the trainer's share of loss tokens whose experts
were replayed), and the first step where it is below 1 warns once (`RuntimeWarning`, also
kept as `r3/warning` in that step's metrics) with the reasons the trainer counted.

Staleness is bounded before it happens: a group may only start while the inference
policy is recent enough for the step it will feed, so `max_off_policy_steps = 0` is the
synchronous loop (generate, train, push, repeat) and larger values let generation run up
to that many steps ahead of the trainer.

The parts it drives are protocols (`PolicyTrainer`, `WeightSync`, `Environment`,
`GroupsRecorder`), defined with its config and the records it hands out (`ScoredGroup`,
`OrchestratorState`) in `agentrl.rl.orchestrator_types`; the failed run's one-line message
and the Router Replay coverage check (`ReplayCoverage`) are in `agentrl.rl.diagnostics`.
Their names are importable from here as well.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import ConfigError
from agentrl.rl.advantages import group_advantages
from agentrl.rl.diagnostics import ReplayCoverage, RunFailedError, describe_failure, failure_hint
from agentrl.rl.orchestrator_types import (
    Environment,
    GroupsRecorder,
    OrchestratorConfig,
    OrchestratorState,
    PolicyTrainer,
    ScoredGroup,
    StepCallback,
    WeightSync,
)
from agentrl.rl.rollout_stats import rollout_step_metrics
from agentrl.sampling import ChatClient, SamplingConfig
from agentrl.sandbox.grading import TAMPER_METRIC, WORKDIR_REJECTED_METRIC
from agentrl.types import Rollout, Task, TrainingSample

__all__ = [
    "OrchestratorConfig",
    "GroupsRecorder",
    "PolicyTrainer",
    "WeightSync",
    "OrchestratorState",
    "ScoredGroup",
    "Orchestrator",
    "RunFailedError",
    "describe_failure",
    "failure_hint",
]


@dataclass
class _Counters:
    completion_tokens: int = 0
    rollouts_done: int = 0
    producer_blocked_s: float = 0.0
    dropped_stale: int = 0
    rollout_errors: int = 0
    staleness: Counter = field(default_factory=Counter)


def _ungraded(rollout: Rollout) -> bool:
    """A rollout the grader gave no reward of its own (`grader_error`), not one it scored 0 on purpose: caught
    tampering, or files that could not be carried to it (the episode's own doing; both are trained away)."""
    return bool(rollout.grader_error) and not any(rollout.metrics.get(metric) == 1.0
                                                  for metric in (TAMPER_METRIC, WORKDIR_REJECTED_METRIC))


class Orchestrator:
    """Drives environment rollouts, the trainer and weight pushes for `config.max_steps` steps."""

    def __init__(
        self,
        *,
        config: OrchestratorConfig,
        environment: Environment,
        client: ChatClient,
        trainer: PolicyTrainer,
        weight_sync: WeightSync,
        sampling: SamplingConfig,
        state: OrchestratorState | None = None,
        on_step: StepCallback | None = None,
        checkpoint: Callable[[int, OrchestratorState], Awaitable[None]] | None = None,
        env_name: str | None = None,
        on_groups: GroupsRecorder | None = None,
        heldout: Any = None,
    ) -> None:
        self.config = config
        self.environment = environment
        self.client = client
        self.trainer = trainer
        self.weight_sync = weight_sync
        self.sampling = sampling
        self.state = state or OrchestratorState()
        self.on_step = on_step
        self.checkpoint = checkpoint
        self.on_groups = on_groups
        self.heldout = heldout
        """A `agentrl.rl.heldout.HeldOutEval`: evaluations on held-out tasks every `eval.every` steps and at the end."""
        self.env_name = env_name or getattr(environment, "name", None) or getattr(
            getattr(environment, "local_env", None), "name", None)
        """The environment's name, for `agentrl env check NAME` in failure hints."""
        self.inference_version = self.state.step
        self._tasks = environment.tasks(config.task_split, seed=config.seed)
        if not self._tasks:
            raise ConfigError(f"env: split {config.task_split!r} has no tasks; set orchestrator.task_split")
        self._queue: asyncio.Queue[ScoredGroup] = asyncio.Queue()
        self._capacity = asyncio.Condition()
        self._counters = _Counters()
        self._dropped_since_start = 0
        self._groups_started_base = self.state.groups_started
        self._resume_step = self.state.step
        self._stopping = False
        self.max_in_flight_rollouts = 0
        self._in_flight_rollouts = 0
        self._failed_steps: list[int] = []  # the current streak of failed steps
        self._failed_errors: list[str | None] = []  # one entry per rollout of those steps
        self._step_errors: list[str | None] = []
        self._step_advantages: list[list[float | None]] = []  # per group, per rollout (None: not trained on)
        self._step_sample_of: dict[tuple[int, int], int] = {}  # (group, member) -> index in the step's samples
        self._replay_coverage = ReplayCoverage()

    # ---- task order -------------------------------------------------------------------
    def task_for(self, group_index: int) -> Task:
        """The task of the `group_index`-th group: a seeded shuffle per pass over the split."""
        epoch, position = divmod(group_index, len(self._tasks))
        order = list(range(len(self._tasks)))
        random.Random(self.config.seed * 1_000_003 + epoch).shuffle(order)
        return self._tasks[order[position]]

    # ---- producer ---------------------------------------------------------------------
    def _may_start(self) -> bool:
        """A new group may start if it can still feed a step within the staleness bound."""
        groups_per_step = self.config.groups_per_step
        started_this_run = self.state.groups_started - self._groups_started_base
        # Groups usable so far in this run; the run resumed at `resume_step`.
        used = started_this_run - self._dropped_since_start
        next_group_step = self._resume_step + used // groups_per_step
        if next_group_step >= self.config.max_steps:
            return False
        return next_group_step <= self.inference_version + self.config.max_off_policy_steps

    async def _run_group(self, group_index: int, semaphore: asyncio.Semaphore) -> None:
        task = self.task_for(group_index)
        started_version = self.inference_version
        start = time.monotonic()
        sampling = self.sampling
        if sampling.seed is not None:
            sampling = sampling.model_copy(update={"seed": sampling.seed + group_index})
        self._in_flight_rollouts += self.config.rollouts_per_group
        self.max_in_flight_rollouts = max(self.max_in_flight_rollouts, self._in_flight_rollouts)
        try:
            rollouts = await self.environment.run_group(
                self.client, task, n=self.config.rollouts_per_group, sampling=sampling
            )
        except Exception as error:  # the environment contract says it should not raise; count it
            rollouts = [Rollout(task=task, error=f"{type(error).__name__}: {error}")
                        for _ in range(self.config.rollouts_per_group)]
        finally:
            self._in_flight_rollouts -= self.config.rollouts_per_group
            semaphore.release()
        group = ScoredGroup(index=group_index, rollouts=rollouts, started_version=started_version,
                            elapsed_s=time.monotonic() - start)
        await self._queue.put(group)

    async def _producer(self) -> None:
        group_slots = max(1, self.config.max_concurrent_rollouts // self.config.rollouts_per_group)
        semaphore = asyncio.Semaphore(group_slots)
        running: set[asyncio.Task] = set()
        try:
            while True:
                blocked_from = time.monotonic()
                async with self._capacity:
                    await self._capacity.wait_for(lambda: self._may_start() or self._stopping)
                if self._stopping:
                    return
                await semaphore.acquire()
                self._counters.producer_blocked_s += time.monotonic() - blocked_from
                index = self.state.groups_started
                self.state.groups_started += 1
                job = asyncio.create_task(self._run_group(index, semaphore))
                running.add(job)
                job.add_done_callback(running.discard)
        finally:
            for job in running:
                job.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _wake_producer(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    # ---- consumer ---------------------------------------------------------------------
    async def _collect(self, step: int) -> list[ScoredGroup]:
        groups: list[ScoredGroup] = []
        while len(groups) < self.config.groups_per_step:
            group = await self._queue.get()
            staleness = step - group.oldest_version
            if staleness > self.config.max_off_policy_steps:
                self._counters.dropped_stale += 1
                self._dropped_since_start += 1
                self.state.dropped_stale_total += 1
                await self._wake_producer()
                continue
            self._counters.staleness[staleness] += 1
            groups.append(group)
        return groups

    def _samples(self, groups: list[ScoredGroup]) -> tuple[list[TrainingSample], dict[str, float]]:
        samples: list[TrainingSample] = []
        rewards: list[float] = []
        completion_tokens = 0
        errors = 0
        flat = 0
        first_error: str | None = None
        rollouts = [r for group in groups for r in group.rollouts]
        self._step_errors = [r.error for r in rollouts]
        self._step_advantages = []
        self._step_sample_of = {}
        ungraded = [r for r in rollouts if _ungraded(r)]
        no_grade = bool(ungraded) and all(r.error is not None or _ungraded(r) for r in rollouts)
        if no_grade:
            # the grader gave no rollout a reward of its own (a verifier that never wrote one, a grading sandbox
            # that could not start): nothing to train on, a failed step, and after max_failed_steps a stop naming it
            self._step_errors = [r.error or f"no reward from the grader: {r.grader_error}" for r in rollouts]
        for group_index, group in enumerate(groups):
            usable = [r for r in group.rollouts if r.error is None and r.turns]
            errors += len(group.rollouts) - len(usable)
            if no_grade:
                usable = []
            if first_error is None:
                first_error = next((r.error for r in group.rollouts if r.error), None)
            rewards += [r.reward for r in group.rollouts]
            normalize = self.config.normalize_advantages
            advantages = group_advantages([r.reward for r in usable], std_normalize=normalize,
                                          negative_scale=self.config.negative_advantage_scale) if usable else []
            if len({r.reward for r in usable}) == 1:
                flat += 1  # every rollout of the group got the same reward: advantages of 0, nothing to learn
            trained = {id(rollout): advantage for rollout, advantage in zip(usable, advantages)}
            self._step_advantages.append([trained.get(id(r)) for r in group.rollouts])
            member_of = {id(r): member for member, r in enumerate(group.rollouts)}
            for rollout, advantage in zip(usable, advantages):
                sample = rollout.sample()
                sample.advantage = advantage
                self._step_sample_of[(group_index, member_of[id(rollout)])] = len(samples)
                samples.append(sample)
                completion_tokens += rollout.completion_tokens
        self._counters.rollout_errors += errors
        self.state.rollout_errors_total += errors
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else 0.0
        metrics: dict[str, Any] = {"reward": mean, "reward_std": std, "completion_tokens": float(completion_tokens),
                                   "samples": float(len(samples)), "rollout_errors": float(errors),
                                   "grader_errors": float(len(ungraded)), "groups_without_signal": float(flat),
                                   "groups": float(len(groups)),
                                   **rollout_step_metrics(rollouts)}
        if first_error is None and not samples and ungraded:
            first_error = f"no reward from the grader: {ungraded[0].grader_error}"
        if first_error is not None:
            metrics["first_error"] = first_error[:500]
        return samples, metrics

    async def run(self) -> list[dict[str, Any]]:
        """Run until `max_steps` steps are done; return each step's metrics.

        Raises `RunFailedError` after `max_failed_steps` steps in a row without a usable
        rollout (their metrics were delivered to `on_step` first).
        """
        history: list[dict[str, Any]] = []
        if self.state.step > 0 or getattr(self.weight_sync, "push_at_start", False):
            # Resumed: inference must serve the checkpoint's weights, tagged with its step (and a policy the
            # servers do not hold until pushed, a LoRA adapter, is pushed before the first step).
            loading = await self.weight_sync.push(version=self.state.step)
            if loading is not None:
                await loading
            self.inference_version = self.state.step
        publishing: asyncio.Task | None = None
        last_push_s = 0.0

        async def finish_push(loading: Awaitable[None] | None, version: int, started: float) -> None:
            nonlocal last_push_s
            if loading is not None:
                await loading
            last_push_s = time.monotonic() - started
            self.inference_version = version  # the producer may now start groups for newer steps
            await self._wake_producer()

        producer = asyncio.create_task(self._producer())
        # Optional `WeightSync.watch`: keeps restarted servers on the pushed version between pushes.
        watch = getattr(self.weight_sync, "watch", None)
        guard = asyncio.create_task(watch()) if watch is not None else None
        last_step_end = time.monotonic()
        try:
            while self.state.step < self.config.max_steps:
                step = self.state.step
                self._counters = _Counters()
                wait_start = time.monotonic()
                collect = asyncio.create_task(self._collect(step))
                waiting = {collect, producer} | ({publishing} if publishing is not None else set())
                if guard is not None and not (guard.done() and guard.exception() is None):
                    waiting.add(guard)
                while True:
                    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if producer in done:
                        collect.cancel()
                        producer.result()  # re-raise the producer's failure
                        raise RuntimeError("rollout producer stopped before the run finished")
                    if guard in done:
                        waiting.discard(guard)
                        if guard.exception() is not None:
                            collect.cancel()
                            guard.result()  # a restarted server that cannot get the weights ends the run
                    if publishing in done:
                        waiting.discard(publishing)
                        if publishing.exception() is not None:
                            collect.cancel()
                            publishing.result()  # a failed weight load ends the run
                    if collect in done:
                        break
                groups = collect.result()
                wait_s = time.monotonic() - wait_start
                samples, batch_metrics = self._samples(groups)
                picked = self.on_groups.pick(groups) if self.on_groups is not None else []
                logprobs_of = {pick: self._step_sample_of[pick] for pick in picked if pick in self._step_sample_of}
                if samples:
                    self._failed_steps, self._failed_errors = [], []
                else:  # nothing to train on: a failed step
                    self._failed_steps.append(step)
                    self._failed_errors += self._step_errors
                train_start = time.monotonic()
                asked = {"logprobs_of": sorted(set(logprobs_of.values()))} if logprobs_of else {}
                train_metrics = dict(await self.trainer.train_step(samples, step=step, **asked)) if samples else {}
                train_s = time.monotonic() - train_start
                token_logprobs = train_metrics.pop("token_logprobs", None) or {}
                if self.on_groups is not None:
                    self.on_groups.record(step, groups, self._step_advantages, trainer_logprobs={
                        pick: token_logprobs[index] for pick, index in logprobs_of.items() if index in token_logprobs})
                self.state.step = step + 1
                if publishing is not None:
                    await publishing  # one load at a time; the previous one is normally long done
                push_start = time.monotonic()
                loading = await self.weight_sync.push(version=step + 1)
                stage_s = time.monotonic() - push_start
                # Inference loads the new weights while the trainer takes the next step; the
                # producer waits for the new version where the staleness bound asks for it
                # (with max_off_policy_steps = 0, every group of the next step).
                publishing = asyncio.create_task(finish_push(loading, step + 1, push_start))
                last = self.state.step == self.config.max_steps
                held_out: dict[str, Any] = {}
                if self.heldout is not None and self.heldout.due(step, last=last):
                    if last:  # the final evaluation sees the final weights, once they are served
                        held_out.update(await self.heldout.finish())
                        await publishing
                    self.heldout.start(step)
                now = time.monotonic()
                step_s = now - last_step_end
                last_step_end = now
                counters = self._counters
                metrics: dict[str, Any] = {
                    "step": step,
                    **batch_metrics,
                    "mismatch_kl": float(train_metrics.get("mismatch_kl", float("nan"))),
                    "staleness": {str(k): v for k, v in sorted(counters.staleness.items())},
                    "dropped_stale": counters.dropped_stale,
                    "dropped_stale_total": self.state.dropped_stale_total,
                    "tokens_per_s": batch_metrics["completion_tokens"] / step_s if step_s > 0 else 0.0,
                    "step_time_s": step_s,
                    "wait_s": wait_s,
                    "train_s": train_s,
                    "weight_stage_s": stage_s,
                    "weight_push_s": last_push_s,
                    "bound": "inference" if wait_s > train_s + stage_s else "trainer",
                    "policy_version": self.inference_version,
                    "time": time.time(),
                }
                metrics["failed_steps"] = len(self._failed_steps)
                metrics.update(self._replay_coverage.step_metrics(step, samples, train_metrics))
                # The trainer's memory figures keep their names (`mem/...`, beside the servers' own).
                metrics.update({(k if k.startswith("mem/") else f"train/{k}"): float(v)
                                for k, v in train_metrics.items()})
                update_metrics = getattr(self.weight_sync, "metrics", None)  # the latest completed weight update
                if update_metrics is not None:
                    metrics.update(update_metrics())
                if self.heldout is not None:  # an evaluation that finished meanwhile; the last step waits for its own
                    held_out.update(await self.heldout.finish() if last else self.heldout.take())
                    metrics.update(held_out)
                history.append(metrics)
                if self.on_step is not None:
                    result = self.on_step(metrics)
                    if asyncio.iscoroutine(result):
                        await result
                if len(self._failed_steps) >= self.config.max_failed_steps:
                    # after the failed steps' metrics are delivered (and on disk with the Ray launcher)
                    raise RunFailedError(describe_failure(self._failed_errors, steps=self._failed_steps,
                                                          env_name=self.env_name), history=history)
                # After the step's metrics are on disk: a checkpoint never runs ahead of its metrics.
                if self.state.step == self.config.max_steps:
                    await publishing  # the run ends with inference serving the final weights
                if self.checkpoint is not None and (
                    (self.config.checkpoint_every and self.state.step % self.config.checkpoint_every == 0)
                    or self.state.step == self.config.max_steps
                ):
                    await self.checkpoint(self.state.step, self.state)
        finally:
            self._stopping = True
            await self._wake_producer()
            producer.cancel()
            if self.heldout is not None:
                self.heldout.cancel()
            if guard is not None:
                guard.cancel()
            await asyncio.gather(producer, *([guard] if guard is not None else []), return_exceptions=True)
            if publishing is not None and not publishing.done():
                publishing.cancel()
                await asyncio.gather(publishing, return_exceptions=True)
        if publishing is not None:
            publishing.result()  # a failed load is the run's failure
        return history
