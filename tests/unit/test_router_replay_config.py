"""`trainer.router_replay_weights` (the third Router Replay arm): what it needs, refused in one line at load."""

from __future__ import annotations

import pytest

from agentrl.errors import ConfigError
from agentrl.rl.config import load_run_config


@pytest.mark.parametrize("overrides", [
    ["trainer.router_replay_weights=true", "trainer.router_replay=false"],
    ["trainer.router_replay_weights=true", "inference.routed_experts=false"],
])
def test_replaying_gate_weights_without_what_records_them_is_one_line(overrides):
    with pytest.raises(ConfigError, match=r"trainer\.router_replay_weights: replaying gate weights needs") as info:
        load_run_config(overrides=overrides)
    assert "\n" not in str(info.value)


def test_replaying_gate_weights_on_the_cpu_loads():
    config = load_run_config(overrides=["trainer.router_replay_weights=true"])
    assert config.trainer.router_replay_weights and config.inference.device == "cpu"


@pytest.mark.parametrize("connector", ['inference.kv_offload="cpu"', 'inference.kind="pd"'])
def test_replaying_gate_weights_through_a_gpu_kv_connector_is_one_line(connector):
    overrides = ["trainer.router_replay_weights=true", 'inference.device="gpu"', connector]
    with pytest.raises(ConfigError, match=r"^trainer\.router_replay_weights: on GPUs with kv_offload=.* stitched as "
                                          r"expert ids only") as info:
        load_run_config(overrides=overrides)
    assert "\n" not in str(info.value)


def test_replaying_gate_weights_on_a_gpu_server_loads():
    config = load_run_config(overrides=["trainer.router_replay_weights=true", 'inference.device="gpu"'])
    assert config.trainer.router_replay_weights and config.inference.device == "gpu"
