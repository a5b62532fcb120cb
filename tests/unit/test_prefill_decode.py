"""The token client's side of P/D (`agentrl.clients.prefill_decode`) and the folder connector's launch flags."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest

from agentrl.clients.prefill_decode import (
    PrefillStitch,
    decode_body,
    prefill_body,
    stitch_choices,
    stitch_rows,
    unknown_tokens,
)


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def _choice(rows: np.ndarray, version: str = "3") -> dict:
    return {"routed_experts": _npy(rows), "weight_versions": [{"version": version, "start": 0, "end": 2}]}


def _routing(tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, size=(tokens, 4, 2)).astype(np.uint8)


def test_prefill_body_asks_one_token_and_keeps_the_kv_for_a_remote_decode():
    body = {"token_ids": [1, 2, 3], "cache_salt": "agentrl-weights-v3",
            "sampling_params": {"max_tokens": 64, "n": 8, "temperature": 1.0, "seed": 5, "stop": ["x"]}}
    prefill = prefill_body(body)
    assert prefill["sampling_params"]["max_tokens"] == 1
    assert "n" not in prefill["sampling_params"] and "stop" not in prefill["sampling_params"]
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert prefill["cache_salt"] == body["cache_salt"] and prefill["token_ids"] == body["token_ids"]
    assert body["sampling_params"]["n"] == 8, "the caller's body is not changed"
    assert "kv_transfer_params" not in decode_body(body, {"kv_transfer_params": None})
    handed = {"do_remote_prefill": True, "remote_block_ids": [4, 5]}
    assert decode_body(body, {"kv_transfer_params": handed})["kv_transfer_params"] == handed


def test_kv_transfer_params_ride_in_extra_args_too_where_cuda_vllm_0_24_reads_them():
    """vLLM 0.24's /inference/v1/generate drops the body's `kv_transfer_params`; the sampling parameters'
    `extra_args` reach the connector on both vLLMs. The caller's own extra args stay."""
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 64, "extra_args": {"tag": "mine"}}}
    prefill = prefill_body(body)
    assert prefill["sampling_params"]["extra_args"] == {"tag": "mine", "kv_transfer_params": {"do_remote_decode": True}}
    handed = {"do_remote_prefill": True, "remote_block_ids": [4, 5]}
    decode = decode_body(body, {"kv_transfer_params": handed})
    assert decode["sampling_params"]["extra_args"] == {"tag": "mine", "kv_transfer_params": handed}
    assert decode["sampling_params"]["max_tokens"] == 64 and body["sampling_params"]["extra_args"] == {"tag": "mine"}
    assert "extra_args" not in decode_body({"token_ids": [1], "sampling_params": {}}, {})["sampling_params"]


def test_unknown_prompt_rows_are_taken_from_the_prefill_answer():
    whole = _routing(40)
    decoded = whole.astype(np.int16)
    decoded[:32] = -1  # loaded through the connector: not computed on the decode server
    prompt = whole[:36]  # the prefill answer: every prompt token
    stitched, filled = stitch_rows(decoded, prompt)
    assert filled == 32 and np.array_equal(stitched, whole)
    assert not unknown_tokens(stitched).any()


def test_rows_the_prefill_answer_lacks_stay_unknown():
    decoded = _routing(10).astype(np.int16)
    decoded[:6] = -1
    prompt = _routing(10)[:4]
    stitched, filled = stitch_rows(decoded, prompt)
    assert filled == 4 and unknown_tokens(stitched).tolist() == [False] * 4 + [True] * 2 + [False] * 4
    assert stitch_rows(decoded, _routing(10)[:, :3])[1] == 0, "another model's layout is never stitched"


def test_gate_weight_rows_are_stitched_with_their_weights():
    ids = _routing(12).astype(np.float32)
    weights = np.random.default_rng(1).random((12, 4, 2), dtype=np.float32)
    whole = np.stack([ids, weights], axis=-1)
    decoded = whole.copy()
    decoded[:8, ..., 0], decoded[:8, ..., 1] = -1.0, np.nan
    stitched, filled = stitch_rows(decoded, whole[:10])
    assert filled == 8 and np.array_equal(stitched, whole)


def test_choices_of_another_weight_version_are_left_unknown():
    whole = _routing(20)
    decoded = whole.astype(np.int16)
    decoded[:16] = -1
    prefill = {"choices": [_choice(whole[:18], version="3")]}
    same, other = _choice(decoded, version="3"), _choice(decoded, version="4")
    stitch = stitch_choices([same, other], prefill)
    assert np.array_equal(same["routed_experts"], whole)
    assert unknown_tokens(other["routed_experts"])[:16].all()
    assert (stitch.requests, stitch.stitched_tokens, stitch.unknown_tokens, stitch.version_mismatches) == (1, 16, 16, 1)
    assert isinstance(PrefillStitch(), PrefillStitch)


