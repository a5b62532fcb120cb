"""Trainer ranks as Ray actors: 2 gloo ranks take the same optimizer step as 1 rank.

The launcher's own pieces, on a local Ray cluster: the run's placement groups
(`agentrl.rl.placement`), `TrainerGroup.start` (rank 0's rendezvous, one torch.distributed
group over the rank actors, the trainer built from the SFT warm start) and one step on the
same packed batch: each data-parallel rank trains on its share of the rows, and the loss
and gradient norm equal the one-rank step (float32; only the summation order differs).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))

from trainer_helpers import make_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"


@pytest.fixture(scope="module")
def local_ray():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    yield ray
    ray.shutdown()


def _first_step(ray, world: int, samples) -> dict:
    from agentrl.inference.plans import build_plan
    from agentrl.rl.config import load_run_config
    from agentrl.rl.groups import TrainerGroup
    from agentrl.rl.placement import placement_spec, reserve

    config = load_run_config(CI_CONFIG, overrides=[f"launch.trainer_ranks={world}", "trainer.row_tokens=64"])
    start = config.starting_weights()
    spec = placement_spec(config, build_plan(str(start), config.inference))
    reservation = reserve(spec, timeout_s=120, run_name=f"ranks{world}")
    group = TrainerGroup.start(reservation, run_id=f"test-ranks{world}", config=config, model_dir=str(start),
                               model_files=None)
    try:
        assert len(group.ranks) == world
        return asyncio.run(group.train_step(samples, step=0))
    finally:
        group.stop()
        for rank in group.ranks:
            ray.kill(rank)
        reservation.remove()


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_two_gloo_ranks_take_the_same_step_as_one(local_ray):
    from agentrl.models import resolve_model

    spec = resolve_model("tiny-moe")
    samples = make_samples(count=12, vocab=64, moe_layers=spec.layers - spec.dense_layers,
                           num_experts=spec.experts, top_k=spec.experts_per_token)
    one, two = _first_step(local_ray, 1, samples), _first_step(local_ray, 2, samples)
    for key in ("loss", "grad_norm", "mismatch_kl", "loss_tokens"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), (key, one[key], two[key])
    assert one["grad_norm"] > 0 and one["loss_tokens"] > 0
