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
import re

import pytest

from agentrl.errors import ConfigError
from agentrl.rl.advantages import group_advantages
from agentrl.rl.orchestrator import (
    Orchestrator,
    OrchestratorConfig,
    OrchestratorState,
    RunFailedError,
)
from agentrl.sampling import SamplingConfig
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
        self.held_tasks: set[int] = set()  # answered only once the weights are 2 versions past the call's (or 10 s)
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
        for _ in range(10_000):  # a held task outlives the staleness bound whatever the machine's load
            if task_id not in self.held_tasks or self.inference_version >= version + 2:
                break
            await asyncio.sleep(0.001)
        logprobs = self._logprobs(self.inference_logits[task_id])
        token = self.rng.choices(range(VOCAB), weights=[math.exp(lp) for lp in logprobs])[0]
        completion = Completion(text=str(token), token_ids=[token], logprobs=[logprobs[token]],
                                policy_versions=[version], finish_reason="stop")
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
    policy.held_tasks = {0}  # task 0's groups finish two weight versions after they started: stale, certainly
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
    normalized = group_advantages([1.0, 0.0], std_normalize=True)
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


# ---- failing runs fail ----------------------------------------------------------------


def _long_prompt_env():
    """The real reverse-text environment with texts of ~2,750 characters: more than tiny-moe's 2,048 tokens."""
    from agentrl.hub.loader import load_environment

    return load_environment("reverse-text", num_train=4, num_test=1, min_words=600, max_words=600, max_chars=10000)


def _token_client(url: str, *, context: int | None):
    from agentrl.clients.token_client import TokenClient

    client = TokenClient(url, model="tiny-moe")
    if context is not None:
        client.max_model_len = context  # what the client would have read from the server's /v1/models
    return client


def _supervised(client):
    """The client as a rollout worker wraps it: inference failures retried for up to 10 minutes."""
    from agentrl.inference.supervisor import EndpointWatch, SupervisedClient

    watch = EndpointWatch(client.base_url)
    return SupervisedClient(client, watch, max_retries=300, recovery_timeout_s=600.0)


async def test_a_run_whose_rollouts_all_fail_stops_after_max_failed_steps():
    # The real environment and TokenClient (wrapped as the rollout workers wrap it): every prompt
    # is too long for the context, so each rollout ends with the client's own error before any
    # request is sent, and nothing retries it.
    policy = TabularPolicy(tasks=6)
    token_client = _token_client("http://127.0.0.1:9", context=2048)
    client = _supervised(token_client)
    delivered, saved = [], []

    async def checkpoint(step, state):
        saved.append(step)

    orch = Orchestrator(config=OrchestratorConfig(max_steps=10, groups_per_step=2, rollouts_per_group=2,
                                                  max_failed_steps=3, max_off_policy_steps=0),
                        environment=_long_prompt_env(), client=client, trainer=policy, weight_sync=policy,
                        sampling=SamplingConfig(max_tokens=8), on_step=delivered.append, checkpoint=checkpoint)
    with pytest.raises(RunFailedError) as info:
        await asyncio.wait_for(orch.run(), timeout=60)
    message = str(info.value)
    print(message)
    assert "\n" not in message
    assert message.startswith("no usable rollout in 3 steps in a row (steps 0-2): 12 of 12 rollouts failed with "
                              "ContextLengthError: prompt of ")
    assert re.search(r"prompt of 2,\d{3} tokens exceeds tiny-moe's context of 2,048 tokens: use a model with a "
                     r"longer context, shorter prompts \(the environment's args\), or inference.max_model_len$",
                     message), message
    # exactly max_failed_steps steps ran, none trained, and each one's metrics were delivered
    assert policy.trained_steps == []
    assert [m["step"] for m in delivered] == [0, 1, 2] and info.value.history == delivered
    assert [m["failed_steps"] for m in delivered] == [1, 2, 3]
    assert all(m["samples"] == 0 and m["rollout_errors"] == 4 for m in delivered)
    assert all("exceeds tiny-moe's context of 2,048 tokens" in m["first_error"] for m in delivered)
    assert saved == [1, 2]  # the step that ends the run is not checkpointed
    await token_client.aclose()


