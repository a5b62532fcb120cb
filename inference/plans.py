"""Deployment plans: which vLLM processes to start, on which node and GPUs, with which flags.

A plan (`agentrl.inference.deployment.DeploymentPlan`) is pure data computed from a model and a
`InferenceConfig`; nothing is started here. Kinds of deployment:

- `single`: one OpenAI-compatible vLLM server (tensor parallel inside one node, or the CPU).
- `replicas`: N independent servers (data parallel by replication), `vllm-router` in front
  with session affinity (`consistent_hash` on the trajectory id).
- `wide_ep`: one data-parallel + expert-parallel engine spanning nodes
  (`--data-parallel-size`, `--enable-expert-parallel`, DeepEP all2all), FP8 weights with
  DeepGEMM where the GPUs have it.
- `pd`: prefill/decode disaggregation: prefill and decode instances (each a wide-EP engine)
  joined by a KV connector (NIXL or Mooncake), `vllm-router --vllm-pd-disaggregation` in
  front, with a configurable P:D instance ratio.

Each server's flags come from `inference.server_flags`. Any kind may add KV-cache offload: CPU RAM
(`--kv-offloading-size`), CPU + disk (vLLM's
`OffloadingConnector` with a file-system tier) or the Mooncake store connector. Every
server runs `python -m vllm.entrypoints.openai.api_server` with `--enable-scale-out` (the
token-in/out `/inference/v1/generate` endpoint) and `VLLM_SERVER_DEV_MODE=1` (pause,
resume and weight-update endpoints). `agentrl.inference.validate` checks every argument
list with vLLM's own parser.
"""

from __future__ import annotations

import sys
from typing import Literal

from agentrl.config import load_config
from agentrl.errors import AgentrlError, ConfigError
from agentrl.inference.deployment import VLLM_MODULE, DeploymentPlan, InferenceConfig, ProcessSpec
from agentrl.inference.router import router_command
from agentrl.inference.server_flags import server_args

__all__ = ["build_plan", "plan_for_cli"]

_ROUTER_PORT_OFFSET = 100


def _parse_ratio(ratio: str) -> tuple[int, int]:
    try:
        prefill, decode = (int(part) for part in ratio.split(":"))
    except ValueError:
        raise ConfigError(
            f"deployment.prefill_decode_ratio {ratio!r}: expected 'P:D' with two integers, e.g. '1:3'"
        ) from None
    if prefill < 1 or decode < 1:
        raise ConfigError(f"deployment.prefill_decode_ratio {ratio!r}: both sides must be at least 1")
    return prefill, decode


def _address(config: InferenceConfig, node: int) -> str:
    if config.node_addresses:
        if node >= len(config.node_addresses):
            raise ConfigError(
                f"deployment.node_addresses lists {len(config.node_addresses)} nodes but the plan needs"
                f" node {node}; give one address per node"
            )
        return config.node_addresses[node]
    if config.nodes == 1 and config.kind != "pd":
        return config.host
    return f"node{node}"


def _server(config: InferenceConfig, model: str, *, name: str, node: int, port: int, gpus: list[int],
            role: Literal["prefill", "decode"] | None = None) -> ProcessSpec:
    args, env = server_args(config, model, fp8=config.uses_fp8(), role=role)
    args += ["--host", config.host if config.nodes == 1 else "0.0.0.0", "--port", str(port)]
    args += list(config.extra_args)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return ProcessSpec(
        name=name,
        role=role or "server",
        node=node,
        gpus=gpus,
        argv=[sys.executable, "-m", VLLM_MODULE, *args],
        env=env,
        url=f"http://{_address(config, node)}:{port}",
    )


