"""The memory plan of a GPU that a trainer rank and a vLLM server share (`launch.colocate`).

Two processes hold one GPU, and their peaks come at different times:

- while the trainer steps, vLLM holds its share (`inference.gpu_memory_utilization` of the card:
  weights, activations, KV cache, CUDA graphs and its own context) and the trainer its whole working
  set: the planner's tensor estimate (`trainer.layout`), plus, in one process under bf16 autocast, the
  bf16 copy of the largest layer's weights and its bf16 gradient while that layer is recomputed and
  backpropagated, plus the packed IPC buffer it keeps for the run, times what its allocator holds
  beyond its tensors, plus its CUDA context;
- while the weights go over (after each step), the trainer has given its cached blocks back
  (`Trainer.release_cached_memory`) and holds its weights, Adam moments and one packed IPC chunk,
  while vLLM loads checkpoint-format tensors layer by layer: it keeps a layer's incoming tensors
  until the layer is complete and then builds the layer anew beside the old one, so it needs
  about twice the largest layer on top of its share, given back after the update
  (`vllm_worker_ext.WorkerChecks.agentrl_memory(release=True)`). With `inference.weight_format = "kernel"`
  vLLM copies in place instead, and the trainer's buffer grows to the largest fused parameter.

A P/D pair (`inference.kind = "pd"`, `kv_connector = "example"`) puts two servers on the GPU, each with the
share, both loading each update at once: the plan counts the vLLM terms twice.

`shared_gpu_plan(config, layout)` counts both moments; `agentrl train --dry-run` prints it and
`check_resources` refuses a recipe whose larger moment does not fit the card with
`MARGIN_GIB` to spare. The factors come from the H200 (see each constant); each step's
metrics then carry the measured figures (`mem/trainer_peak_gib`, `mem/trainer_process_gib`,
`mem/inference_gib`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from agentrl.trainer.models.args import MoEModelArgs

__all__ = ["MARGIN_GIB", "SharedGpuPlan", "shared_gpu_plan"]

GIB = float(2**30)

ALLOCATOR_FACTOR = 1.05
"""The trainer's reserved memory over its tensors at the peak: 86.8 GiB reserved for 82.4 GiB allocated at step 1
(glm-air-5b, row_tokens 2048, the H200, 2026-12-03)."""

PROCESS_OVERHEAD_GIB = 0.8
"""A process's CUDA context and libraries beyond its allocator: 87.6 GiB (NVML) for the trainer's 86.8 reserved."""

SERVER_OVERHEAD_GIB = 0.1
"""vLLM's process beyond its `gpu_memory_utilization` share (which counts its context): 42.0 GiB at 0.30 of the
H200's 139.8 GiB, 2026-12-03."""

MARGIN_GIB = 3.0
"""Left free on the card at the larger moment."""