class UngradedEnv(PickTokenEnv):
    """PickTokenEnv whose grader gives no reward: every rollout scored 0 with a `grader_error` (a verifier that never
    wrote one), or, with `tampering`, scored 0 because the grader caught it (a grade of its own)."""

    def __init__(self, *, tampering: bool = False, rejected: bool = False) -> None:
        super().__init__()
        self.tampering, self.rejected = tampering, rejected

    async def run_group(self, client, task, *, n, sampling):
        rollouts = await super().run_group(client, task, n=n, sampling=sampling)
        for rollout in rollouts:
            rollout.reward = 0.0
            if self.tampering:
                rollout.grader_error = "tampering suspected: reward.txt changed after test.sh exited"
                rollout.metrics["grader/tamper_suspected"] = 1.0
            elif self.rejected:
                rollout.grader_error = "grading: the workdir holds 200,001 files (at most 200,000)"
                rollout.metrics["grader/workdir_rejected"] = 1.0
            else:
                rollout.grader_error = "the verifier wrote no reward file (/logs/verifier/reward.txt)"
        return rollouts


async def test_a_run_whose_grader_gives_no_reward_stops_after_max_failed_steps():
    """Rewards of 0 the grader never gave train nothing: each such step fails, and the run stops with the grader's
    error; rollouts scored 0 for tampering are the grader's own verdict and keep training."""
    policy = TabularPolicy(tasks=6)
    delivered = []
    orch = Orchestrator(config=OrchestratorConfig(max_steps=10, groups_per_step=2, rollouts_per_group=2,
                                                  max_failed_steps=3, max_off_policy_steps=0),
                        environment=UngradedEnv(), client=policy, trainer=policy, weight_sync=policy,
                        sampling=SamplingConfig(), on_step=delivered.append)
    with pytest.raises(RunFailedError) as info:
        await asyncio.wait_for(orch.run(), timeout=60)
    assert str(info.value) == (
        "no usable rollout in 3 steps in a row (steps 0-2): 12 of 12 rollouts failed with no reward from the grader: "
        "the verifier wrote no reward file (/logs/verifier/reward.txt): see the run folder's logs/"), str(info.value)
    assert policy.trained_steps == [] and [m["grader_errors"] for m in delivered] == [4.0, 4.0, 4.0]
    assert all(m["first_error"].startswith("no reward from the grader: the verifier") for m in delivered)

    for verdict in ({"tampering": True}, {"rejected": True}):  # the grader's own 0s
        caught = TabularPolicy(tasks=6)
        history = await asyncio.wait_for(_orchestrator(caught, UngradedEnv(**verdict), max_steps=4,
                                                       groups_per_step=2, rollouts_per_group=2, max_failed_steps=3,
                                                       max_off_policy_steps=0).run(), timeout=60)
        assert caught.trained_steps == [0, 1, 2, 3] and all(m["samples"] == 4 for m in history), verdict
        # every rollout 0: each group's advantages are all 0, counted as groups without signal
        assert [(m["groups"], m["groups_without_signal"]) for m in history] == [(2.0, 2.0)] * 4


async def test_unreachable_inference_is_named():
    policy = TabularPolicy(tasks=6)
    client = _token_client("http://127.0.0.1:9", context=None)  # nothing listens on port 9 (discard)
    orch = Orchestrator(config=OrchestratorConfig(max_steps=5, groups_per_step=1, rollouts_per_group=2,
                                                  max_failed_steps=1),
                        environment=_long_prompt_env(), client=client, trainer=policy, weight_sync=policy,
                        sampling=SamplingConfig(max_tokens=8))
    with pytest.raises(RunFailedError) as info:
        await asyncio.wait_for(orch.run(), timeout=60)
    message = str(info.value)
    print(message)
    assert message.startswith("no usable rollout in 1 step in a row (step 0): 2 of 2 rollouts failed with "
                              "InferenceError: http://127.0.0.1:9/inference/v1/generate: ConnectError")
    assert message.endswith("inference is unreachable: check that the vLLM server is up "
                            "(its log is in the run folder's logs/)")
    await client.aclose()


