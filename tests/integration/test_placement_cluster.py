"""`agentrl train --env swe --model glm-4.5-air` placed on a simulated 3 x 8-GPU Ray cluster.

Three Ray nodes on this machine declare 8 GPUs each (Ray accepts GPUs that do not exist),
so the real placement groups of the GLM-4.5-Air recipe are created and placed by Ray's own
scheduler, without starting vLLM or a trainer: one bundle per trainer GPU, the 16 trainer
ranks packed 8 per node on two nodes, the inference plan's 4 tensor-parallel-2 replicas
together on the third, a rollout worker bundle each; the actor options each slot gets; and
the vLLM command each replica's actor would run (the deployment's tensor parallelism,
routed experts and NCCL weight-transfer engine on top of agentrl's server flags).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray")

from ray_cluster import RayCluster  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "cookbook" / "glm-4.5-air" / "train.toml"


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    cluster = RayCluster(tmp_path_factory.mktemp("ray-gpu"))
    try:
        for index in range(3):
            cluster.add_node(cpus=16, gpus=8, resources={f"sim_node_{index}": 1})
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_glm_air_recipe_places_on_three_8_gpu_nodes(gpu_cluster, tmp_path):
    import ray

    from agentrl.inference.plans import build_plan
    from agentrl.models import PRESETS
    from agentrl.rl.config import load_run_config
    from agentrl.rl.inference_actor import replica_server
    from agentrl.rl.placement import placement_spec, reserve

    config = load_run_config(RECIPE, env="swe", model="glm-4.5-air")
    assert (config.launch.trainer_gpus, config.launch.inference_gpus, config.weight_transfer().name) == (16, 8, "nccl")
    deployment = build_plan("zai-org/GLM-4.5-Air", config.inference)
    spec = placement_spec(config, deployment)
    trainer_groups = [group for group in spec.groups if group.name.startswith("trainer")]
    assert [(group.name, len(group.bundles), group.strategy) for group in trainer_groups] == [
        ("trainer-0", 8, "STRICT_PACK"), ("trainer-1", 8, "STRICT_PACK")]
    assert all(bundle["GPU"] == 1 for group in trainer_groups for bundle in group.bundles)  # one bundle per GPU
    assert [bundle["GPU"] for bundle in spec.group("inference-0").bundles] == [2, 2, 2, 2]
    assert len(spec.rollout) == config.launch.num_rollout_workers

    ray.init(address=gpu_cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        reservation = reserve(spec, timeout_s=120, run_name="sim")
        try:
            trainer_nodes = [reservation.node_of(slot) for slot in spec.trainer]
            inference_nodes = {reservation.node_of(slot) for slot in spec.inference}
            per_node = Counter(trainer_nodes)
            assert sorted(per_node.values()) == [8, 8], per_node  # ranks 0-7 on one node, 8-15 on another
            assert len(set(trainer_nodes[:8])) == 1 and len(set(trainer_nodes[8:])) == 1
            assert len(inference_nodes) == 1 and inference_nodes.isdisjoint(per_node)  # the third node
            rank0 = reservation.options(spec.trainer[0])
            replica = reservation.options(spec.inference[0])
            assert (rank0["num_gpus"], replica["num_gpus"]) == (1, 2)
            assert rank0["scheduling_strategy"].placement_group_bundle_index == 0
        finally:
            reservation.remove()
    finally:
        ray.shutdown()

    model = tmp_path / "glm-4.5-air-shapes"  # config only: the command needs no weights
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**PRESETS["glm-4.5-air"].hf_config,
                                                   "architectures": ["Glm4MoeForCausalLM"]}))
    command = replica_server(config.inference, model, served_name="glm-4.5-air", dtype="bfloat16").command()
    joined = " ".join(command)
    for expected in ("vllm.entrypoints.openai.api_server", "--enable-scale-out", "--tensor-parallel-size 2",
                     "--enable-return-routed-experts", '--weight-transfer-config {"backend": "nccl"}',
                     "--max-model-len 65536", "--served-model-name glm-4.5-air"):
        assert expected in joined, (expected, joined)
    assert [process.gpus for process in deployment.servers] == [[0, 1], [2, 3], [4, 5], [6, 7]]
