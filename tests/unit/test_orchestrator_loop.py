"""The orchestrator's loop semantics: learning, staleness bound, drops, concurrency, resume state.

These tests drive the real `Orchestrator` with a small but real learner instead of the
MoE stack (which the e2e tests cover): a tabular softmax policy over a handful of
answer tokens, trained by policy gradient with the orchestrator's advantages. Its
inference copy is only refreshed by `push`, and every generated token carries the
inference weight version, exactly as vLLM reports `weight_versions`; so staleness,
drops and in-flight updates are measured, not assumed.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from agentrl.errors import ConfigError
from agentrl.sampling import SamplingConfig
from agentrl.rl.orchestrator import (
    Orchestrator,
    OrchestratorConfig,
    OrchestratorState,
    group_advantages,
)
from agentrl.types import Completion, Message, Rollout, Task, Turn

VOCAB = 4


class TabularPolicy:
    """A softmax policy per task over VOCAB answer tokens: trainer weights + an inference copy."""

    def __init__(self, *, tasks: int, lr: float = 1.0, seed: int = 0, delay_s: float = 0.0) -> None:
        self.trainer_logits = [[0.0] * VOCAB for _ in range(tasks)]
        self.inference_logits = [row[:] for row in self.trainer_logits]
        self.inference_version = 0
        self.lr = lr
        self.rng = random.Random(seed)
        self.delay_s = delay_s
        self.slow_tasks: set[int] = set()
        self.trained_steps: list[int] = []
        self.pushed_versions: list[int] = []
        self.train_delay_s = 0.0

    @staticmethod
    def _logprobs(row: list[float]) -> list[float]:
        top = max(row)
        norm = top + math.log(sum(math.exp(x - top) for x in row))
        return [x - norm for x in row]

    # ChatClient
    async def chat(self, messages, *, tools=None, sampling: SamplingConfig, previous=None):
        task_id = int(messages[-1].content)
        version = self.inference_version
        await asyncio.sleep(self.delay_s * (20 if task_id in self.slow_tasks else 1))
        logprobs = self._logprobs(self.inference_logits[task_id])
        token = self.rng.choices(range(VOCAB), weights=[math.exp(lp) for lp in logprobs])[0]
        completion = Completion(text=str(token), token_ids=[token], logprobs=[logprobs[token]],
                                weight_versions=[version], finish_reason="stop")
        turn = Turn(prompt_token_ids=[100 + task_id], completion=completion)
        return Message(role="assistant", content=str(token)), turn

    # PolicyTrainer
    async def train_step(self, samples, *, step):
        await asyncio.sleep(self.train_delay_s)
        self.trained_steps.append(step)
        kls = []
        before = [row[:] for row in self.trainer_logits]  # one batch gradient, at the pre-step weights
        for sample in samples:
            task_id = sample.token_ids[0] - 100
            token = sample.token_ids[1]
            logprobs = self._logprobs(before[task_id])
            kls.append(sample.inference_logprobs[1] - logprobs[token])
            probs = [math.exp(lp) for lp in logprobs]
            for j in range(VOCAB):
                grad = (1.0 if j == token else 0.0) - probs[j]
                self.trainer_logits[task_id][j] += self.lr * sample.advantage * grad
        return {"loss": 0.0, "mismatch_kl": sum(kls) / len(kls)}

    async def save_checkpoint(self, path, *, step):
        pass

    # WeightSync
    async def push(self, *, version):
        self.inference_logits = [row[:] for row in self.trainer_logits]
        self.inference_version = version
        self.pushed_versions.append(version)


class PickTokenEnv:
    """Task i is rewarded when the policy answers token (i % VOCAB)."""

    def __init__(self, tasks: int = 6) -> None:
        self._tasks = [Task(prompt=[Message(role="user", content=str(i))], answer=str(i % VOCAB), example_id=i)
                       for i in range(tasks)]

    def tasks(self, split="test", *, n=None, seed=0):
        return self._tasks[:n] if n else list(self._tasks)

    async def run_group(self, client, task, *, n, sampling):
        async def one():
            message, turn = await client.chat(task.prompt, sampling=sampling)
            return Rollout(task=task, messages=task.prompt + [message], turns=[turn],
                           reward=float(message.content == task.answer))
        return list(await asyncio.gather(*(one() for _ in range(n))))


def _orchestrator(policy, env, **config):
    cfg = OrchestratorConfig(**config)
    return Orchestrator(config=cfg, environment=env, client=policy, trainer=policy, weight_sync=policy,
                        sampling=SamplingConfig())


async def test_reward_rises_and_every_step_trains_once():
    policy = TabularPolicy(tasks=6, delay_s=0.001)
    orch = _orchestrator(policy, PickTokenEnv(), max_steps=12, groups_per_step=6, rollouts_per_group=8,
                         max_off_policy_steps=1)
    history = await orch.run()
    assert [m["step"] for m in history] == list(range(12))
    assert policy.trained_steps == list(range(12))
    assert policy.pushed_versions == list(range(1, 13))
    first, last = history[0]["reward"], sum(m["reward"] for m in history[-3:]) / 3
    assert first < 0.5 and last > first + 0.3, (first, last)
    for metrics in history:
        assert metrics["bound"] in ("trainer", "inference")
        assert metrics["tokens_per_s"] > 0
        assert math.isfinite(metrics["mismatch_kl"])


async def test_synchronous_mode_is_on_policy():
    policy = TabularPolicy(tasks=6, delay_s=0.001)
    orch = _orchestrator(policy, PickTokenEnv(), max_steps=5, groups_per_step=3, rollouts_per_group=4,
                         max_off_policy_steps=0)
    history = await orch.run()
    for metrics in history:
        assert metrics["staleness"] == {"0": 3}
        assert metrics["dropped_stale"] == 0
        # trainer and inference weights were identical when sampled: no mismatch at all
        assert abs(metrics["mismatch_kl"]) < 1e-12


async def test_staleness_bounded_and_async_runs_ahead():
    policy = TabularPolicy(tasks=6, delay_s=0.002)
    policy.train_delay_s = 0.02  # trainer-bound: generation has time to run ahead
    orch = _orchestrator(policy, PickTokenEnv(), max_steps=8, groups_per_step=2, rollouts_per_group=2,
                         max_off_policy_steps=2, max_concurrent_rollouts=16)
    history = await orch.run()
    seen = set()
    for metrics in history:
        for staleness in metrics["staleness"]:
            assert 0 <= int(staleness) <= 2
            seen.add(int(staleness))
    assert max(seen) >= 1, "with a slow trainer the producer should have run ahead"
    assert any(m["bound"] == "trainer" for m in history)


async def test_stale_groups_are_dropped_and_counted():
    policy = TabularPolicy(tasks=6, delay_s=0.002)
    policy.slow_tasks = {0}  # task 0's groups take 20x longer: they outlive the staleness bound
    orch = _orchestrator(policy, PickTokenEnv(), max_steps=6, groups_per_step=2, rollouts_per_group=2,
                         max_off_policy_steps=0, max_concurrent_rollouts=8)
    # synchronous mode starts only the current step's groups, so nothing goes stale there
    history = await orch.run()
    assert sum(m["dropped_stale"] for m in history) == 0
    policy = TabularPolicy(tasks=6, delay_s=0.002)
    policy.slow_tasks = {0}
    orch = _orchestrator(policy, PickTokenEnv(), max_steps=10, groups_per_step=1, rollouts_per_group=2,
                         max_off_policy_steps=1, max_concurrent_rollouts=8)
    history = await orch.run()
    dropped = sum(m["dropped_stale"] for m in history)
    assert dropped >= 1
    assert history[-1]["dropped_stale_total"] == dropped == orch.state.dropped_stale_total
    for metrics in history:
        assert all(int(s) <= 1 for s in metrics["staleness"])


async def test_concurrency_is_bounded():
    policy = TabularPolicy(tasks=6, delay_s=0.005)
    orch = _orchestrator(policy, PickTokenEnv(), max_steps=3, groups_per_step=6, rollouts_per_group=2,
                         max_off_policy_steps=2, max_concurrent_rollouts=4)
    await orch.run()
    assert 0 < orch.max_in_flight_rollouts <= 4


async def test_resume_state_continues_the_step_count():
    policy = TabularPolicy(tasks=6)
    state = OrchestratorState(step=3, groups_started=9, dropped_stale_total=2)
    orch = Orchestrator(config=OrchestratorConfig(max_steps=5, groups_per_step=3, rollouts_per_group=2),
                        environment=PickTokenEnv(), client=policy, trainer=policy, weight_sync=policy,
                        sampling=SamplingConfig(), state=state)
    saved = []

    async def checkpoint(step, st):
        saved.append((step, dict(st.to_dict())))

    orch.checkpoint = checkpoint
    history = await orch.run()
    assert [m["step"] for m in history] == [3, 4]
    assert policy.trained_steps == [3, 4]
    assert [s for s, _ in saved] == [4, 5]
    assert saved[-1][1]["dropped_stale_total"] == 2
    assert OrchestratorState.from_dict(saved[-1][1]).step == 5


async def test_environment_errors_are_counted_not_raised():
    class Broken(PickTokenEnv):
        async def run_group(self, client, task, *, n, sampling):
            if task.example_id == 1:
                raise RuntimeError("sandbox died")
            return await super().run_group(client, task, n=n, sampling=sampling)

    policy = TabularPolicy(tasks=6)
    orch = _orchestrator(policy, Broken(), max_steps=2, groups_per_step=6, rollouts_per_group=2)
    history = await orch.run()
    assert sum(m["rollout_errors"] for m in history) >= 2
    assert any("sandbox died" in m.get("first_error", "") for m in history)
    assert orch.state.rollout_errors_total == sum(m["rollout_errors"] for m in history)


def test_task_order_is_seeded_and_covers_the_split():
    policy = TabularPolicy(tasks=6)
    orch = _orchestrator(policy, PickTokenEnv(), seed=3)
    first_pass = [orch.task_for(i).example_id for i in range(6)]
    assert sorted(first_pass) == list(range(6))
    again = _orchestrator(policy, PickTokenEnv(), seed=3)
    assert [again.task_for(i).example_id for i in range(12)] == [orch.task_for(i).example_id for i in range(12)]


def test_group_advantages_mean_baseline():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    normalized = group_advantages([1.0, 0.0], normalize=True)
    assert normalized[0] == pytest.approx(1.0, abs=1e-4) and normalized[1] == pytest.approx(-1.0, abs=1e-4)
    assert group_advantages([0.3, 0.3]) == [0.0, 0.0]


@pytest.mark.parametrize("key,value", [("max_steps", 0), ("groups_per_step", 0), ("max_off_policy_steps", -1)])
def test_bad_orchestrator_config_is_one_line(key, value):
    with pytest.raises(ConfigError) as info:
        OrchestratorConfig(**{key: value})
    assert f"orchestrator.{key}" in str(info.value) and "\n" not in str(info.value)


class SlowLoadingPolicy(TabularPolicy):
    """A push that stages at once and loads into inference later, like the Ray weight sync."""

    def __init__(self, *, load_s: float, fail_at: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.load_s = load_s
        self.fail_at = fail_at
        self.events: list[tuple[str, int]] = []

    async def train_step(self, samples, *, step):
        self.events.append(("train", step))
        return await super().train_step(samples, step=step)

    async def push(self, *, version):
        staged = [row[:] for row in self.trainer_logits]  # the snapshot; the next step may change the weights

        async def load():
            await asyncio.sleep(self.load_s)
            if version == self.fail_at:
                raise RuntimeError(f"server refused weights v{version}")
            self.inference_logits = staged
            self.inference_version = version
            self.pushed_versions.append(version)
            self.events.append(("loaded", version))

        return load()


async def test_the_next_step_trains_while_inference_loads_the_weights():
    policy = SlowLoadingPolicy(load_s=0.05, tasks=6, delay_s=0.001)
    history = await _orchestrator(policy, PickTokenEnv(), max_steps=6, groups_per_step=3, rollouts_per_group=4,
                                  max_off_policy_steps=2).run()
    assert policy.pushed_versions == list(range(1, 7))  # every version loaded, in order, the last one too
    # Step 1 trains (on rollouts generated ahead) before version 1 is loaded.
    assert policy.events.index(("train", 1)) < policy.events.index(("loaded", 1))
    assert all(m["weight_stage_s"] < 0.05 for m in history)
    assert history[-1]["weight_push_s"] >= 0.05


async def test_synchronous_mode_waits_for_the_load():
    policy = SlowLoadingPolicy(load_s=0.03, tasks=6, delay_s=0.001)
    history = await _orchestrator(policy, PickTokenEnv(), max_steps=4, groups_per_step=3, rollouts_per_group=4,
                                  max_off_policy_steps=0).run()
    for metrics in history:
        assert metrics["staleness"] == {"0": 3}  # every group sampled from the step's own weights
    for step in range(1, 4):
        assert policy.events.index(("loaded", step)) < policy.events.index(("train", step))


async def test_a_failed_weight_load_ends_the_run_with_its_error():
    policy = SlowLoadingPolicy(load_s=0.01, fail_at=2, tasks=6, delay_s=0.001)
    with pytest.raises(RuntimeError, match="server refused weights v2"):
        await asyncio.wait_for(_orchestrator(policy, PickTokenEnv(), max_steps=6, groups_per_step=3,
                                             rollouts_per_group=4, max_off_policy_steps=0).run(), timeout=30)