class FailingGroupsEnv(PickTokenEnv):
    """PickTokenEnv whose listed groups (in start order) come back with every rollout errored."""

    def __init__(self, failing: set[int], error: str = "RuntimeError: the sandbox died") -> None:
        super().__init__()
        self.failing = failing
        self.error = error
        self.started = 0

    async def run_group(self, client, task, *, n, sampling):
        index = self.started
        self.started += 1
        if index in self.failing:
            return [Rollout(task=task, error=self.error) for _ in range(n)]
        return await super().run_group(client, task, n=n, sampling=sampling)


async def test_a_good_step_resets_the_failed_step_count():
    policy = TabularPolicy(tasks=6)
    delivered = []
    # synchronous, one group per step: group i feeds step i
    env = FailingGroupsEnv({0, 1, 3, 4})
    orch = Orchestrator(config=OrchestratorConfig(max_steps=6, groups_per_step=1, rollouts_per_group=2,
                                                  max_off_policy_steps=0, max_failed_steps=3),
                        environment=env, client=policy, trainer=policy, weight_sync=policy,
                        sampling=SamplingConfig(), on_step=delivered.append)
    history = await asyncio.wait_for(orch.run(), timeout=60)
    assert [m["failed_steps"] for m in history] == [1, 2, 0, 1, 2, 0]
    assert policy.trained_steps == [2, 5] and delivered == history
    # the same pattern with one more failure in a row stops the run at the third
    policy = TabularPolicy(tasks=6)
    orch = Orchestrator(config=OrchestratorConfig(max_steps=6, groups_per_step=1, rollouts_per_group=2,
                                                  max_off_policy_steps=0, max_failed_steps=3),
                        environment=FailingGroupsEnv({0, 2, 3, 4}), client=policy, trainer=policy,
                        weight_sync=policy, sampling=SamplingConfig())
    with pytest.raises(RunFailedError) as info:
        await asyncio.wait_for(orch.run(), timeout=60)
    print(info.value)
    assert str(info.value) == ("no usable rollout in 3 steps in a row (steps 2-4): 6 of 6 rollouts failed with "
                               "RuntimeError: the sandbox died: see the run folder's logs/")
    assert policy.trained_steps == [1]


def test_failure_hints_by_error():
    from agentrl.rl.orchestrator import describe_failure, failure_hint

    vllm_400 = ("InferenceError: http://127.0.0.1:8000/inference/v1/generate answered 400: {\"error\": {\"message\": "
                "\"This model's maximum context length is 2048 tokens. However, your prompt contains 5210 input tokens")
    assert failure_hint(vllm_400).startswith("prompt of 5,210 tokens exceeds the model's context of 2,048: use a model")
    image = ("NotFoundError: sandbox image 'agentrl-swe/attrs:25.1.0' is not in the local Docker engine; build it "
             "(agentrl sandbox build-base makes agentrl-base:bookworm) or docker pull/load it")
    assert failure_hint(image, env_name="swe") == "build it: agentrl env check swe lists what is missing"
    assert failure_hint("ValueError: bad row") == "see the run folder's logs/"
    errors = ["RuntimeError: port 4001 busy", None, "RuntimeError: port 4002 busy", "KeyError: 'x'"]
    assert describe_failure(errors, steps=[7]).startswith(
        "no usable rollout in 1 step in a row (step 7): 2 of 4 rollouts failed with RuntimeError: port 4001 busy")
    assert "ended without an error" in describe_failure([None, None], steps=[0, 1])


@pytest.mark.parametrize("value", [0, -1])
def test_max_failed_steps_must_be_positive(value):
    with pytest.raises(ConfigError, match="orchestrator.max_failed_steps"):
        OrchestratorConfig(max_failed_steps=value)


# ---- Router Replay never turns itself off silently -------------------------------------

MOE_LAYERS, TOP_K = 2, 2


