"""scripts/gpu-loops.txt, the one-GPU loop's feature runs of issue 35 (`scripts/gpu_run.sh loop-*`): every line's
overrides load onto both profiles' train recipes, ask for the feature, and plan to fit the profile's card (the P/D
pair's two servers each with half of vLLM's share), so a device call does not find out at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.rl.config import load_run_config
from agentrl.rl.plan import build_plan, trainer_plan
from agentrl.rl.shared_gpu import shared_gpu_plan

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {"train.toml": 139.8, "train-80g.toml": 79.0}  # the cards' usable GiB, as the recipes' [plan] says


def _loops() -> dict[str, list[str]]:
    lines = (ROOT / "scripts" / "gpu-loops.txt").read_text().splitlines()
    return {fields[0]: fields[1:] for fields in (line.split() for line in lines) if fields and fields[0][0] != "#"}


def test_the_loops_are_the_four_features_and_gpu_run_runs_them():
    assert sorted(_loops()) == ["loop-fp8", "loop-kv", "loop-mooncake", "loop-pd"]
    script = (ROOT / "scripts" / "gpu_run.sh").read_text()
    assert "scripts/gpu-loops.txt" in script and "    loop-*)" in script


@pytest.mark.parametrize("recipe", sorted(PROFILES))
@pytest.mark.parametrize("loop", sorted(_loops()))
def test_every_loop_fits_its_profiles_card(loop, recipe):
    config = load_run_config(ROOT / "cookbook" / "gpu-1xh200" / recipe, overrides=_loops()[loop])
    inference = config.inference
    assert {"loop-fp8": inference.fp8, "loop-kv": inference.kv_offload == "cpu",
            "loop-mooncake": inference.kv_offload == "mooncake", "loop-pd": inference.pd_pair()}[loop]
    assert config.trainer.router_replay and inference.routed_experts
    plan = shared_gpu_plan(config, trainer_plan(config), gpu_gib=PROFILES[recipe])
    assert plan is not None and plan.fits(), plan
    assert build_plan(config.model.name, inference).total_gpus == 1
