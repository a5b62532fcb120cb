"""LoRA in the trainer (`trainer.lora`): exact start, adapters-only updates, PEFT round trip, config errors."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_helpers import make_samples

from agentrl.config import config_from_dict
from agentrl.errors import ConfigError
from agentrl.trainer.config import LoraConfig, TrainerConfig
from agentrl.trainer.models.attention import build_segments
from agentrl.trainer.trainer import Trainer

ALL = ["attention", "experts", "shared_experts"]


def _trainer(model_dir, targets=None, *, lr=5e-2):
    lora = None if targets is None else LoraConfig(rank=4, alpha=8.0, targets=targets)
    return Trainer(TrainerConfig(optimizer={"lr": lr}, lora=lora), model_dir=model_dir)


def _logits(trainer, tokens):
    positions = torch.arange(tokens.shape[0])
    trainer.model.eval()
    with torch.no_grad():
        return trainer.model(tokens, positions, build_segments(positions))


@pytest.mark.parametrize("model", ["glm", "nemotron"])
def test_step_zero_logits_equal_the_base_exactly(model, request):
    model_dir = request.getfixturevalue(f"tiny_{model}_dir")
    tokens = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    adapted = _trainer(model_dir, ALL)
    assert torch.equal(_logits(_trainer(model_dir), tokens), _logits(adapted, tokens))
    names = [n for n, p in adapted.model.named_parameters() if p.requires_grad]
    assert any("experts.w1_EFD_lora_A" in n for n in names) and any(".q_proj.lora_B" in n for n in names)
    assert any("shared_experts" in n for n in names)


def test_a_step_changes_only_the_adapters_and_the_loss_drops(tiny_glm_dir):
    trainer = _trainer(tiny_glm_dir, ALL)
    params = dict(trainer.model.named_parameters())
    trained = {n for n, p in params.items() if p.requires_grad}
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(params[n]) for n in trained}
    assert all(params[n].dtype == torch.float32 for n in trained)
    before = {n: p.detach().clone() for n, p in params.items()}
    batch = trainer.pack(make_samples())  # half the samples carry routed experts: R3 replays them
    assert any(row.routed_experts is not None for row in batch.rows)
    metrics = [trainer.step(batch) for _ in range(4)]
    assert metrics[0]["replayed_fraction"] > 0
    changed = {n for n, p in params.items() if not torch.equal(before[n], p.detach())}
    assert changed == trained  # every adapter moved (B from zero, then A), no base weight did
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.05, [m["loss"] for m in metrics]


@pytest.mark.parametrize("targets", [ALL, ["attention"]])
def test_the_memory_plan_counts_optimizer_state_for_the_adapters_alone(tiny_glm_dir, targets):
    from agentrl.trainer.layout import estimate_memory

    trainer = _trainer(tiny_glm_dir, targets)
    adapters = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in trainer.model.named_parameters() if not p.requires_grad)
    full = estimate_memory(trainer.args, world=1, ep=1, cp=1, row_tokens=64)
    assert full["states"] == 16.0 * total  # the base alone: master weights, gradients, two Adam moments
    assert trainer.plan.memory["states"] == 4.0 * total + 16.0 * adapters  # LoRA: frozen base, adapters trained
    assert trainer.plan.memory["states"] < full["states"] / 2


def test_dcp_checkpoint_holds_adapters_and_resumes(tiny_glm_dir, tmp_path):
    trainer = _trainer(tiny_glm_dir, ["attention", "experts"])
    batch = trainer.pack(make_samples())
    trainer.step(batch)
    trainer.save_checkpoint(tmp_path / "ckpt")
    after_one = trainer.step(batch)["loss"]
    resumed = _trainer(tiny_glm_dir, ["attention", "experts"])
    assert resumed.load_checkpoint(tmp_path / "ckpt") == 1
    assert resumed.step(batch)["loss"] == pytest.approx(after_one, abs=1e-6)


@pytest.mark.parametrize("targets", [["attention", "experts"], ["attention"]])
def test_peft_adapter_round_trip_in_transformers(tiny_glm_dir, tmp_path, targets):
    """An adapter agentrl saves, loaded onto the base folder by transformers 5's PEFT integration
    (`load_adapter`, which converts per-expert adapters to its fused experts), gives agentrl's logits."""
    pytest.importorskip("peft")
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_glm_dir, targets)
    batch = trainer.pack(make_samples())
    for _ in range(3):
        trainer.step(batch)
    out = trainer.export_adapter(tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert ("base_model.model.model.layers.1.mlp.experts.7.down_proj.lora_B.weight" in keys) == ("experts" in targets)
    tokens = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(2))
    ours = _logits(trainer, tokens)
    model = AutoModelForCausalLM.from_pretrained(tiny_glm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base = model(tokens[None]).logits[0]
    model.load_adapter(str(out))
    with torch.no_grad():
        theirs = model(tokens[None]).logits[0]
    assert (base - ours).abs().max() > 0.1  # the adapter changed the model
    assert (theirs - ours).abs().max() < 1e-4
    from agentrl.errors import NotFoundError
    from agentrl.models import resolve_model

    with pytest.raises(NotFoundError, match="holds a LoRA adapter for .*not a model"):  # eval/train --model on it
        resolve_model(out)


def test_full_export_merges_the_adapters(tiny_glm_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_glm_dir, ALL)
    batch = trainer.pack(make_samples())
    for _ in range(2):
        trainer.step(batch)
    trainer.export_hf(tmp_path / "hf", dtype=torch.float32)
    tokens = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        merged = model(tokens[None]).logits[0]
    assert (merged - _logits(trainer, tokens)).abs().max() < 1e-4


@pytest.mark.parametrize(("lora", "field"), [
    ({"rank": 0, "alpha": 8}, "lora.rank"),
    ({"rank": 4, "alpha": 8, "dropout": 1.0}, "lora.dropout"),
    ({"rank": 4, "alpha": 8, "targets": ["mlp"]}, "lora.targets"),
    ({"rank": 4, "alpha": 8, "rnk": 2}, "lora.rnk"),
])
def test_bad_lora_config_is_a_one_line_error_naming_the_field(lora, field):
    with pytest.raises(ConfigError) as error:
        config_from_dict(TrainerConfig, {"lora": lora})
    assert field in str(error.value) and "\n" not in str(error.value)


def test_expert_adapters_under_expert_parallelism_are_refused():
    with pytest.raises(ConfigError, match="trainer.parallel.ep=2"):
        config_from_dict(TrainerConfig, {"lora": {"rank": 4, "alpha": 8}, "parallel": {"ep": 2}})
    config = config_from_dict(TrainerConfig, {"lora": {"rank": 4, "alpha": 8}})
    assert config.layout_ep() == 1 and TrainerConfig().layout_ep() == "auto"


def test_two_ranks_fsdp_and_cp_match_one_process(tiny_glm_dir, tmp_path):
    from pathlib import Path

    from trainer_helpers import launch_ranks, lora_steps

    launch_ranks(Path(__file__).parent / "lora_worker.py", 2, tiny_glm_dir, tmp_path / "out.pt", timeout=300)
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    single = lora_steps(tiny_glm_dir)  # on one thread, as each rank
    moved = max(float(tensor.abs().max()) for name, tensor in single["adapters"].items() if "lora_B" in name)
    assert moved > 1e-3, moved  # B starts at zero: the layouts are compared on adapters that trained
    assert "ep=1" in results["fsdp"]["layout"] and "cp=2" in results["cp"]["layout"]  # ep 'auto' -> 1 with experts
    for layout, result in results.items():
        assert result["losses"] == pytest.approx(single["losses"], abs=1e-5), layout
        assert result["adapters"].keys() == single["adapters"].keys()
        for name, tensor in single["adapters"].items():
            torch.testing.assert_close(result["adapters"][name], tensor, atol=2e-4, rtol=1e-3,
                                       msg=lambda text, label=f"{layout} {name}": f"{label}: {text}")