def _ep_instance(
    config: InferenceConfig, model: str, *, role: str, name: str, first_node: int, node_count: int, port: int
) -> list[ProcessSpec]:
    """One data-parallel + expert-parallel engine over `node_count` nodes: API on the first node."""
    fp8 = config.uses_fp8()
    ranks_per_node = config.gpus_per_node // config.tensor_parallel_size
    if ranks_per_node < 1:
        raise ConfigError(
            f"deployment.tensor_parallel_size {config.tensor_parallel_size} exceeds "
            f"gpus_per_node {config.gpus_per_node}"
        )
    dp_size = ranks_per_node * node_count
    head = _address(config, first_node)
    backend = config.prefill_all2all_backend if role == "prefill" else config.decode_all2all_backend
    processes = []
    for offset in range(node_count):
        node = first_node + offset
        args, env = server_args(config, model, fp8=fp8, role=role if config.kind == "pd" else None)
        args += [
            "--data-parallel-size", str(dp_size),
            "--data-parallel-size-local", str(ranks_per_node),
            "--data-parallel-address", head,
            "--data-parallel-rpc-port", str(port + 1000),
            "--enable-expert-parallel",
            "--all2all-backend", backend,
        ]
        if offset == 0:
            args += ["--host", "0.0.0.0", "--port", str(port)]
        else:
            args += ["--headless", "--data-parallel-start-rank", str(offset * ranks_per_node)]
        args += list(config.extra_args)
        gpus = list(range(ranks_per_node * config.tensor_parallel_size))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        processes.append(
            ProcessSpec(
                name=f"{name}-node-{node}",
                role="server" if role == "server" else role,  # type: ignore[arg-type]
                node=node,
                gpus=gpus,
                argv=[sys.executable, "-m", VLLM_MODULE, *args],
                env=env,
                url=f"http://{head}:{port}" if offset == 0 else None,
            )
        )
    return processes


def _router(
    config: InferenceConfig, *, backends: list[str], prefill: list[str] = (), decode: list[str] = ()
) -> ProcessSpec:
    port = config.router_port or config.port + _ROUTER_PORT_OFFSET
    argv = router_command(
        backends, host=config.host, port=port, policy=config.router_policy, prefill_urls=list(prefill),
        decode_urls=list(decode), kv_connector=config.kv_connector, metrics_port=port + 1,
        program=["vllm-router"], workers_healthy=False,
    )
    return ProcessSpec(
        name="router", role="router", node=0, argv=argv, url=f"http://{_address(config, 0)}:{port}"
    )


