"""The trainer's per-token logprobs of the recorded samples, from the step's own forward pass.

On the tiny MoE (`agentrl.tiny_moe`, real weights of its character vocabulary) the logprobs a
step returns for the samples asked for equal those of a separate forward of each sample with
the weights before the step; through the real orchestrator, arithmetic environment and
`RolloutLog`, each recorded rollout then carries them aligned with its sample's tokens, a value
on every completion token and None elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import torch

from agentrl.loader import load_environment
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.rl.groups import merge_token_logprobs
from agentrl.rl.orchestrator import Orchestrator, OrchestratorConfig
from agentrl.rl.rollout_log import RolloutLog
from agentrl.sampling import SamplingConfig
from agentrl.tiny_moe import ensure_tiny_moe
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.models.attention import build_segments
from agentrl.trainer.trainer import Trainer
from agentrl.types import Rollout, TrainingSample
from trainer_helpers import make_samples

VOCAB = 128


def _trainer(row_tokens: int) -> Trainer:
    return Trainer(TrainerConfig(row_tokens=row_tokens, optimizer={"lr": 1e-2}), model_dir=ensure_tiny_moe(),
                   device="cpu")


def _separate_forward(trainer: Trainer, sample: TrainingSample) -> list[float]:
    """Logprob of each token of the sample after the first, from one unpacked forward."""
    ids = torch.tensor(sample.token_ids)
    positions = torch.arange(len(ids) - 1)
    with torch.no_grad():
        return trainer.model(ids[:-1], positions, build_segments(positions), targets_T=ids[1:]).float().tolist()


def test_step_returns_the_logprobs_of_its_own_forward_for_the_asked_samples():
    trainer = _trainer(64)
    samples = make_samples(with_experts=False)
    asked = [1, 4, 5]
    expected = {index: _separate_forward(trainer, samples[index]) for index in asked}
    metrics = trainer.train_on_samples(samples, logprobs_of=asked)
    returned = metrics["token_logprobs"]
    assert sorted(returned) == asked  # only the samples asked for
    for index in asked:
        sample, values = samples[index], returned[index]
        assert len(values) == len(sample.token_ids) and values[0] is None
        for position in range(1, len(values)):
            if sample.loss_mask[position]:
                assert abs(values[position] - expected[index][position - 1]) < 1e-5, (index, position)
            else:
                assert values[position] is None
    again = trainer.train_on_samples(samples)
    assert "token_logprobs" not in again  # nothing asked, nothing returned


def test_ranks_partial_lists_merge_into_one():
    # with CP each rank computes part of a row's tokens; with DP only its rows' samples
    assert merge_token_logprobs([{0: [None, -1.0, None, None]}, {0: [None, None, -2.0, None], 3: [None, -0.5]},
                                 None]) == {0: [None, -1.0, -2.0, None], 3: [None, -0.5]}


class _InVocabulary:
    """The scripted policy with its byte-level token ids folded into the tiny model's 128 ids
    (element-wise, so each turn still extends the previous one)."""

    def __init__(self, policy: ScriptedPolicy) -> None:
        self.policy = policy
        self.name = policy.name

    async def chat(self, messages, **kwargs):
        message, turn = await self.policy.chat(messages, **kwargs)
        turn.prompt_token_ids = [token % VOCAB for token in turn.prompt_token_ids]
        turn.completion.token_ids = [token % VOCAB for token in turn.completion.token_ids]
        return message, turn


def _policy() -> ScriptedPolicy:
    calls = itertools.count()

    def reply(messages, tools):
        if messages[-1].role == "tool":
            return f"<answer>{messages[-1].content if next(calls) % 2 == 0 else '-1'}</answer>"
        expression = messages[-1].content.split("Compute:", 1)[-1].strip()
        return {"content": "", "tool_calls": [tool_call("calculator", expression=expression)]}

    return ScriptedPolicy(reply, name="alternating")


class _LocalTrainer:
    """The real trainer in this process as the orchestrator's `PolicyTrainer` (the launcher uses Ray
    actors); it keeps a separate forward of each asked sample, taken before the step, to compare."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.expected: dict[tuple[int, ...], list[float]] = {}

    async def train_step(self, samples, *, step, logprobs_of=()):
        for index in logprobs_of:
            self.expected[tuple(samples[index].token_ids)] = _separate_forward(self.trainer, samples[index])
        return self.trainer.train_on_samples(samples, logprobs_of=logprobs_of)

    async def save_checkpoint(self, path, *, step):
        pass

    async def push(self, *, version):
        return None


def test_rollout_log_records_the_trainers_logprobs_aligned_with_each_sample(tmp_path):
    local = _LocalTrainer(_trainer(1024))
    log = RolloutLog(tmp_path, samples_per_step=3, max_bytes=2**26)
    orchestrator = Orchestrator(
        config=OrchestratorConfig(max_steps=2, groups_per_step=2, rollouts_per_group=2, max_off_policy_steps=0),
        environment=load_environment("arithmetic", num_train=8, num_test=2), client=_InVocabulary(_policy()),
        trainer=local, weight_sync=local, sampling=SamplingConfig(), on_groups=log,
    )
    asyncio.run(orchestrator.run())
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [record["step"] for record in records] == [0, 0, 0, 1, 1, 1]
    for record in records:
        sample = Rollout.model_validate({key: record[key] for key in ("task", "messages", "turns")}).sample()
        values = record["trainer_logprobs"]
        assert len(values) == len(sample.token_ids)
        completion_tokens = sum(len(turn["completion"]["token_ids"]) for turn in record["turns"])
        assert sum(value is not None for value in values) == completion_tokens == sum(sample.loss_mask)
        expected = local.expected[tuple(sample.token_ids)]
        for position, (value, in_loss) in enumerate(zip(values, sample.loss_mask)):
            if in_loss:
                assert abs(value - expected[position - 1]) < 1e-5, position
            else:
                assert value is None
