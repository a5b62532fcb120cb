"""Router Replay accounting: every loss token is either replayed or counted with the reason it was not."""

from __future__ import annotations

import numpy as np
import pytest
from trainer_helpers import make_samples

from agentrl.routed import RoutedExperts
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.packing import REPLAY_SKIP_REASONS, pack_samples
from agentrl.trainer.trainer import Trainer
from agentrl.types import TrainingSample


def _sample(tokens, mask, experts=None):
    return TrainingSample(token_ids=tokens, loss_mask=mask, inference_logprobs=[-0.5 if m else 0.0 for m in mask],
                          policy_versions=[1 if m else -1 for m in mask], advantage=1.0, routed_experts=experts)


def test_packing_counts_each_loss_token_that_is_not_replayed():
    unknown = np.array([[[0, 1], [2, 3]], [[-1, -1], [4, 5]], [[1, 2], [3, 4]], [[-1, -1], [-1, -1]]])
    a = _sample([1, 2, 3, 4], [False, True, True, True], unknown)  # loss targets 2, 3, 4; input 1 unknown
    short = _sample([5, 6, 7, 8], [False, False, True, True], np.zeros((1, 2, 2), dtype=np.int16))  # one row for 3 inputs
    none = _sample([9, 10, 11], [False, True, True])  # no experts at all
    wrong = _sample([12, 13, 14], [False, True, True], np.zeros((3, 2, 3), dtype=np.int16))  # top_k 3, the model's is 2
    batch = pack_samples([a, short, none, wrong], row_tokens=16, moe_layers=2, top_k=2)
    replayed = sum(int((row.replay_mask & row.loss_mask).sum()) for row in batch.rows)
    assert batch.replay_skipped == {"no_experts": 2, "layout": 2, "unknown": 1 + 2}
    assert replayed + sum(batch.replay_skipped.values()) == batch.loss_tokens == 3 + 2 + 2 + 2
    assert set(batch.replay_skipped) <= set(REPLAY_SKIP_REASONS)
    assert pack_samples([a, none], row_tokens=16).replay_skipped == {}  # not packed for R3: nothing counted


@pytest.mark.parametrize("router_replay", [True, False])
def test_trainer_metrics_account_for_every_loss_token(tiny_glm_dir, router_replay):
    trainer = Trainer(TrainerConfig(row_tokens=64, router_replay=router_replay, optimizer={"lr": 1e-2}),
                      model_dir=tiny_glm_dir, device="cpu")
    samples = make_samples()  # half of them carry routed experts
    wrong_top_k = RoutedExperts(np.zeros((len(samples[0].token_ids), 2, 3), dtype=np.int16))  # the model's is 2
    samples[0] = samples[0].model_copy(update={"routed_experts": wrong_top_k})
    metrics = trainer.train_on_samples(samples)
    skipped = {k: v for k, v in metrics.items() if k.startswith("replay_skipped_")}
    accounted = metrics["replayed_fraction"] * metrics["loss_tokens"] + sum(skipped.values())
    assert accounted == pytest.approx(metrics["loss_tokens"])
    if router_replay:
        assert 0 < metrics["replayed_fraction"] < 1
        assert skipped["replay_skipped_layout"] > 0 and skipped["replay_skipped_no_experts"] > 0
    else:
        assert metrics["replayed_fraction"] == 0.0
        assert skipped == {"replay_skipped_router_replay_off": metrics["loss_tokens"]}
    assert "replay_skipped_no_experts" not in trainer.train_on_samples(make_samples(with_experts=False))
