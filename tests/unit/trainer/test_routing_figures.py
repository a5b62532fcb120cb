"""The specialisation figures `agentrl pretrain` reports, on tiny-moe and on hand-made tables."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.models import ensure_model
from agentrl.rl.pretrain import _LoadBalancer, _samples
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.routing_figures import TOKEN_CLASSES, _flipped, _nmi, heldout_figures, token_classes
from agentrl.trainer.trainer import Trainer


@pytest.fixture(scope="module")
def tiny():
    model_dir = ensure_model("tiny-moe")
    config = TrainerConfig.model_validate({"model": str(model_dir), "loss": {"mode": "sft"}, "row_tokens": 64,
                                           "parallel": {"activation_checkpointing": False}})
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Trainer(config, model_dir=model_dir), tokenizer


def _rows(trainer, tokenizer, text: str, count: int = 2):
    ids = tokenizer(text * 20, add_special_tokens=False)["input_ids"]
    return trainer.pack(_samples(ids, length=64, count=count)).rows


def test_nmi_is_one_when_the_expert_decides_the_class_and_zero_when_independent():
    assert _nmi(torch.eye(4, dtype=torch.float64) * 10) == pytest.approx(1.0)
    independent = torch.outer(torch.tensor([1.0, 2, 3], dtype=torch.float64), torch.tensor([4.0, 5], dtype=torch.float64))
    assert _nmi(independent) == pytest.approx(0.0, abs=1e-12)


def test_a_flip_swaps_the_weakest_chosen_expert_for_the_best_unchosen():
    choice = torch.tensor([[0.9, 0.1, 0.5, 0.7, 0.2]])
    ids = torch.tensor([[0, 3]])
    assert sorted(_flipped(ids, choice)[0].tolist()) == [0, 2]


def test_token_classes_of_the_character_vocabulary(tiny):
    _, tokenizer = tiny
    classes = token_classes(tokenizer, len(tokenizer))
    named = {text: TOKEN_CLASSES[classes[tokenizer.convert_tokens_to_ids(text)]] for text in "aZ7 (\n"}
    assert named == {"a": "lower", "Z": "upper", "7": "digit", " ": "space", "(": "punct", "\n": "newline"}
    assert TOKEN_CLASSES[classes[tokenizer.convert_tokens_to_ids("<|im_end|>")]] == "other"


def test_figures_on_tiny_moe_and_a_flip_that_costs_nothing_when_experts_answer_zero(tiny):
    trainer, tokenizer = tiny
    rows = _rows(trainer, tokenizer, "def add(a, b):\n    return a + b  # 42\n")
    classes = token_classes(tokenizer, trainer.args.vocab_size)
    figures = heldout_figures(trainer, rows, classes=classes, flip_layers=8)
    assert trainer.model.training  # put back as it was
    assert figures["heldout_nll"] == pytest.approx(math.log(trainer.args.vocab_size), rel=0.2)  # created weights
    for layer in figures["layers"]:
        assert 0.5 < layer["router_entropy"] <= 1.0
        assert sum(expert["load"] for expert in layer["experts"]) == pytest.approx(1.0, abs=1e-3)
        assert layer["load_max_over_mean"] >= 1.0 and 0.0 <= layer["class_nmi"] <= 1.0
        assert layer["flip_kl"] > 0
    blocks = trainer.model.moe_blocks()
    saved = [block.experts.w2_EDF.detach().clone() for block in blocks]
    try:
        with torch.no_grad():
            for block in blocks:
                block.experts.w2_EDF.zero_()
        silent = heldout_figures(trainer, rows, classes=classes, flip_layers=8)
    finally:
        with torch.no_grad():
            for block, weight in zip(blocks, saved):
                block.experts.w2_EDF.copy_(weight)
    assert all(layer["flip_kl"] == 0.0 for layer in silent["layers"])
    assert silent["layers"][0]["class_nmi"] == pytest.approx(figures["layers"][0]["class_nmi"], abs=0.05)


def test_load_balancer_raises_the_bias_of_idle_experts_and_lowers_the_busy_ones(tiny):
    trainer, tokenizer = tiny
    blocks = trainer.model.moe_blocks()
    before = [block.expert_bias.clone() for block in blocks]
    balancer = _LoadBalancer(blocks, rate=0.01)
    try:
        trainer.train_on_samples(_samples(tokenizer("x = 1\n" * 40, add_special_tokens=False)["input_ids"],
                                          length=64, count=2))
        counts = [count.clone() for count in balancer.counts]
        balancer.update()
        after = [block.expert_bias.clone() for block in blocks]
    finally:
        balancer.close()
        with torch.no_grad():
            for block, bias in zip(blocks, before):
                block.expert_bias.copy_(bias)
    for count, moved, bias in zip(counts, after, before):
        busiest, idlest = int(count.argmax()), int(count.argmin())
        assert count[busiest] > count.mean() > count[idlest]
        assert float(moved[busiest] - bias[busiest]) == pytest.approx(-0.01)
        assert float(moved[idlest] - bias[idlest]) == pytest.approx(0.01)
    assert all(count.sum() == 0 for count in balancer.counts)
