"""cookbook/gpu-2xh200/train.toml (issue 25) plans the trainer and vLLM onto one GPU each of one 2-GPU node.

The plan text (`agentrl train --dry-run`), the Ray placement groups the launcher reserves, the vLLM
command (NCCL weight-transfer engine, its own GPU's memory) and what `check_resources` asks of the
machine, all on the CPU; the one-GPU recipe it is derived from stays colocated.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.rl.config import load_run_config

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook"


def two_gpu():
    return load_run_config(COOKBOOK / "gpu-2xh200" / "train.toml")


def test_the_two_gpu_recipe_is_the_one_gpu_loop_on_separate_gpus():
    one, two = load_run_config(COOKBOOK / "gpu-1xh200" / "train.toml"), two_gpu()
    assert (two.model, two.env, two.orchestrator, two.sampling) == (one.model, one.env, one.orchestrator, one.sampling)
    assert (two.trainer.router_replay, two.inference.routed_experts) == (True, True)
    assert (one.launch.colocate, two.launch.colocate) == (True, False)
    assert (one.weight_transfer().name, two.weight_transfer().name) == ("ipc", "nccl")


def test_the_plan_puts_both_roles_on_one_node_with_a_gpu_each():
    from agentrl.inference.plans import build_plan
    from agentrl.rl.placement import placement_spec
    from agentrl.rl.plan import plan_run

    config = two_gpu()
    text = plan_run(config)
    assert "# GPUs: inference 1 on node(s) [0], trainer 1, total 2" in text
    assert "# nodes: 1 (inference on 1 and the trainer on 1 other GPU(s) of node 0, 2 GPUs per node)" in text
    assert "--gpu-memory-utilization 0.85" in text and """--weight-transfer-config '{"backend": "nccl"}'""" in text
    spec = placement_spec(config, build_plan(config.model.init_checkpoint, config.inference))
    gpus = {group.name: [bundle.get("GPU", 0) for bundle in group.bundles] for group in spec.groups}
    assert gpus == {"trainer-0": [1], "inference-0": [1], "rollout": [0]}  # no colocated group, a whole GPU each


def test_the_one_gpu_recipe_plans_one_shared_node():
    from agentrl.rl.plan import plan_run

    text = plan_run(load_run_config(COOKBOOK / "gpu-1xh200" / "train.toml"))
    assert "# nodes: 1 (trainer and inference share its GPUs" in text


def test_two_gpus_are_needed():
    from agentrl.rl.plan import ResourceError, check_resources

    with pytest.raises(ResourceError, match=r"2 GPUs \(1 inference \+ 1 trainer\), 1 visible"):
        check_resources(two_gpu(), cluster_gpus=1)


@pytest.mark.parametrize(("recipe", "expected"), [
    ("gpu-1xh200", {"colocated": [0.5, 0.25, 0.25], "rollout": [0]}),
    ("gpu-2xh200", {"trainer-0": [1], "inference-0": [0.5, 0.5], "rollout": [0]}),
])
def test_a_pd_pair_shares_its_gpu_in_the_placement(recipe, expected):
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.inference.plans import build_plan
    from agentrl.rl.placement import placement_spec

    config = load_run_config(COOKBOOK / recipe / "train.toml")
    config.inference = InferenceConfig(**{**config.inference.model_dump(), "kind": "pd", "kv_connector": "example",
                                          "gpu_memory_utilization": 0.15})
    spec = placement_spec(config, build_plan(config.model.init_checkpoint, config.inference))
    assert {group.name: [bundle.get("GPU", 0) for bundle in group.bundles] for group in spec.groups} == expected
    assert len(spec.inference) == 2