def test_folder_connector_flags_name_each_side_by_its_role(tmp_path):
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.inference.router import router_command
    from agentrl.inference.server_flags import FOLDER_CONNECTOR, server_overrides

    config = InferenceConfig(device="cpu", kind="pd", kv_connector="example", kv_offload_dir=str(tmp_path),
                             routed_experts=True, weight_transfer="filesystem")
    roles = {}
    for side in ("prefill", "decode"):
        args, env = server_overrides(config, "model", role=side)
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert transfer["kv_connector"] == "FolderPDConnector"
        assert transfer["kv_connector_module_path"] == FOLDER_CONNECTOR
        assert transfer["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path)}
        assert env["AGENTRL_ROUTED_EXPERTS"] == "1"
        roles[side] = transfer["kv_role"]
    assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}
    assert "--kv-transfer-config" not in server_overrides(config, "model")[0]
    argv = router_command([], port=9, prefill_urls=["http://a"], decode_urls=["http://b"], kv_connector="example")
    assert argv[argv.index("--kv-connector") + 1] == "nixl"


def test_the_decode_side_runs_without_a_prefix_cache_on_either_device(tmp_path):
    """A decode server keeps its KV cache across weight updates (vLLM 0.24 cannot drop it while a request waits for
    the prefill side's KV), so it must not reuse blocks of older weights: no prefix cache there. The prefill side
    and single servers keep vLLM's default on the GPU."""
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.inference.server_flags import server_overrides

    for device in ("cpu", "gpu"):
        config = InferenceConfig(device=device, kind="pd", kv_connector="example", kv_offload_dir=str(tmp_path),
                                 routed_experts=True, weight_transfer="filesystem")
        decode = server_overrides(config, "model", role="decode")[0]
        assert decode.count("--no-enable-prefix-caching") == 1, (device, decode)
    gpu = InferenceConfig(device="gpu", kind="pd", kv_connector="example", kv_offload_dir=str(tmp_path),
                          routed_experts=True, weight_transfer="filesystem")
    assert "--no-enable-prefix-caching" not in server_overrides(gpu, "model", role="prefill")[0]


def test_folder_connector_module_imports_with_vllm():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    from agentrl.inference.vllm_plugin.pd_folder_connector import FolderPDConnector

    assert issubclass(FolderPDConnector, ExampleConnector)


def test_a_nixl_pair_without_the_nixl_package_is_refused_in_one_line_before_start(monkeypatch):
    from agentrl.inference import supervisor
    from agentrl.rl.config import load_run_config
    from agentrl.rl.plan import ResourceError, check_resources

    config = load_run_config(overrides=[
        "inference.kind=pd", "inference.kv_connector=nixl"])
    check_resources(config)  # installed here (the cpu extra)
    real = supervisor.module_installed
    monkeypatch.setattr(supervisor, "module_installed", lambda name: name != "nixl" and real(name))
    with pytest.raises(ResourceError, match=r"missing: the nixl package for inference.kv_connector='nixl' \(pip "
                                            r"install 'agentrl\[cpu\]'") as info:
        check_resources(config)
    assert "\n" not in str(info.value)


def test_a_gpu_pd_pair_colocated_with_the_trainer_asks_for_one_gpu():
    """On one GPU the pair and the trainer share the device; the check once counted the pair's GPU twice."""
    from agentrl.rl.config import load_run_config
    from agentrl.rl.plan import ResourceError, check_resources

    config = load_run_config(Path("cookbook/gpu-1xh200/train-80g.toml"), overrides=[
        "inference.kind=pd", "inference.kv_connector=example", "inference.gpu_memory_utilization=0.15"])
    with pytest.raises(ResourceError) as info:  # this machine has no CUDA vLLM and the warm start is not here
        check_resources(config, cluster_gpus=1)
    assert "GPUs (" not in str(info.value) and "CUDA vLLM" in str(info.value)
    with pytest.raises(ResourceError, match=r"1 GPUs \(1 inference \+ 1 trainer sharing them\), 0 visible"):
        check_resources(config, cluster_gpus=0)


def test_each_router_exports_its_metrics_on_its_own_loopback_port():
    """vllm-router's Prometheus exporter defaults to 127.0.0.1:29000 for every router of the machine, and a second
    router there panics ("Address already in use"; seen when a P/D pair's router and a run's replica router met in
    the full suite). Each `VLLMRouter` asks for a free port of its own, and the plan's router for the port after
    its own; vllm-router's parser takes both command lines."""
    pytest.importorskip("vllm_router")
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.inference.plans import build_plan
    from agentrl.inference.router import VLLMRouter
    from agentrl.inference.validate import validate_router_args

    routers = [VLLMRouter(["http://127.0.0.1:1"]) for _ in range(2)]
    for router in routers:
        argv = router.command
        assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
        assert int(argv[argv.index("--prometheus-port") + 1]) == router.metrics_port != router.port
        validate_router_args(argv[3:])
    assert routers[0].metrics_port != routers[1].metrics_port

    plan = build_plan("some/model", InferenceConfig(device="cpu", kind="replicas", replicas=2))
    (router_spec,) = [process for process in plan.processes if process.role == "router"]
    argv = router_spec.argv
    port = int(argv[argv.index("--port") + 1])
    assert argv[argv.index("--prometheus-port") + 1] == str(port + 1)
    validate_router_args(argv[1:])
    # One builder for both: the plan's router runs the node's script and, starting beside its servers, keeps
    # vllm-router's own start-up wait; a `VLLMRouter` starts after its workers answer and checks them every second.
    assert argv[0] == "vllm-router" and "--worker-startup-timeout-secs" not in argv
    assert routers[0].command[routers[0].command.index("--worker-startup-timeout-secs") + 1] == "120"
