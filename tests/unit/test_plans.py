"""Deployment plans parse with vLLM's and vllm-router's own argument parsers (no GPU needed)."""

from __future__ import annotations

import json

import pytest

from agentrl.errors import AgentrlError, ConfigError
from agentrl.inference.deployment import InferenceConfig
from agentrl.inference.plans import build_plan
from agentrl.inference.server_flags import ROUTED_EXPERTS_ENV
from agentrl.inference.validate import InvalidPlanError, validate_plan, validate_router_args, validate_vllm_args

pytest.importorskip("vllm")

GLM_AIR = "zai-org/GLM-4.5-Air"


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_glm_air_wide_ep_on_64_gpus_parses_with_vllm():
    plan = build_plan(GLM_AIR, InferenceConfig(kind="wide_ep", nodes=8, gpus_per_node=8, kv_offload="cpu",
                                                      routed_experts=False))
    assert plan.total_gpus == 64
    assert validate_plan(plan) == 8
    head, *workers = plan.servers
    parsed = validate_vllm_args(head.vllm_args)
    assert parsed.data_parallel_size == 64 and parsed.data_parallel_size_local == 8
    assert parsed.enable_expert_parallel and parsed.all2all_backend == "deepep_low_latency"
    assert parsed.quantization == "fp8" and "VLLM_USE_DEEP_GEMM" not in head.env  # per-tensor scales: not DeepGEMM
    assert not parsed.enable_return_routed_experts and parsed.kv_offloading_size == 64.0
    assert head.url == "http://node0:8000" and plan.endpoint == head.url
    starts = [validate_vllm_args(worker.vllm_args).data_parallel_start_rank for worker in workers]
    assert starts == [8 * node for node in range(1, 8)]
    assert all(validate_vllm_args(worker.vllm_args).headless for worker in workers)


def test_glm_air_prefill_decode_on_64_gpus_parses_with_vllm_and_router():
    config = InferenceConfig(kind="pd", nodes=8, gpus_per_node=8, nodes_per_instance=2, prefill_decode_ratio="1:3",
                             routed_experts=False)
    plan = build_plan(GLM_AIR, config)
    assert plan.total_gpus == 64
    assert validate_plan(plan) == 9
    prefill = [process for process in plan.processes if process.role == "prefill"]
    decode = [process for process in plan.processes if process.role == "decode"]
    assert len(prefill) == 2 and len(decode) == 6  # 1 prefill instance : 3 decode instances, 2 nodes each
    parsed = validate_vllm_args(prefill[0].vllm_args)
    assert parsed.kv_transfer_config.kv_connector == "NixlConnector"
    assert parsed.all2all_backend == "deepep_high_throughput"
    assert validate_vllm_args(decode[0].vllm_args).all2all_backend == "deepep_low_latency"
    router = validate_router_args(plan.router.argv)
    assert router.vllm_pd_disaggregation and len(router.prefill_urls) == 1 and len(router.decode_urls) == 3
    assert router.policy == "consistent_hash"


def test_disk_offload_combines_connectors_under_multiconnector():
    config = InferenceConfig(kind="pd", nodes=2, gpus_per_node=8, prefill_decode_ratio="1:1", kv_offload="disk",
                             routed_experts=False)
    plan = build_plan(GLM_AIR, config)
    validate_plan(plan)
    kv = json.loads(_flag(plan.servers[0].vllm_args, "--kv-transfer-config"))
    names = [connector["kv_connector"] for connector in kv["kv_connector_extra_config"]["connectors"]]
    assert kv["kv_connector"] == "MultiConnector" and names == ["NixlConnector", "OffloadingConnector"]