class SharedGpuPlan(BaseModel):
    """GiB on one shared GPU at the trainer's step and during a weight update."""

    model_config = ConfigDict(extra="forbid")

    gpu_gib: float
    """The card's memory."""
    server_gib: float
    """vLLM: its `gpu_memory_utilization` share plus what its process holds beyond it (times `servers`)."""
    servers: int = 1
    """vLLM servers on the GPU (2 for a P/D pair)."""
    server_update_gib: float
    """vLLM's extra during a checkpoint-format update: twice the largest layer in the served dtype."""
    trainer_step_gib: float
    """The trainer process at its step's peak: the planner's estimate, the autocast copies of the largest layer,
    the IPC buffer, times `ALLOCATOR_FACTOR`, plus its context."""
    trainer_update_gib: float
    """The trainer during the update: weights and Adam moments, an IPC chunk, its context."""

    @property
    def step_gib(self) -> float:
        return self.trainer_step_gib + self.server_gib

    @property
    def update_gib(self) -> float:
        return self.trainer_update_gib + self.server_gib + self.server_update_gib

    @property
    def peak_gib(self) -> float:
        return max(self.step_gib, self.update_gib)

    def fits(self) -> bool:
        return self.peak_gib + MARGIN_GIB <= self.gpu_gib

    def lines(self) -> list[str]:
        """The `--dry-run` lines."""
        return [
            f"# shared GPU ({self.gpu_gib:.1f} GiB): at the trainer's step {self.step_gib:.1f} GiB = trainer "
            f"{self.trainer_step_gib:.1f} (estimate + a layer's autocast copies + IPC buffer, allocator, context) + "
            f"vLLM {self.server_gib:.1f}",
            f"# during a weight update {self.update_gib:.1f} GiB = trainer {self.trainer_update_gib:.1f} (weights, "
            f"Adam, IPC chunk) + vLLM {self.server_gib:.1f} + its layer-by-layer load {self.server_update_gib:.1f}",
            f"# {'fits' if self.fits() else 'does NOT fit'}: {self.gpu_gib - self.peak_gib:.1f} GiB left at the "
            f"larger moment ({MARGIN_GIB:.0f} GiB kept free)",
        ]

    def problem(self, config: Any) -> str | None:
        """One line saying why the run would run out of memory, None when it fits."""
        if self.fits():
            return None
        share = config.inference.gpu_memory_utilization
        spare = (self.gpu_gib - MARGIN_GIB - (self.peak_gib - self.server_gib)) / self.servers
        hint = (
            "lower inference.gpu_memory_utilization to at most "
            f"{max(spare - SERVER_OVERHEAD_GIB, 0) / self.gpu_gib:.2f}" + (" (each of the P/D pair's two servers)"
                                                                            if self.servers > 1 else "")
            if spare > SERVER_OVERHEAD_GIB
            else "the trainer alone does not fit"
        )
        return (f"trainer and vLLM sharing one {self.gpu_gib:.0f} GiB GPU need {self.peak_gib:.1f} GiB at the "
                f"{'step' if self.step_gib >= self.update_gib else 'weight update'} (+{MARGIN_GIB:.0f} kept free; "
                f"inference.gpu_memory_utilization={share}, trainer.row_tokens={config.trainer.row_tokens}): {hint}, "
                "lower trainer.row_tokens, or set launch.colocate = false")


def shared_gpu_plan(config: Any, layout: Any, *, gpu_gib: float | None = None) -> SharedGpuPlan | None:
    """The plan of a colocated GPU run (None for any other run); `gpu_gib`: the card's memory when known (the
    GPU in hand), else `[plan] gpu_memory_gib`."""
    if not (config.launch.colocate and config.inference.device == "gpu" and config.launch.trainer_gpus):
        return None
    args = MoEModelArgs.for_model(config.model.name)
    card = gpu_gib if gpu_gib is not None else config.plan.gpu_memory_gib
    served_bytes = 1 if config.inference.uses_fp8() else (4 if config.inference_dtype() == "float32" else 2)
    layers = ([args.layer_params(i) for i in range(args.num_hidden_layers)] if args.layer_types else
              [args.attention_params() + args.num_experts * args.hidden_size + args.shared_expert_params()
               + args.expert_params_per_layer()] if args.moe_layers else [args.attention_params()])
    world = config.trainer_world()
    weights_and_adam = 12.0 * args.param_counts()["total"] / world
    compute_bytes = 2 if config.trainer_compute_dtype() in ("bfloat16", "float16") else 0
    autocast_copies = 2 * compute_bytes * max(layers) if world == 1 else 0.0  # weights and their gradient
    chunk = config.weight_transfer().trainer_buffer_gib  # the IPC transport's packed buffer
    fused = 0.0
    if config.inference.weight_format == "kernel":
        # the served layout: the packed buffer grows to the largest fused parameter (at most a layer's experts, in
        # the wire dtype) and one such tensor is made at a time; vLLM copies in place, with no layer-by-layer load
        fused = served_bytes * args.expert_params_per_layer() / GIB if args.moe_layers else 0.0
        chunk = max(chunk, fused)
    servers = 2 if config.inference.pd_pair() else 1
    return SharedGpuPlan(
        gpu_gib=card,
        servers=servers,
        server_gib=servers * ((config.inference.gpu_memory_utilization or 0.9) * card + SERVER_OVERHEAD_GIB),
        server_update_gib=0.0 if fused else servers * 2 * served_bytes * max(layers) / GIB,
        trainer_step_gib=((layout.estimated_bytes + autocast_copies) / GIB + chunk) * ALLOCATOR_FACTOR
        + PROCESS_OVERHEAD_GIB,
        trainer_update_gib=weights_and_adam / GIB + chunk + fused + PROCESS_OVERHEAD_GIB,
    )