class RoutedPickTokenEnv(PickTokenEnv):
    """PickTokenEnv whose turns carry routed experts, as vLLM's would; `bad_tasks` get a layout of the wrong top_k."""

    def __init__(self, bad_tasks: set[int] = frozenset()) -> None:
        super().__init__()
        self.bad_tasks = bad_tasks

    async def run_group(self, client, task, *, n, sampling):
        import numpy as np

        from agentrl.routed import RoutedExperts

        rollouts = await super().run_group(client, task, n=n, sampling=sampling)
        top_k = TOP_K + 1 if task.example_id in self.bad_tasks else TOP_K
        for rollout in rollouts:
            turn = rollout.turns[0]
            prompt = np.zeros((len(turn.prompt_token_ids), MOE_LAYERS, top_k), dtype=np.int16)
            completion = np.full((len(turn.completion.token_ids), MOE_LAYERS, top_k), -1, dtype=np.int16)
            turn.prompt_routed_experts = RoutedExperts(prompt)
            turn.completion.routed_experts = RoutedExperts(completion)  # the last sampled token: never forwarded
        return rollouts


class PackingPolicy(TabularPolicy):
    """TabularPolicy whose steps also pack the samples for R3 with the trainer's packer and report as the trainer does."""

    async def train_step(self, samples, *, step):
        from agentrl.trainer.packing import pack_samples

        metrics = await super().train_step(samples, step=step)
        batch = pack_samples(samples, row_tokens=16, moe_layers=MOE_LAYERS, top_k=TOP_K)
        replayed = sum(int((row.replay_mask & row.loss_mask).sum()) for row in batch.rows)
        metrics["loss_tokens"] = float(batch.loss_tokens)
        metrics["replayed_fraction"] = replayed / max(batch.loss_tokens, 1)
        metrics.update({f"replay_skipped_{k}": float(v) for k, v in batch.replay_skipped.items()})
        return metrics


async def test_replayed_fraction_is_in_every_step_and_a_shortfall_warns_once():
    import warnings as warnings_module

    policy = PackingPolicy(tasks=6)
    orch = _orchestrator(policy, RoutedPickTokenEnv(bad_tasks={2}), max_steps=4, groups_per_step=6,
                         rollouts_per_group=2, max_off_policy_steps=0)
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always")
        history = await orch.run()
    replay_warnings = [w for w in caught if "Router Replay" in str(w.message)]
    assert len(replay_warnings) == 1 and replay_warnings[0].category is RuntimeWarning
    message = str(replay_warnings[0].message)
    print(message)
    assert "\n" not in message
    assert message == ("Router Replay replayed 83.3% of step 0's loss tokens although its samples carried routed "
                       "experts: 2 loss tokens of samples whose routed experts do not fit a packed row (their "
                       "(layers, top_k) is not the model's MoE layers and top_k)")
    for metrics in history:  # every step: task 2's group (2 of 12 loss tokens) is routed live
        assert metrics["r3/replayed_fraction"] == pytest.approx(10 / 12)
        assert metrics["train/replay_skipped_layout"] == 2
    assert history[0]["r3/warning"] == message and all("r3/warning" not in m for m in history[1:])


async def test_full_replay_reports_one_and_never_warns():
    import warnings as warnings_module

    policy = PackingPolicy(tasks=6)
    orch = _orchestrator(policy, RoutedPickTokenEnv(), max_steps=3, groups_per_step=6, rollouts_per_group=2)
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always")
        history = await orch.run()
    assert not [w for w in caught if "Router Replay" in str(w.message)]
    assert [m["r3/replayed_fraction"] for m in history] == [1.0, 1.0, 1.0]
    # without routed experts there is no R3 metric at all
    history = await _orchestrator(TabularPolicy(tasks=6), PickTokenEnv(), max_steps=2).run()
    assert all("r3/replayed_fraction" not in m for m in history)


