"""Nemotron-3 Nano and Super presets: architecture from the published config.json, plans at 131k tokens."""

from __future__ import annotations

import dataclasses

import pytest

from agentrl.cli import main
from agentrl.models import resolve_model
from agentrl.trainer.layout import GIB, estimate_memory, plan_layout
from agentrl.trainer.models.args import MoEModelArgs


def _kinds(args: MoEModelArgs) -> dict[str, int]:
    return {kind: args.layer_types.count(kind) for kind in ("mamba", "moe", "attention", "mlp")}


def test_nano_preset_has_the_published_architecture():
    spec = resolve_model("nemotron-3-nano")
    assert (spec.architecture, spec.layers, spec.hidden_size, spec.experts, spec.experts_per_token,
            spec.shared_experts) == ("NemotronHForCausalLM", 52, 2688, 128, 6, 1)
    args = MoEModelArgs.for_model("nemotron-3-nano")
    assert _kinds(args) == {"mamba": 23, "moe": 23, "attention": 6, "mlp": 0}
    assert args.moe_latent_size is None and not args.expert_gated and args.routed_scaling_factor == 2.5
    counts = args.param_counts()
    assert counts["total"] == pytest.approx(31.6e9, rel=0.01)  # "30B-A3B": 31.6B total, 3.2B active (without embeddings)
    assert counts["active"] == pytest.approx(3.2e9, rel=0.02)


def test_super_preset_has_the_latent_moe():
    args = MoEModelArgs.for_model("nemotron-3-super")
    assert _kinds(args) == {"mamba": 40, "moe": 40, "attention": 8, "mlp": 0}
    assert (args.hidden_size, args.moe_latent_size, args.num_experts, args.top_k) == (4096, 1024, 512, 22)
    assert args.expert_params_per_layer() == 512 * 2 * 1024 * 2688  # experts read and write the 1024-wide latent
    counts = args.param_counts()
    assert counts["total"] == pytest.approx(120e9, rel=0.02) and counts["active"] == pytest.approx(12e9, rel=0.03)


def test_trainer_plan_at_131k_tokens(capsys):
    assert main(["trainer-plan", "nemotron-3-nano", "--gpus", "8", "--row-tokens", "131072", "--cp", "auto"]) == 0
    out = capsys.readouterr().out
    assert "31.58B parameters (3.23B active)" in out and "dp=4 cp=2 ep=8" in out
    assert main(["trainer-plan", "nemotron-3-super", "--gpus", "24", "--row-tokens", "131072", "--cp", "auto"]) == 0
    assert "dp=3 cp=8 ep=8" in capsys.readouterr().out
    # Mamba-2 CP splits n_groups (8) over the CP ranks: cp=16 is refused in one line
    assert main(["trainer-plan", "nemotron-3-super", "--gpus", "16", "--row-tokens", "131072", "--cp", "16"]) == 2
    assert "trainer.parallel.cp=16: Mamba-2 context parallelism splits the heads (128) and n_groups (8)" in \
        capsys.readouterr().err


def test_memory_estimate_counts_the_mamba_scan():
    args = MoEModelArgs.for_model("nemotron-3-nano")
    plan = plan_layout(args, world=8, row_tokens=131072, cp=2, gpu_memory_bytes=139 * GIB)
    per_rank_tokens = 131072 // 2
    scan = per_rank_tokens * args.mamba_working_bytes_per_token()
    assert plan.memory["activations"] >= scan > 20 * GIB  # the float32 chunked scan is the largest working set
    longer_chunks = dataclasses.replace(args, mamba_chunk_size=256)  # the intra-chunk matrices grow with the chunk
    bigger = estimate_memory(longer_chunks, world=8, ep=8, cp=2, row_tokens=131072)
    assert bigger["activations"] > plan.memory["activations"]


def test_train_dry_run_plans_nemotron_nano(capsys):
    assert main(["train", "--model", "nemotron-3-nano", "--env", "swe", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16" in out
    assert "layout: world=8" in out and "ep=8" in out
