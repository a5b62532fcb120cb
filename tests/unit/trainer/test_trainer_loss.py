"""Loss, trust-region masking, advantages and packing against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from agentrl.config import config_from_dict
from agentrl.errors import AgentrlError, ConfigError
from agentrl.rl.advantages import batch_advantages, group_advantages
from agentrl.trainer.loss import LossConfig, compute_loss, is_max_stat
from agentrl.trainer.packing import pack_samples
from agentrl.types import TrainingSample

LN2, LN10 = math.log(2.0), math.log(10.0)


def _inputs():
    inference = torch.tensor([-1.0, -1.0, -3.0, -0.5, -0.7])
    log_ratio = torch.tensor([0.0, LN2, LN10, -LN2, 5.0])  # ratios 1, 2, 10 (outside [1/8, 8]), 0.5; last not a loss token
    logprobs = (inference + log_ratio).requires_grad_(True)
    return logprobs, inference, torch.tensor([1.0, 1.0, 1.0, -2.0, 3.0]), torch.tensor([True, True, True, True, False])


def test_rl_loss_masking_and_gradient_by_hand():
    logprobs, inference, advantages, mask = _inputs()
    config = LossConfig(ratio_low=0.125, ratio_high=8.0, kl_coef=0.1)
    loss, stats = compute_loss(logprobs, inference_logprobs=inference, advantages=advantages, loss_mask=mask,
                               total_loss_tokens=10, config=config)
    # kept tokens 0, 1, 3: pg = -1, -2, +1; k3 = 0, 1-ln2, -0.5+ln2
    assert loss.item() == pytest.approx((-2.0 + 0.1 * 0.5) / 10, abs=1e-6)
    assert stats["loss_tokens"].item() == 4 and stats["masked_tokens"].item() == 1
    assert stats["mismatch_kl_sum"].item() == pytest.approx((1 - LN2) + (9 - LN10) + (LN2 - 0.5), abs=1e-5)
    loss.backward()
    # d/dlp (-r A + kl (r - 1 - log r)) = -r A + kl (r - 1), over N = 10
    expected = torch.tensor([-0.1, (-2 + 0.1) / 10, 0.0, (1 - 0.05) / 10, 0.0])
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-6, rtol=0)


def test_ratio_bounds_are_configurable():
    logprobs, inference, advantages, mask = _inputs()
    loss, stats = compute_loss(logprobs, inference_logprobs=inference, advantages=advantages, loss_mask=mask,
                               total_loss_tokens=4, config=LossConfig(ratio_low=0.75, ratio_high=20.0))
    # now token 2 (ratio 10) is kept and token 3 (ratio 0.5) masked: pg = -1 - 2 - 10
    assert loss.item() == pytest.approx(-13.0 / 4, abs=1e-6)
    assert stats["masked_tokens"].item() == 1


def test_sft_loss_is_mean_nll_over_loss_tokens():
    logprobs, inference, advantages, mask = _inputs()
    loss, stats = compute_loss(logprobs, inference_logprobs=inference, advantages=advantages, loss_mask=mask,
                               total_loss_tokens=4, config=LossConfig(mode="sft"))
    expected = -(logprobs.detach()[:4].sum()) / 4
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


def test_bad_ratio_bounds_are_a_config_error():
    with pytest.raises(ConfigError, match="ratio_low"):
        config_from_dict(LossConfig, {"ratio_low": 2.0, "ratio_high": 8.0})


def test_group_advantages_by_hand():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    normalized = group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True, eps=0.0)
    assert normalized == [1.0, -1.0, -1.0, 1.0]  # population std 0.5
    assert group_advantages([3.0, 3.0], std_normalize=True) == [0.0, 0.0]
    assert batch_advantages([[2.0, 4.0], [1.0]]) == [[-1.0, 1.0], [0.0]]
    with pytest.raises(AgentrlError, match="empty"):
        group_advantages([])
    with pytest.raises(AgentrlError, match="NaN"):
        group_advantages([float("nan"), 1.0])


def test_negative_advantages_are_scaled_after_centering_and_normalizing():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], negative_scale=0.0) == [0.5, 0.0, 0.0, 0.5]
    assert group_advantages([1.0, 0.0, 0.0, 0.0], negative_scale=0.5) == [0.75, -0.125, -0.125, -0.125]
    normalized = group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True, eps=0.0, negative_scale=0.25)
    assert normalized == [1.0, -0.25, -0.25, 1.0]
    assert batch_advantages([[2.0, 4.0]], negative_scale=0.0) == [[0.0, 1.0]]
    with pytest.raises(AgentrlError, match="negative_scale=1.5"):
        group_advantages([1.0, 0.0], negative_scale=1.5)


def _sample(tokens, mask, *, advantage, experts=None):
    return TrainingSample(
        token_ids=tokens, loss_mask=mask, inference_logprobs=[-0.5 if m else 0.0 for m in mask],
        policy_versions=[3 if m else -1 for m in mask], advantage=advantage, routed_experts=experts,
    )


def test_packing_layout_by_hand():
    a = _sample([10, 11, 12, 13], [False, False, True, True], advantage=1.5,
                experts=[[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]])
    b = _sample([20, 21, 22], [False, True, True], advantage=-1.0, experts=[[[1, 2]], [], [[3, 4]]])
    c = _sample([30, 31, 32, 33, 34, 35], [False, True, True, True, True, True], advantage=0.0)
    batch = pack_samples([a, b, c], row_tokens=6, moe_layers=1, top_k=2)
    # first-fit decreasing: c (5 tokens) alone, then a (3) + b (2) share a row with 1 pad token
    assert [row.sample_indices for row in batch.rows] == [[2], [0, 1]]
    row = batch.rows[1]
    assert row.tokens.tolist() == [10, 11, 12, 20, 21, 0]
    assert row.positions.tolist() == [0, 1, 2, 0, 1, 0]
    assert row.targets.tolist() == [11, 12, 13, 21, 22, 0]
    assert row.loss_mask.tolist() == [False, True, True, True, True, False]
    assert row.inference_logprobs.tolist() == [0.0, -0.5, -0.5, -0.5, -0.5, 0.0]
    assert row.advantages.tolist() == [1.5, 1.5, 1.5, -1.0, -1.0, 0.0]
    assert row.policy_versions.tolist() == [-1, 3, 3, 3, 3, -1]
    assert row.replay_mask.tolist() == [True, True, True, True, False, False]
    assert row.routed_experts[:, 0].tolist()[:4] == [[0, 1], [2, 3], [4, 5], [1, 2]]
    assert batch.loss_tokens == 4 + 5 and batch.policy_version == 3
    assert len(pack_samples([a], row_tokens=8, min_rows=3).rows) == 3


def test_packing_errors_name_the_sample():
    long = _sample(list(range(10)), [True] * 10, advantage=0.0)
    with pytest.raises(AgentrlError, match="sample 1 has 10 tokens, more than the row budget"):
        pack_samples([_sample([1, 2], [False, True], advantage=0.0), long], row_tokens=8)
    broken = TrainingSample(token_ids=[1, 2, 3], loss_mask=[True], inference_logprobs=[0.0] * 3, policy_versions=[0] * 3)
    with pytest.raises(AgentrlError, match="sample 0: loss_mask has 1 entries for 3 tokens"):
        pack_samples([broken], row_tokens=8)


def test_packing_reads_vllm_all_layer_expert_layout():
    # vLLM reports experts for every layer (dense layer 0 holds zeros); the trainer replays MoE layers 1 and 2
    all_layers = [[[0, 0], [1, 2], [3, 4]], [[0, 0], [5, 6], [7, 0]], [[0, 0], [1, 1], [2, 2]]]
    sample = _sample([1, 2, 3], [False, True, True], advantage=1.0, experts=all_layers)
    row = pack_samples([sample], row_tokens=4, moe_layers=2, top_k=2, moe_layer_indices=[1, 2], num_layers=3).rows[0]
    assert row.replay_mask.tolist() == [True, True, False, False]
    assert row.routed_experts[:2].tolist() == [[[1, 2], [3, 4]], [[5, 6], [7, 0]]]
    # without the layer map the 3-layer lists do not fit 2 MoE layers: those tokens are routed live
    row = pack_samples([sample], row_tokens=4, moe_layers=2, top_k=2).rows[0]
    assert row.replay_mask.tolist() == [False, False, False, False]


def test_packing_expert_arrays_with_unknown_rows_match_the_nested_list_form():
    # vLLM layout: 3 layers (dense layer 0 zeros), top-2; -1 marks what inference did not report
    a_rows = np.array([[[0, 0], [1, 2], [3, 4]],
                       [[0, 0], [-1, -1], [-1, -1]],  # unknown token (the old `[[], [], []]`)
                       [[0, 0], [5, 6], [-1, -1]],  # one MoE layer unknown: routed live
                       [[0, 0], [7, 1], [2, 3]],
                       [[-1, -1], [-1, -1], [-1, -1]]])  # the last sampled token (never an input)
    a = _sample([1, 2, 3, 4, 5], [False, True, True, True, True], advantage=1.0, experts=a_rows)
    b = _sample([6, 7, 8, 9], [False, False, True, True], advantage=-1.0,
                experts=np.array([[[0, 0], [4, 5], [6, 7]]]))  # fewer rows than tokens
    c = _sample([10, 11, 12], [False, True, True], advantage=0.0)  # no experts at all
    kwargs = {"row_tokens": 10, "moe_layers": 2, "top_k": 2, "moe_layer_indices": [1, 2], "num_layers": 3}
    batch = pack_samples([a, b, c], **kwargs)
    assert [row.sample_indices for row in batch.rows] == [[0, 1, 2]]
    row = batch.rows[0]
    assert row.routed_experts.dtype == torch.long and row.routed_experts.shape == (10, 2, 2)
    assert row.replay_mask.tolist() == [True, False, False, True, True, False, False, False, False, False]
    zero = [[0, 0], [0, 0]]
    assert row.routed_experts.tolist() == [[[1, 2], [3, 4]], zero, zero, [[7, 1], [2, 3]],
                                           [[4, 5], [6, 7]], zero, zero, zero, zero, zero]
    # the same samples in the old nested-list form (unknown = empty lists) pack to the same row
    ragged = [[[0, 0], [1, 2], [3, 4]], [[], [], []], [[0, 0], [5, 6], []], [[0, 0], [7, 1], [2, 3]], [[], [], []]]
    old_form = [_sample([1, 2, 3, 4, 5], [False, True, True, True, True], advantage=1.0, experts=ragged),
                _sample([6, 7, 8, 9], [False, False, True, True], advantage=-1.0, experts=[[[0, 0], [4, 5], [6, 7]]]), c]
    again = pack_samples(old_form, **kwargs).rows[0]
    for name in ("tokens", "positions", "targets", "loss_mask", "inference_logprobs", "advantages",
                 "policy_versions", "routed_experts", "replay_mask"):
        assert torch.equal(getattr(again, name), getattr(row, name)), name
    # a layout that fits neither the MoE layers nor the layer map replays nothing
    assert not pack_samples([a], row_tokens=6, moe_layers=3, top_k=1).rows[0].replay_mask.any()


def test_non_finite_inference_logprobs_are_masked_not_propagated():
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -1.5], requires_grad=True)
    inference = torch.tensor([-1.0, float("nan"), float("-inf"), -1e30])
    loss, stats = compute_loss(logprobs, inference_logprobs=inference, advantages=torch.ones(4),
                               loss_mask=torch.ones(4, dtype=torch.bool), total_loss_tokens=4,
                               config=LossConfig(kl_coef=0.1))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert stats["masked_tokens"].item() == 3  # NaN, -inf, and a ratio far outside the region
    assert loss.item() == pytest.approx(-1.0 / 4)  # only token 0 (ratio 1, A = 1) counts
    torch.testing.assert_close(logprobs.grad, torch.tensor([-0.25, 0.0, 0.0, 0.0]))


def test_mismatch_kl_of_the_on_policy_tokens_alone():
    logprobs, inference, advantages, mask = _inputs()
    on_policy = torch.tensor([True, False, False, True, True])  # the last is not a loss token
    _, stats = compute_loss(logprobs, inference_logprobs=inference, advantages=advantages, loss_mask=mask,
                            total_loss_tokens=10, config=LossConfig(), on_policy=on_policy)
    assert stats["on_policy_tokens"].item() == 2
    assert stats["mismatch_kl_on_policy_sum"].item() == pytest.approx(0.0 + (LN2 - 0.5), abs=1e-6)
    _, plain = compute_loss(logprobs, inference_logprobs=inference, advantages=advantages, loss_mask=mask,
                            total_loss_tokens=10, config=LossConfig())
    assert "on_policy_tokens" not in plain


def test_large_deviations_and_the_largest_log_ratio():
    inference = torch.tensor([-1.0, -1.0, -2.0, -0.5, -0.3])
    log_ratio = torch.tensor([0.1, 0.8, -1.2, -0.5, 4.0])  # 2x is ln 2 = 0.69: tokens 1 and 2; the last is no loss token
    mask = torch.tensor([True, True, True, True, False])
    on_policy = torch.tensor([True, False, True, True, True])
    _, stats = compute_loss(inference + log_ratio, inference_logprobs=inference, advantages=torch.ones(5),
                            loss_mask=mask, total_loss_tokens=4, config=LossConfig(), on_policy=on_policy)
    assert stats["mismatch_large_tokens"].item() == 2 and stats["mismatch_large_on_policy_tokens"].item() == 1
    assert stats["mismatch_max_log_ratio"].item() == pytest.approx(1.2, abs=1e-6)
    assert is_max_stat("mismatch_max_log_ratio") and not is_max_stat("mismatch_large_tokens")


def test_packing_marks_each_token_with_its_samples_oldest_version():
    spanning = TrainingSample(token_ids=[1, 2, 3, 4, 5], loss_mask=[False, True, True, True, True],
                              inference_logprobs=[0.0, -0.1, -0.1, -0.1, -0.1], policy_versions=[-1, 4, 4, 5, 5])
    fresh = TrainingSample(token_ids=[6, 7, 8], loss_mask=[False, True, True], inference_logprobs=[0.0, -0.2, -0.2],
                           policy_versions=[-1, 5, 5])
    row = pack_samples([spanning, fresh], row_tokens=8).rows[0]
    assert row.policy_versions.tolist() == [4, 4, 5, 5, 5, 5, -1, -1]  # each target token's own version
    assert row.oldest_versions.tolist() == [4, 4, 4, 4, 5, 5, -1, -1]