def test_mooncake_store_offload_and_no_fp8_on_a100():
    plan = build_plan(GLM_AIR, InferenceConfig(kind="single", gpus_per_node=4, tensor_parallel_size=4, gpu_kind="a100", kv_offload="mooncake",
                                               routed_experts=False))
    validate_plan(plan)
    args = plan.servers[0].vllm_args
    assert "--quantization" not in args
    assert json.loads(_flag(args, "--kv-transfer-config"))["kv_connector"] == "MooncakeStoreConnector"
    assert plan.servers[0].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_tiny_moe_cpu_replicas_parse_and_bind_localhost(tmp_path):
    plan = build_plan(str(tmp_path), InferenceConfig(kind="replicas", device="cpu", replicas=2, port=18000))
    assert validate_plan(plan) == 3
    urls = [server.url for server in plan.servers]
    assert urls == ["http://127.0.0.1:18000", "http://127.0.0.1:18001"]
    for server in plan.servers:
        parsed = validate_vllm_args(server.vllm_args)
        assert parsed.host == "127.0.0.1" and parsed.enable_scale_out
        assert parsed.kv_cache_memory_bytes == 256 * 2**20
        assert not parsed.enable_return_routed_experts and server.env[ROUTED_EXPERTS_ENV] == "1"
        assert parsed.enable_prefix_caching is False
    router = validate_router_args(plan.router.argv)
    assert router.host == "127.0.0.1" and router.worker_urls == urls
    cached = build_plan(str(tmp_path), InferenceConfig(kind="replicas", device="cpu", replicas=2, port=18000,
                                                       prefix_caching=True))
    for server in cached.servers:  # the plugin stitches cached tokens' experts: the cache stays on
        assert validate_vllm_args(server.vllm_args).enable_prefix_caching is not False
        assert server.env[ROUTED_EXPERTS_ENV] == "1"


def test_deliberately_wrong_flags_are_rejected():
    with pytest.raises(InvalidPlanError, match="all2all-backend"):
        validate_vllm_args(["--model", "m", "--all2all-backend", "deepep_fast"])
    with pytest.raises(InvalidPlanError, match="unrecognized"):
        validate_vllm_args(["--model", "m", "--enable-expert-paralel"])
    with pytest.raises(InvalidPlanError):
        validate_vllm_args(["--model", "m", "--kv-transfer-config", "{not json"])
    with pytest.raises(InvalidPlanError, match="policy"):
        validate_router_args(["vllm-router", "--policy", "sticky_sessions"])
    plan = build_plan(GLM_AIR, InferenceConfig(kind="wide_ep", nodes=2, decode_all2all_backend="deepep_turbo"))
    with pytest.raises(InvalidPlanError, match="deepep_turbo"):
        validate_plan(plan)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"kind": "wide_ep", "device": "cpu"}, "needs GPUs"),
        ({"kind": "pd", "nodes": 3, "prefill_decode_ratio": "1:3", "routed_experts": False}, "cannot be split"),
        ({"kind": "pd", "nodes": 4, "prefill_decode_ratio": "one:three", "routed_experts": False},
         "prefill_decode_ratio"),
        ({"kind": "single", "gpu_kind": "a100", "fp8": True}, "FP8"),
        ({"kind": "single", "device": "cpu", "weight_transfer": "nccl"}, "nccl"),
        ({"kind": "replicas", "replicas": 9, "nodes": 1, "gpus_per_node": 8}, "does not fit"),
    ],
)
def test_impossible_deployments_give_one_line_errors(config, match):
    with pytest.raises(ConfigError, match=match) as info:
        build_plan(GLM_AIR, InferenceConfig(**config))
    assert "\n" not in str(info.value) and isinstance(info.value, AgentrlError)


