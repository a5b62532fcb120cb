"""The Mooncake store's set-up as agentrl writes it, and its one-line refusals (`inference/mooncake_master.py`)."""

from __future__ import annotations

import json

import pytest

from agentrl.errors import ConfigError
from agentrl.inference.mooncake_master import MooncakeMaster, MooncakeMasterError, master_binary, write_client_config


def test_the_client_config_names_the_master_tcp_and_p2p_handshake(tmp_path):
    path = write_client_config(tmp_path / "sub" / "mooncake.json", master_address="127.0.0.1:4242",
                               global_segment_bytes=3 * 2**30, local_buffer_bytes=2**26)
    assert json.loads(path.read_text()) == {
        "metadata_server": "P2PHANDSHAKE", "master_server_address": "127.0.0.1:4242", "protocol": "tcp",
        "device_name": "", "global_segment_size": 3 * 2**30, "local_buffer_size": 2**26}


def test_no_mooncake_wheel_is_one_line_naming_the_wheels(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(MooncakeMasterError, match="mooncake-transfer-engine-non-cuda") as info:
        master_binary()
    assert "\n" not in str(info.value)
    with pytest.raises(MooncakeMasterError, match="no port until it is started"):
        _ = MooncakeMaster().address


def test_the_mooncake_store_is_refused_on_the_cpu_in_one_line():
    from agentrl.config import load_config
    from agentrl.inference.deployment import InferenceConfig

    with pytest.raises(ConfigError, match="kv_offload='mooncake' on the CPU") as info:
        load_config(InferenceConfig, None, overrides=["device=cpu", "kv_offload=mooncake"])
    assert "\n" not in str(info.value)
    assert load_config(InferenceConfig, None, overrides=["kv_offload=mooncake"]).kv_offload == "mooncake"
