"""The weight-transport setting (`inference.weight_transfer`), wired end to end without GPUs.

`WeightPush` is driven with recording stand-ins for the trainer and inference groups (the
real ones need Ray actors; the GPU transports need CUDA vLLM): which group call each
transport makes, in which order, with which arguments; plus the server flags and config
defaults each transport implies.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from agentrl.errors import ConfigError
from agentrl.inference.plans import DeploymentConfig, server_overrides
from agentrl.rl.config import load_run_config
from agentrl.rl.transport import WeightPush


class Recorder:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls
        self.urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]

    def __getattr__(self, method: str):
        async def call(*args, **kwargs):
            self.calls.append((self.name, method, args, kwargs))
            return {"export": "/staged/v3", "export_ref": "ref-v3"}.get(method)
        return call


def _push(transport: str) -> tuple[list, object]:
    calls: list = []
    push = WeightPush(Recorder("trainer", calls), Recorder("inference", calls), transport=transport,
                      staging_dir=Path("/run/weights"))

    async def go():
        loading = await push.push(version=3)
        if loading is not None:
            await loading
        return loading

    return calls, asyncio.run(go())


def test_filesystem_exports_into_the_run_folder_then_every_server_loads_the_path():
    calls, loading = _push("filesystem")
    assert loading is not None  # the load overlaps the next trainer step
    assert calls == [("trainer", "export", (3,), {"dest": "/run/weights/v3", "ship": False}),
                     ("inference", "load", (3,), {"path": "/staged/v3"})]


def test_object_store_hands_the_servers_the_exported_files_not_a_path():
    calls, _ = _push("object_store")
    assert calls == [("trainer", "export_ref", (3,), {}), ("inference", "load", (3,), {"files": "ref-v3"})]


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_direct_transports_send_from_the_trainer_to_every_server_url(transport):
    calls, loading = _push(transport)
    assert loading is None
    assert calls == [("trainer", "push_direct", (3,), {"urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
                                                       "backend": transport}),
                     ("inference", "set_version", (3,), {})]


def test_unknown_transport_is_refused():
    with pytest.raises(ConfigError, match="weight_transfer='carrier-pigeon'"):
        WeightPush(None, None, transport="carrier-pigeon", staging_dir=Path("/tmp"))


@pytest.mark.parametrize(("transport", "flag"), [("nccl", '{"backend": "nccl"}'), ("ipc", '{"backend": "ipc"}'),
                                                  ("filesystem", None), ("object_store", None)])
def test_gpu_servers_start_the_matching_weight_transfer_engine(transport, flag):
    args, _ = server_overrides(DeploymentConfig(device="gpu", weight_transfer=transport), "model")
    if flag is None:
        assert "--weight-transfer-config" not in args
    else:
        assert args[args.index("--weight-transfer-config") + 1] == flag


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_gpu_transports_on_the_cpu_are_one_line_errors(transport):
    with pytest.raises(ConfigError, match=f"weight_transfer '{transport}' needs GPUs"):
        server_overrides(DeploymentConfig(device="cpu", weight_transfer=transport), "model")


def test_defaults_follow_the_inference_device():
    assert load_run_config().weight_transfer() == "filesystem"
    assert load_run_config(overrides=["inference.weight_transfer=object_store"]).weight_transfer() == "object_store"
    assert load_run_config(env="swe", model="glm-4.5-air").weight_transfer() == "nccl"
