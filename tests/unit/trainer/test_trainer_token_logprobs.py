"""The trainer's per-token logprobs of the recorded samples, from the step's own forward pass.

On the tiny MoE (`agentrl.created_models`, real weights of its character vocabulary) the logprobs a
step returns for the samples asked for equal those of a separate forward of each sample with
the weights before the step; through the real orchestrator, arithmetic environment and
`RolloutLog`, each recorded rollout then carries them aligned with its sample's tokens, a value
on every completion token and None elsewhere. On two gloo ranks (torchrun, the tiny GLM-4.5)
each rank returns its share (FSDP: its rows' samples; CP: its tokens of every row) and the
shares merge into the single-process step's logprobs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer_helpers import launch_ranks, make_samples

from agentrl.rl.groups import merge_token_logprobs
from agentrl.rl.rollout_log import ROLLOUTS_FILE
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.trainer import Trainer
from agentrl.types import Rollout
from tests.viewer_folders import LocalTrainer, trained_run


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


@pytest.mark.parametrize("layout", ["fsdp", "cp"])
def test_two_ranks_parts_merge_into_the_single_process_logprobs(layout, two_rank_parts, tiny_glm_dir):
    # fsdp: each data-parallel rank holds other rows (other samples); cp: each rank part of every row
    parts = [two_rank_parts[rank][layout] for rank in (0, 1)]
    assert all(parts) and parts[0] != parts[1]  # each rank holds only its share
    samples = make_samples(with_experts=False)
    single = Trainer(TrainerConfig(row_tokens=32), model_dir=tiny_glm_dir, device="cpu")
    want = single.train_on_samples(samples, logprobs_of=range(len(samples)))["token_logprobs"]
    got = merge_token_logprobs(parts)
    assert sorted(got) == list(range(len(samples)))
    for index, values in want.items():
        assert [v is None for v in got[index]] == [v is None for v in values], index
        assert all(abs(a - b) < 1e-5 for a, b in zip(got[index], values) if a is not None), index


@pytest.fixture(scope="module")
def two_rank_parts(tiny_glm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("token-logprobs")
    launch_ranks(Path(__file__).parent / "token_logprobs_worker.py", 2, tiny_glm_dir, out, "fsdp,cp", timeout=600)
    return [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]
