"""The H200 agent recipe (cookbook/gpu-1xh200/agent-*.toml, issue 36's GPU part), checked on the CPU: its three
configs load, they play the same harder key-hunt under bubblewrap over the same root filesystem, the RL run fits
the shared GPU's memory plan, and its warm start comes from the SFT recipe's output."""

from __future__ import annotations

from pathlib import Path

from agentrl.config import load_config
from agentrl.evaluation.engine import EvalConfig
from agentrl.rl.config import load_run_config
from agentrl.rl.plan import trainer_plan
from agentrl.rl.sft import SFTConfig
from agentrl.rl.shared_gpu import shared_gpu_plan

RECIPES = Path(__file__).resolve().parents[2] / "cookbook" / "gpu-1xh200"
DIFFICULTY = ("clues", "depth", "files", "distractors")


def _recipes():
    return (load_config(SFTConfig, RECIPES / "agent-sft.toml"), load_run_config(RECIPES / "agent-train.toml"),
            load_config(EvalConfig, RECIPES / "agent-eval.toml"))


def test_the_three_configs_play_one_harder_key_hunt_under_bwrap():
    sft, train, evaluation = _recipes()
    assert sft.env == train.env.name == evaluation.env == "key-hunt"
    arguments = [sft.env_args, train.env.args, evaluation.env_args]
    for name in DIFFICULTY:
        assert len({args[name] for args in arguments}) == 1, (name, arguments)
    assert train.env.args["clues"] + 2 >= 4  # a solved episode takes at least four tool calls (the CPU recipe: three)
    sandboxes = [args["sandbox"] for args in arguments]
    assert all(sandbox == sandboxes[0] for sandbox in sandboxes) and sandboxes[0]["type"] == "bwrap"
    assert sandboxes[0]["rootfs"] == "/tmp/agentrl-rootfs/key-hunt"  # where scripts/gpu_run.sh makes it
    assert evaluation.split == "test" and evaluation.n * evaluation.rollouts_per_task >= 256
    assert evaluation.sampling.max_tokens == train.sampling.max_tokens


def test_the_run_starts_from_the_sft_output_and_fits_the_shared_gpu():
    sft, train, _ = _recipes()
    assert train.model.init_checkpoint == sft.output
    assert sft.model == "runs/gpu-1xh200/glm-air-5b-sft"  # the reverse-text warm start of cookbook/gpu-1xh200/sft.toml
    assert train.trainer.router_replay and train.inference.routed_experts and not train.inference.fp8
    plan = shared_gpu_plan(train, trainer_plan(train), gpu_gib=139.8)
    assert plan is not None and plan.fits(), plan


def test_the_80g_variants_are_the_same_recipe_with_glm_air_32e_and_fit_an_h100():
    """scripts/gpu_run.sh takes agent-sft-80g.toml and agent-train-80g.toml on a card under 100 GiB."""
    sft, train, _ = _recipes()
    small_sft = load_config(SFTConfig, RECIPES / "agent-sft-80g.toml")
    small_train = load_run_config(RECIPES / "agent-train-80g.toml")
    assert small_sft.model == load_config(SFTConfig, RECIPES / "sft-80g.toml").output  # its reverse-text warm start
    assert small_train.model.name == "glm-air-32e" and small_train.model.init_checkpoint == small_sft.output
    assert small_sft.model_dump(exclude={"model", "output", "trainer"}) == sft.model_dump(
        exclude={"model", "output", "trainer"})
    for section in ("env", "sampling", "orchestrator", "inference", "launch"):
        assert getattr(small_train, section) == getattr(train, section), section
    assert not shared_gpu_plan(train, trainer_plan(train), gpu_gib=79.0).fits()
    assert shared_gpu_plan(small_train, trainer_plan(small_train), gpu_gib=79.0).fits()