def build_plan(model: str, config: InferenceConfig) -> DeploymentPlan:
    """Compute the processes of a deployment of `model` (a local path or hub id)."""
    notes: list[str] = []
    processes: list[ProcessSpec] = []
    if config.device == "cpu" and config.kind == "wide_ep":
        raise ConfigError("deployment.kind 'wide_ep' needs GPUs (expert parallel over NCCL/DeepEP); use device='gpu'")
    if config.device == "cpu" and config.tensor_parallel_size != 1:
        raise ConfigError(
            "deployment.tensor_parallel_size: the CPU deployment runs one process per server; set it to 1"
        )
    fp8 = config.uses_fp8()
    if fp8:
        notes.append(f"FP8 weights + KV cache with DeepGEMM ({config.gpu_kind})")

    def gpu_slice(index: int) -> tuple[int, list[int], int]:
        """(node, GPU indices, slot on the node) of the index-th server."""
        if config.device == "cpu":
            return 0, [], index
        per_node = config.gpus_per_node // config.tensor_parallel_size
        node, slot = divmod(index, per_node)
        first = slot * config.tensor_parallel_size
        return node, list(range(first, first + config.tensor_parallel_size)), slot

    if config.kind == "single":
        node, gpus, _ = gpu_slice(0)
        processes.append(_server(config, model, name="server", node=node, port=config.port, gpus=gpus))
        endpoint = processes[0].url
    elif config.kind == "replicas":
        for index in range(config.replicas):
            node, gpus, slot = gpu_slice(index)
            if node >= config.nodes:
                raise ConfigError(
                    f"deployment.replicas {config.replicas} x tensor_parallel_size {config.tensor_parallel_size}"
                    f" does not fit on {config.nodes} node(s) of {config.gpus_per_node} GPUs"
                )
            port = config.port + slot  # servers sharing a node take consecutive ports
            processes.append(_server(config, model, name=f"replica-{index}", node=node, port=port, gpus=gpus))
        router = _router(config, backends=[process.url for process in processes])
        processes.append(router)
        endpoint = router.url
        notes.append(f"router policy {config.router_policy}: a trajectory id (X-Session-ID) sticks to one replica")
    elif config.kind == "wide_ep":
        processes += _ep_instance(
            config, model, role="server", name="ep", first_node=0, node_count=config.nodes, port=config.port
        )
        endpoint = processes[0].url
        notes.append(
            f"wide EP: DP={config.nodes * config.gpus_per_node // config.tensor_parallel_size} ranks with expert"
            f" parallel, all2all {config.decode_all2all_backend}"
        )
    elif config.pd_pair():  # one prefill and one decode server on one node (sharing its GPU), NIXL or a folder between
        node, gpus, _ = gpu_slice(0)
        pair = [_server(config, model, name=role, node=node, port=config.port + offset, gpus=gpus, role=role)
                for offset, role in enumerate(("prefill", "decode"))]
        router = _router(config, backends=[], prefill=[pair[0].url], decode=[pair[1].url])
        processes += [*pair, router]
        endpoint = router.url
        hand_off = ("KV over NIXL" if config.kv_connector == "nixl" else
                    f"KV through files in {config.kv_offload_dir} (agentrl train: a folder per run in it)")
        notes.append(f"P/D pair on one node, {hand_off}; agentrl's token client sends each request to both and "
                     "stitches the prompt's routing (agentrl train's rollouts), vllm-router in P/D mode serves "
                     "OpenAI-style clients")
    else:  # pd
        prefill_share, decode_share = _parse_ratio(config.prefill_decode_ratio)
        instances = config.nodes // config.nodes_per_instance
        if config.nodes % config.nodes_per_instance or instances % (prefill_share + decode_share):
            raise ConfigError(
                f"deployment: {config.nodes} nodes in instances of {config.nodes_per_instance} node(s) cannot be split"
                f" {config.prefill_decode_ratio} into prefill:decode; change nodes, nodes_per_instance or the ratio"
            )
        scale = instances // (prefill_share + decode_share)
        prefill_urls, decode_urls = [], []
        node = 0
        for role, count, urls in (
            ("prefill", prefill_share * scale, prefill_urls),
            ("decode", decode_share * scale, decode_urls),
        ):
            for index in range(count):
                instance = _ep_instance(
                    config, model, role=role, name=f"{role}-{index}", first_node=node,
                    node_count=config.nodes_per_instance, port=config.port,
                )
                processes += instance
                urls.append(instance[0].url)
                node += config.nodes_per_instance
        router = _router(config, backends=[], prefill=prefill_urls, decode=decode_urls)
        processes.append(router)
        endpoint = router.url
        notes.append(
            f"P/D {len(prefill_urls)}:{len(decode_urls)} instances of {config.nodes_per_instance} node(s),"
            f" KV over {config.kv_connector}; prefill all2all {config.prefill_all2all_backend},"
            f" decode all2all {config.decode_all2all_backend}"
        )
    if config.kv_offload != "none":
        notes.append(f"KV offload: {config.kv_offload}")
    return DeploymentPlan(model=model, kind=config.kind, processes=processes, endpoint=endpoint, notes=notes)


def plan_for_cli(
    model: str,
    *,
    deployment_file: str | None = None,
    overrides: list[str] | None = None,
    validate: bool = False,
) -> str:
    """What `agentrl serve --plan` prints: the plan for a model preset, folder or repo id.

    The deployment comes from a TOML file (`InferenceConfig` fields at top level) and
    `--set key=value` overrides (also spelt `inference.key=value`, as `agentrl train --set` names
    the same fields); a preset resolves to its local folder if present, else its
    HF repo id (the path each node will load). With `validate`, every command line is also
    checked with vLLM's and vllm-router's own parsers.
    """
    overrides = [override.removeprefix("inference.") for override in overrides or []]
    config = load_config(InferenceConfig, deployment_file, overrides=overrides)
    target = model
    try:
        from agentrl.models import resolve_model

        spec = resolve_model(model)
        if spec.name == "tiny-moe" or (spec.path is None and spec.hf_repo is None):
            target = str(spec.local_path())
        else:
            target = str(spec.path or spec.hf_repo)
    except AgentrlError:
        pass  # not a known preset or cached folder: plan for the name as given (a hub id on the nodes)
    plan = build_plan(target, config)
    text = plan.render()
    if validate:
        from agentrl.inference.validate import validate_plan

        text += f"\n# validated {validate_plan(plan)} command line(s) with vLLM's and vllm-router's parsers"
    return text
