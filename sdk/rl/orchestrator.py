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
   step was trainer-bound or inference-bound, and checkpoints every `checkpoint_every`.

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

The trainer and the weight transport are protocols (`PolicyTrainer`, `WeightSync`): the
Ray launcher (`agentrl.rl.launch`) binds them to the trainer actor and to the
inference engineer's weight publisher; anything that implements them can be driven.
A `GroupsRecorder` (`on_groups`, the run's `agentrl.rl.rollout_log.RolloutLog`) picks which
rollouts of each step it keeps; the trainer is asked for those samples' per-token logprobs
(`train_step(..., logprobs_of=[sample indices])`, from the step's own forward pass) and the
recorder gets them with the step's groups after the step.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from agentrl.config import BaseConfig
from agentrl.errors import AgentrlError, ConfigError
from agentrl.sampling import ChatClient, SamplingConfig
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
    "group_advantages",
]


class RunFailedError(AgentrlError):
    """`max_failed_steps` steps in a row had no usable rollout; the message names the first error and a fix."""

    def __init__(self, message: str, *, history: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.history = history or []
        """The metrics of every step this run delivered, the failed ones included."""


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
        """
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
    def from_dict(cls, data: dict[str, Any]) -> "OrchestratorState":
        return cls(**{k: int(data[k]) for k in ("step", "dropped_stale_total", "rollout_errors_total",
                                                "groups_started") if k in data})


def group_advantages(rewards: list[float], *, normalize: bool = False) -> list[float]:
    """Group advantages via the trainer's definition (`agentrl.trainer.advantages`); [] for no rewards."""
    from agentrl.trainer.advantages import group_advantages as trainer_group_advantages

    if not rewards:
        return []
    return trainer_group_advantages(rewards, std_normalize=normalize)


_NUMBERS = re.compile(r"\d[\d,]*")
_CLIENT_TOO_LONG = re.compile(r"prompt of [\d,]+ tokens (?:exceeds|fills)")  # agentrl.client.TokenClient
_VLLM_TOO_LONG = (  # vLLM's own 400 answers: (pattern, group of the prompt length, group of the context)
    (re.compile(r"maximum context length is (\d+) tokens\. However, your prompt contains (?:at least )?(\d+)"), 2, 1),
    (re.compile(r"prompt \(length (\d+)\).*?maximum model length of (\d+)"), 1, 2),
)
_CONTEXT_FIX = "use a model with a longer context, shorter prompts (the environment's args), or inference.max_model_len"
_NO_IMAGE = re.compile(r"sandbox image .* is not in the local Docker engine|ImageNotFound|No such image", re.I)
_NO_DOCKER = re.compile(r"no Docker engine answers|Cannot connect to the Docker daemon")
_UNREACHABLE = re.compile(r"ConnectError|ConnectTimeout|Connection refused|All connection attempts failed|"
                          r"RemoteProtocolError|Server disconnected|ReadError|ReadTimeout|PoolTimeout|"
                          r"Name or service not known|inference server (?:\S+ )?lost|was restarting")
_SERVER_FAILED = re.compile(r"answered 5\d\d")


def failure_hint(error: str, *, env_name: str | None = None) -> str:
    """What to do about a rollout error, chosen from its text."""
    if _CLIENT_TOO_LONG.search(error):
        return _CONTEXT_FIX  # the error already has both numbers and the model's name
    for pattern, prompt_group, context_group in _VLLM_TOO_LONG:
        match = pattern.search(error)
        if match:
            prompt, context = int(match.group(prompt_group)), int(match.group(context_group))
            return f"prompt of {prompt:,} tokens exceeds the model's context of {context:,}: {_CONTEXT_FIX}"
    if _NO_IMAGE.search(error):
        return f"build it: agentrl env check {env_name or '<env>'} lists what is missing"
    if _NO_DOCKER.search(error):
        return "start the Docker engine (dockerd) or give the environment another sandbox type"
    if _UNREACHABLE.search(error):
        return "inference is unreachable: check that the vLLM server is up (its log is in the run folder's logs/)"
    if _SERVER_FAILED.search(error):
        return "the inference server failed the requests: see its log in the run folder's logs/"
    return "see the run folder's logs/"


def _error_kind(error: str) -> str:
    """Errors that differ only in their numbers (token counts, ports, ids) count as one."""
    return _NUMBERS.sub("#", " ".join(error.split()))


def describe_failure(errors: list[str | None], *, steps: list[int], env_name: str | None = None) -> str:
    """One line for `RunFailedError`: the failed steps, the first error, how many rollouts had it, a fix.

    `errors` holds one entry per rollout of the failed steps (None: no error, but no usable sample).
    """
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    head = f"no usable rollout in {len(steps)} step{'s' if len(steps) != 1 else ''} in a row ({span})"
    first = next((error for error in errors if error), None)
    if first is None:
        return (f"{head}: {len(errors)} rollouts ended without an error but with no model turn to train on; "
                "see the run folder's logs/")
    kind = _error_kind(first)
    same = sum(1 for error in errors if error and _error_kind(error) == kind)
    shown = " ".join(first.split())
    if len(shown) > 400:
        shown = shown[:400] + "..."
    return f"{head}: {same} of {len(errors)} rollouts failed with {shown}: {failure_hint(first, env_name=env_name)}"


def _replay_warning(step: int, fraction: float, train_metrics: dict[str, Any], carried: int, samples: int) -> str:
    """Why Router Replay covered less than all loss tokens of a step, as far as the metrics tell."""
    from_trainer = {key.removeprefix("replay_skipped_"): float(value) for key, value in train_metrics.items()
                    if key.startswith("replay_skipped_") and float(value) > 0}
    reasons = []
    if carried < samples:
        tokens = from_trainer.get("no_experts")
        reasons.append(f"{samples - carried} of {samples} samples carried no routed experts"
                       + (f" ({tokens:,.0f} loss tokens)" if tokens else ""))
    labels = {
        "no_experts": "of samples without routed experts",
        "layout": "of samples whose routed experts do not fit a packed row (their (layers, top_k) is not the "
                  "model's MoE layers and top_k)",
        "unknown": "whose routed experts were unknown (-1) or missing",
        "router_replay_off": "not replayed because trainer.router_replay is off",
    }
    for reason, count in from_trainer.items():
        if reason == "no_experts" and carried < samples:
            continue  # said already, in samples
        reasons.append(f"{count:,.0f} loss tokens {labels.get(reason, f'skipped ({reason})')}")
    if not reasons:
        reasons.append("the trainer gave no reason (no replay_skipped_* metrics)")
    if math.isnan(fraction):
        return (f"Router Replay: step {step}'s samples carried routed experts but the trainer reported no "
                "replayed_fraction; its routing may be live")
    shown = f"{fraction:.1%}" if fraction < 0.999 else f"{fraction:.3%}"  # never a rounded 100.0%
    return (f"Router Replay replayed {shown} of step {step}'s loss tokens although its samples carried "
            f"routed experts: {'; '.join(reasons)}")


class Environment(Protocol):  # the part of agentrl.environment.Environment used here
    async def run_group(self, client: ChatClient, task: Task, *, n: int, sampling: SamplingConfig) -> list[Rollout]:
        ...

    def tasks(self, split: str = "test", *, n: int | None = None, seed: int = 0) -> list[Task]:
        ...


StepCallback = Callable[[dict[str, Any]], Awaitable[None] | None]


class GroupsRecorder(Protocol):
    """Keeps some rollouts of each step (`agentrl.rl.rollout_log.RolloutLog`)."""

    def pick(self, groups: list["ScoredGroup"]) -> list[tuple[int, int]]:
        """(group, member) of the rollouts `record` will keep (their trainer logprobs are asked for)."""
        ...

    def record(self, step: int, groups: list["ScoredGroup"], advantages: list[list[float | None]], *,
               trainer_logprobs: dict[tuple[int, int], list[float | None]] | None = None) -> Any:
        """After the step: `advantages[g][m]` is the advantage rollout m of group g was trained with (None
        when it was not trained on: an error, no turns); `trainer_logprobs[(g, m)]` per token of its sample."""
        ...


@dataclass
class _Counters:
    completion_tokens: int = 0
    rollouts_done: int = 0
    producer_blocked_s: float = 0.0
    dropped_stale: int = 0
    rollout_errors: int = 0
    staleness: Counter = field(default_factory=Counter)


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
        self._r3_seen = False  # some step's samples carried routed experts
        self._r3_warned = False

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
        first_error: str | None = None
        self._step_errors = [r.error for group in groups for r in group.rollouts]
        self._step_advantages = []
        self._step_sample_of = {}
        for group_index, group in enumerate(groups):
            usable = [r for r in group.rollouts if r.error is None and r.turns]
            errors += len(group.rollouts) - len(usable)
            if first_error is None:
                first_error = next((r.error for r in group.rollouts if r.error), None)
            rewards += [r.reward for r in group.rollouts]
            advantages = group_advantages([r.reward for r in usable], normalize=self.config.normalize_advantages)
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
                                   "samples": float(len(samples)), "rollout_errors": float(errors)}
        if first_error is not None:
            metrics["first_error"] = first_error[:500]
        return samples, metrics

    def _replay_metrics(self, step: int, samples: list[TrainingSample],
                        train_metrics: dict[str, Any]) -> dict[str, Any]:
        """`r3/replayed_fraction` once samples carry routed experts; warn once when it is below 1."""
        carried = sum(1 for sample in samples if sample.routed_experts is not None)
        self._r3_seen = self._r3_seen or carried > 0
        if not self._r3_seen:
            return {}
        if not samples:  # a failed step: nothing trained, nothing replayed
            return {"r3/replayed_fraction": float("nan")}
        if carried == 0:
            fraction = 0.0
            message = (f"Router Replay: step {step}'s samples carried no routed experts although earlier steps' "
                       "did; inference stopped returning them, so the trainer routed every token live")
        else:
            fraction = float(train_metrics.get("replayed_fraction", float("nan")))
            message = _replay_warning(step, fraction, train_metrics, carried, len(samples))
        metrics: dict[str, Any] = {"r3/replayed_fraction": fraction}
        nothing_to_replay = float(train_metrics.get("loss_tokens", 1.0)) == 0.0
        if (math.isnan(fraction) or fraction < 1.0) and not nothing_to_replay and not self._r3_warned:
            self._r3_warned = True
            metrics["r3/warning"] = message
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return metrics

    async def run(self) -> list[dict[str, Any]]:
        """Run until `max_steps` steps are done; return each step's metrics.

        Raises `RunFailedError` after `max_failed_steps` steps in a row without a usable
        rollout (their metrics were delivered to `on_step` first).
        """
        history: list[dict[str, Any]] = []
        if self.state.step > 0:
            # Resumed: inference must serve the checkpoint's weights, tagged with its step.
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
                metrics.update(self._replay_metrics(step, samples, train_metrics))
                metrics.update({f"train/{k}": float(v) for k, v in train_metrics.items()})
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
            if guard is not None:
                guard.cancel()
            await asyncio.gather(producer, *([guard] if guard is not None else []), return_exceptions=True)
            if publishing is not None and not publishing.done():
                publishing.cancel()
                await asyncio.gather(publishing, return_exceptions=True)
        if publishing is not None:
            publishing.result()  # a failed load is the run's failure
        return history