class WatchedPolicy(TabularPolicy):
    """A weight sync with `watch` (as `WeightPush` has for direct transports)."""

    def __init__(self, *, fail: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail = fail
        self.watching = asyncio.Event()
        self.watch_cancelled = False

    async def chat(self, messages, *, tools=None, sampling, previous=None):
        if self.fail and self.pushed_versions:
            await asyncio.Event().wait()  # a held server: rollouts after the first push never finish
        return await super().chat(messages, tools=tools, sampling=sampling, previous=previous)

    async def watch(self):
        from agentrl.inference.weights import WeightUpdateError

        self.watching.set()
        try:
            while True:
                await asyncio.sleep(0.01)
                if self.fail and self.pushed_versions:
                    raise WeightUpdateError("inference server(s) http://127.0.0.1:1 restarted and the trainer "
                                            "could not send them the current weights through ipc: gone")
        except asyncio.CancelledError:
            self.watch_cancelled = True
            raise


async def test_a_failing_weight_watch_ends_the_run_while_rollouts_wait():
    from agentrl.inference.weights import WeightUpdateError

    policy = WatchedPolicy(fail=True, tasks=6)
    orch = _orchestrator(policy, PickTokenEnv(), max_steps=4, groups_per_step=2, rollouts_per_group=2,
                         max_off_policy_steps=0)
    with pytest.raises(WeightUpdateError, match="restarted and the trainer could not send"):
        await asyncio.wait_for(orch.run(), timeout=30)
    assert policy.trained_steps == [0]  # the second step's rollouts were waiting on the held server


async def test_the_weight_watch_runs_for_the_whole_run_and_is_cancelled_at_its_end():
    policy = WatchedPolicy(fail=False, tasks=6)
    orch = _orchestrator(policy, PickTokenEnv(), max_steps=3, groups_per_step=2, rollouts_per_group=2)
    history = await asyncio.wait_for(orch.run(), timeout=30)
    assert len(history) == 3 and policy.watching.is_set() and policy.watch_cancelled


class SplitEnv(PickTokenEnv):
    """PickTokenEnv whose "test" split is its own task objects (example ids 100+), asked by the same prompts."""

    def __init__(self) -> None:
        super().__init__(tasks=4)
        self.test_tasks = [Task(prompt=task.prompt, answer=task.answer, example_id=100 + i)
                           for i, task in enumerate(self._tasks)]
        self.evaluated: list[int] = []

    def tasks(self, split="test", *, n=None, seed=0):
        return (self.test_tasks if split == "test" else self._tasks)[:n] if n else list(
            self.test_tasks if split == "test" else self._tasks)

    async def run_group(self, client, task, *, n, sampling):
        if task.example_id >= 100:
            self.evaluated.append(task.example_id)
        return await super().run_group(client, task, n=n, sampling=sampling)


async def test_held_out_evaluations_run_beside_the_loop_and_the_last_sees_the_final_weights():
    from agentrl.rl.heldout import EvalSection, HeldOutEval

    policy = TabularPolicy(tasks=4, delay_s=0.001)
    env = SplitEnv()
    heldout = HeldOutEval(EvalSection(every=4, tasks=4, rollouts_per_task=8), environment=env, client=policy,
                          sampling=SamplingConfig(), train_split="train")
    orch = Orchestrator(config=OrchestratorConfig(max_steps=12, groups_per_step=4, rollouts_per_group=8,
                                                  task_split="train", checkpoint_every=0),
                        environment=env, client=policy, trainer=policy, weight_sync=policy,
                        sampling=SamplingConfig(), heldout=heldout)
    history = await orch.run()
    evals = [row for row in history if "eval/mean_reward" in row]
    assert [row["eval/step"] for row in evals] == [3, 7, 11]  # after steps 4, 8 and at the end
    assert history[-1]["eval/step"] == 11 and history[-1]["eval/versions"] == [12]  # the final weights alone
    assert set(env.evaluated) == {100, 101, 102, 103} and len(env.evaluated) == 3 * 4
    assert evals[-1]["eval/mean_reward"] > evals[0]["eval/mean_reward"]  # it measures the policy as it learns
    for row in evals:
        assert row["eval/mean_reward_low"] <= row["eval/mean_reward"] <= row["eval/mean_reward_high"]
        assert 0 <= row["eval/pass@1"] <= row["eval/pass@8"] <= 1 and row["eval/tasks"] == 4


def test_held_out_evaluation_refuses_the_training_split_and_groups_of_one():
    from agentrl.rl.heldout import EvalSection, HeldOutEval

    with pytest.raises(ConfigError, match="eval.split='train' is the split the run trains on"):
        HeldOutEval(EvalSection(every=2, split="train"), environment=SplitEnv(), client=None,
                    sampling=SamplingConfig(), train_split="train")
    with pytest.raises(ConfigError, match="rollouts_per_group = 1: .* every advantage is 0"):
        OrchestratorConfig(rollouts_per_group=1)