def test_serve_plan_cli_prints_commands_and_rejects_bad_fields(capsys):
    from agentrl.cli import main

    assert main(["serve", "--plan", "--model", "glm-4.5-air", "--set", "kind=pd", "--set", "nodes=8",
                 "--set", "nodes_per_instance=2", "--set", "routed_experts=false", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "# pd deployment of zai-org/GLM-4.5-Air: 64 GPUs" in out and "## node 7" in out
    assert "vllm-router" in out and "--vllm-pd-disaggregation" in out and "validated 9 command line(s)" in out
    assert main(["serve", "--plan", "--set", "kind=bogus"]) == 2
    assert "kind" in capsys.readouterr().err


def test_serve_plan_takes_the_fields_as_agentrl_train_names_them(capsys):
    """`--set inference.kind=...` (as in `agentrl train`) plans what `--set kind=...` does."""
    from agentrl.cli import main

    plans = []
    for prefix in ("", "inference."):
        assert main(["serve", "--plan", "--model", "glm-4.5-air", "--set", f"{prefix}kind=replicas",
                     "--set", f"{prefix}replicas=2"]) == 0
        plans.append(capsys.readouterr().out)
    assert plans[0] == plans[1] and "# replicas deployment of zai-org/GLM-4.5-Air" in plans[0]
    assert main(["serve", "--plan", "--set", "inference.bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_gpu_replicas_get_distinct_ports_and_gpus_per_node():
    plan = build_plan(GLM_AIR, InferenceConfig(kind="replicas", replicas=8, nodes=2, gpus_per_node=8, tensor_parallel_size=2))
    placements = [(server.node, server.url, tuple(server.gpus)) for server in plan.servers]
    assert len(set(placements)) == 8 and {node for node, _, _ in placements} == {0, 1}
    assert [gpus for node, _, gpus in placements if node == 1] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert len({url for _, url, _ in placements}) == 8
    validate_plan(plan)


def test_fp8_scales_pick_vllms_online_fp8_method_and_the_kv_cache_is_optional():
    per_tensor = build_plan(GLM_AIR, InferenceConfig(kind="single", gpus_per_node=1, fp8=True)).servers[0]
    parsed = validate_vllm_args(per_tensor.vllm_args)
    assert parsed.quantization == "fp8" and parsed.kv_cache_dtype == "fp8"
    # VLLM_USE_DEEP_GEMM=1 forces DeepGEMM's MoE kernel, which refuses per-tensor scales (seen on the H200)
    assert "VLLM_USE_DEEP_GEMM" not in per_tensor.env
    block = build_plan(GLM_AIR, InferenceConfig(kind="single", gpus_per_node=1, fp8=True, fp8_scales="block",
                                                fp8_kv_cache=False)).servers[0]
    parsed = validate_vllm_args(block.vllm_args)
    assert parsed.quantization == "fp8_per_block" and parsed.kv_cache_dtype == "auto"
    assert block.env["VLLM_USE_DEEP_GEMM"] == "1"
    off = build_plan(GLM_AIR, InferenceConfig(kind="single", gpus_per_node=1, fp8=False)).servers[0]
    assert validate_vllm_args(off.vllm_args).quantization is None


def test_router_replay_with_prefill_decode_is_refused_in_one_line(tmp_path):
    from agentrl.config import load_config

    path = tmp_path / "deployment.toml"
    path.write_text('kind = "pd"\nnodes = 2\n')
    with pytest.raises(ConfigError, match=r"routed_experts with kind='pd' over kv_connector='nixl' on 2 node.*"
                                          r"set nodes=1 with kv_connector='nixl'.*routed_experts=false") as info:
        load_config(InferenceConfig, str(path))
    assert "\n" not in str(info.value)
    assert not load_config(InferenceConfig, str(path), overrides=["routed_experts=false"]).routed_experts


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kind": "pd", "device": "cpu", "kv_connector": "mooncake"},
         r"kind='pd' on the CPU with kv_connector='mooncake'.*set kv_connector='nixl'"),
        ({"kind": "pd", "device": "cpu", "nodes": 2}, r"kind='pd' on the CPU with nodes=2.*set nodes=1"),
        ({"kind": "pd", "kv_connector": "example", "nodes": 2}, r"kv_connector='example' with nodes=2.*set nodes=1"),
    ],
)
def test_a_pd_pair_runs_on_one_node(fields, match):
    from agentrl.config import load_config

    with pytest.raises(ConfigError, match=match) as info:
        load_config(InferenceConfig, None, overrides=[f"{key}={value}" for key, value in fields.items()])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("connector", ["nixl", "example"])
def test_the_pd_pair_plan_is_two_servers_and_a_pd_router(device, connector, tmp_path):
    from agentrl.inference.server_flags import FOLDER_CONNECTOR, ROUTED_OFFLOAD_ENV

    config = InferenceConfig(kind="pd", kv_connector=connector, device=device, gpus_per_node=1, routed_experts=True,
                             kv_offload_dir=str(tmp_path))
    assert config.pd_pair() and not config.node_processes()
    assert InferenceConfig(kind="pd", nodes=2, routed_experts=False).node_processes()
    plan = build_plan(GLM_AIR, config)
    assert [(server.role, server.gpus) for server in plan.servers] == [
        ("prefill", [0] if device == "gpu" else []), ("decode", [0] if device == "gpu" else [])]
    assert plan.total_gpus == (1 if device == "gpu" else 0)  # the pair shares its GPU: counted once
    roles, side_channels = [], set()
    for server in plan.servers:
        transfer = json.loads(_flag(server.vllm_args, "--kv-transfer-config"))
        if connector == "example":
            assert (transfer["kv_connector_module_path"], transfer["kv_connector_extra_config"]) == (
                FOLDER_CONNECTOR, {"shared_storage_path": str(tmp_path)})
        else:  # NIXL's handshake on 127.0.0.1 at a port of each server's own, UCX over loopback
            assert transfer["kv_connector"] == "NixlConnector"
            assert transfer.get("kv_buffer_device") == ("cpu" if device == "cpu" else None)
            assert server.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" and server.env["UCX_NET_DEVICES"] == "lo"
            side_channels.add(server.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        roles.append(transfer["kv_role"])
        assert (ROUTED_OFFLOAD_ENV in server.env) == (device == "gpu")
    assert roles == ["kv_producer", "kv_consumer"] and len(side_channels) == (2 if connector == "nixl" else 0)
    router = plan.router.argv
    assert "--vllm-pd-disaggregation" in router and router[router.index("--kv-connector") + 1] == "nixl"
    assert router[router.index("--prefill") + 1] == plan.servers[0].url
    assert router[router.index("--decode") + 1] == plan.servers[1].url
    if device == "gpu":
        validate_plan(plan)


@pytest.mark.parametrize("offload", ["cpu", "disk", "mooncake"])
def test_router_replay_with_kv_offload_starts_with_the_plugins_stitching(offload):
    from agentrl.inference.server_flags import ROUTED_OFFLOAD_ENV

    server = build_plan(GLM_AIR, InferenceConfig(kind="single", gpus_per_node=1, kv_offload=offload)).servers[0]
    parsed = validate_vllm_args(server.vllm_args)
    assert parsed.enable_return_routed_experts and server.env[ROUTED_OFFLOAD_ENV] == "1"
    assert parsed.kv_offloading_size == 64.0 if offload == "cpu" else json.loads(
        _flag(server.vllm_args, "--kv-transfer-config"))["kv_role"] == "kv_both"
    plain = build_plan(GLM_AIR, InferenceConfig(kind="single", gpus_per_node=1)).servers[0]
    assert ROUTED_OFFLOAD_ENV not in plain.env


def test_gate_weights_are_recorded_by_the_plugin_and_refused_with_gpu_connectors_in_one_line(tmp_path):
    from agentrl.config import load_config
    from agentrl.inference.server_flags import ROUTED_WEIGHTS_ENV, cpu_server_options

    _, env = cpu_server_options(routed_experts=True, routed_weights=True)
    assert env[ROUTED_WEIGHTS_ENV] == "1"
    assert ROUTED_WEIGHTS_ENV not in cpu_server_options(routed_experts=True)[1]
    assert ROUTED_WEIGHTS_ENV not in cpu_server_options(routed_experts=False, routed_weights=True)[1]
    with pytest.raises(ConfigError, match=r"routed_weights: on GPUs with kv_offload='cpu'") as info:
        load_config(InferenceConfig, overrides=["device=gpu", "routed_weights=true", "kv_offload=cpu"])
    assert "\n" not in str(info.value)
    assert load_config(InferenceConfig, overrides=["device=cpu", "routed_weights=true"]).routed_weights
    # CUDA: vLLM's own --enable-return-routed-experts path carries them (vllm_plugin.routed_weights_cuda)
    gpu = load_config(InferenceConfig, overrides=["device=gpu", "routed_weights=true"])
    server = build_plan(GLM_AIR, gpu.model_copy(update={"kind": "single", "gpus_per_node": 1})).servers[0]
    assert "--enable-return-routed-experts" in server.vllm_args and server.env[ROUTED_WEIGHTS_ENV] == "1"
    assert server.env[ROUTED_EXPERTS_ENV] == "1"


def test_updates_drop_the_cache_of_cpu_servers_that_keep_a_prefix_cache():
    assert not InferenceConfig(device="cpu").recomputes_on_update()
    assert InferenceConfig(device="cpu", prefix_caching=True).recomputes_on_update()
    assert InferenceConfig(device="cpu", recompute_kv_on_weight_update=True).recomputes_on_update()
    assert not InferenceConfig(device="gpu", prefix_caching=True).recomputes_on_update()  # GPUs: vLLM's default
