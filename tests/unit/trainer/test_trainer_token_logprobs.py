"""The trainer's per-token logprobs of the recorded samples, from the step's own forward pass.

On the tiny MoE (`agentrl.tiny_moe`, real weights of its character vocabulary) the logprobs a
step returns for the samples asked for equal those of a separate forward of each sample with
the weights before the step; through the real orchestrator, arithmetic environment and
`RolloutLog`, each recorded rollout then carries them aligned with its sample's tokens, a value
on every completion token and None elsewhere.
"""

from __future__ import annotations

import json

from agentrl.rl.groups import merge_token_logprobs
from agentrl.rl.rollout_log import ROLLOUTS_FILE
from agentrl.types import Rollout
from tests.viewer_folders import LocalTrainer, trained_run
from trainer_helpers import make_samples


def test_step_returns_the_logprobs_of_its_own_forward_for_the_asked_samples():
    local = LocalTrainer(row_tokens=64)
    trainer = local.trainer
    samples = make_samples(with_experts=False)
    asked = [1, 4, 5]
    expected = {index: local.forward(samples[index].token_ids) for index in asked}
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


def test_rollout_log_records_the_trainers_logprobs_aligned_with_each_sample(tmp_path):
    path, local = trained_run(tmp_path / "run", steps=2, samples_per_step=3)
    records = [json.loads(line) for line in (path / ROLLOUTS_FILE).read_text().splitlines()]
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
