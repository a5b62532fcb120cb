"""The step-time model of the planner: trainer step, generation, weight sync and the async loop's step.

Pure arithmetic over explicit inputs (`PlanSection`, the `[plan]` section of a run config,
so `--set plan.dense_gemm_tflops=...` moves a prediction), the model's shapes (the planner's
`MoEModelArgs`) and a trainer layout (`LayoutPlan`). It lives in `agentrl.rl` beside
`plan.py` because it predicts a *run* (trainer + inference + weight sync + the orchestrator's
overlap), not one trainer step; it imports no torch.

* Trainer: FLOPs of one step split into dense GEMMs (attention projections, dense and shared
  MLPs, router, LM head), the routed experts' grouped GEMMs and the attention core (QK^T, PV
  at the documents' length; GQA or MLA), forward + recompute + backward under activation
  checkpointing, each at its own rate; AdamW as HBM traffic; FSDP all-gathers (twice per
  micro-batch) and reduce-scatters overlapped with compute, EP all-to-all (dispatch +
  combine, 3 passes) and CP K/V all-gathers (3 passes) exposed; NVLink inside a node,
  InfiniBand across nodes.
* Generation (`agentrl.rl.decode_model`): decode tokens / the inference GPUs' rate plus prefill.
* Weight sync: bf16 weights / `weight_sync_gbs`, not overlapped.
* Loop: max(trainer, generation) + weight sync with ``max_off_policy_steps >= 1``, their sum
  with 0 (synchronous).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pydantic import Field

from agentrl.config import BaseConfig
from agentrl.rl.decode_model import EngineShape, predict_generation
from agentrl.trainer.models.args import MoEModelArgs

__all__ = [
    "MEASURED_WEIGHT_SYNC",
    "PlanSection",
    "TrainerTime",
    "collective_bandwidth",
    "loop_step_s",
    "predict_trainer",
    "weight_sync_s",
    "format_terms",
]


class PlanSection(BaseConfig):
    """Rates, bandwidths and workload shape the step-time model reads; each default says where it is from."""

    dense_gemm_tflops: float = Field(default=662.0, gt=0)
    """bf16 dense GEMM rate per GPU (TFLOP/s). Measured: 8192^3 GEMMs on the H200 in the 1-GPU run of
    bench/trainer_mfu.py (bench/results/trainer_mfu.json `matmul_tflops`; 662-738 across runs)."""
    grouped_gemm_tflops: float = Field(default=155.5, gt=0)
    """bf16 grouped GEMM rate of the routed experts per GPU (TFLOP/s), torchtitan's `torch._grouped_mm`
    path. Fitted with `attention_tflops` and `step_overhead_s` to the three 1-GPU rows (8k/16k/32k) of
    bench/results/trainer_mfu.json (`python3 bench/step_time_check.py --fit`); bench/step_time_check.py
    measures it directly on a GPU."""
    attention_tflops: float = Field(default=460.3, gt=0)
    """Attention core rate (flash varlen QK^T + PV, forward and backward) per GPU (TFLOP/s). Fitted as
    `grouped_gemm_tflops`; measured by bench/step_time_check.py on a GPU."""
    cp_attention_tflops: float = Field(default=288.0, gt=0)
    """Attention core rate on the context-parallel path (all-gathered K/V repeated to every query head,
    zigzag segments) per GPU (TFLOP/s). Fitted to the 2-GPU CP=2 65k row of bench/results/trainer_mfu.json;
    the 131k CP=2 row is held out."""
    step_overhead_s: float = Field(default=0.085, ge=0)
    """Fixed time per trainer micro-batch not in the terms above (routing, permutation, norms, logprob
    softmax), seconds. Fitted as `grouped_gemm_tflops`."""
    hbm_gbs: float = Field(default=4800.0, gt=0)
    """GPU memory bandwidth (GB/s): H200 datasheet 4.8 TB/s. AdamW's pass and vLLM's decode read it."""
    nvlink_gbs: float = Field(default=450.0, gt=0)
    """NVLink bandwidth per GPU per direction inside a node (GB/s): H200 NVLink 4 is 900 GB/s
    bidirectional (datasheet), 450 GB/s each way."""
    infiniband_gbs: float = Field(default=50.0, gt=0)
    """Network bandwidth per GPU across nodes (GB/s): one 400 Gb/s InfiniBand NIC per GPU (NDR, the
    usual H200 node), 50 GB/s each way."""
    weight_sync_gbs: float | None = Field(default=None, gt=0)
    """Bandwidth of the trainer -> inference weight push (GB/s); None: `infiniband_gbs` (trainer rank 0
    broadcasts into vLLM's NCCL engine across nodes; not measured). Measured for comparison (printed with
    the plan): the IPC path on one H200, `MEASURED_WEIGHT_SYNC`."""
    mean_sample_fraction: float = Field(default=0.5, gt=0, le=1)
    """Mean sample length as a share of `model.max_seq_len` (or trainer.row_tokens). Assumed (SWE
    rollouts 'up to 131k' in prime-rl 0.6): not measured."""
    completion_fraction: float = Field(default=0.3, gt=0, le=1)
    """Share of a sample's tokens the policy decodes (the rest are prompts and tool outputs, prefilled).
    Assumed for multi-turn SWE: not measured."""
    prefill_mfu: float = Field(default=0.4, gt=0, le=1)
    """Prefill's share of `dense_gemm_tflops` in vLLM. Assumed from the trainer's measured 41-44% at 32k
    (docs/gpu.md); vLLM prefill was not measured."""
    decode_overhead_s: float | None = Field(default=None, ge=0)
    """vLLM time per decode step outside the weight/KV reads and GEMMs (scheduler, sampler, HTTP), seconds;
    None: fitted to the measured H200 decode table (`agentrl.rl.decode_model.MEASURED_DECODE`)."""
    kv_cache_utilization: float = Field(default=0.9, gt=0, le=1)
    """Share of GPU memory vLLM takes (weights + KV cache): its default gpu_memory_utilization."""
    gpu_memory_gib: float = Field(default=141.0, gt=0)
    """Memory of one inference GPU (GiB of the card; H200: 141 GB)."""


#: (bf16 bytes, seconds, source) of the one weight update measured on an H200: glm-air-5b's 4.93B parameters
#: staged by the trainer and pushed into vLLM's ipc engine (medians of the 30-step async run).
MEASURED_WEIGHT_SYNC = (
    4.93e9 * 2,
    0.568 + 0.570,
    "IPC stage + push on one H200, glm-air-5b, median of 30 steps (bench/results/gpu_loop.json)",
)


@dataclass
class TrainerTime:
    """The trainer step's terms (seconds) and the counts they came from."""

    terms: dict[str, float]
    counts: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        t = self.terms
        return (
            max(t["compute_s"], t["fsdp_s"]) + t["ep_all_to_all_s"] + t["cp_all_gather_s"] + t["optimizer_s"]
        )


def collective_bandwidth(ranks: list[int], inputs: PlanSection, *, gpus_per_node: int) -> float:
    """GB/s per GPU of a collective over these global ranks: NVLink inside one node, else InfiniBand."""
    nodes = {rank // gpus_per_node for rank in ranks}
    return inputs.nvlink_gbs if len(nodes) <= 1 else inputs.infiniband_gbs


def _ring_bytes(total_bytes: float, group: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of `total_bytes` over `group` ranks."""
    return total_bytes * (group - 1) / group if group > 1 else 0.0


def _attention_core_flops(args, mean_context: float) -> float:
    """Forward FLOPs of the attention core per token and layer (QK^T + PV), GQA or MLA."""
    return 2.0 * args.num_attention_heads * (args.head_dim + args.value_head_dim) * mean_context


def _kv_bytes_per_token(args) -> float:
    """bf16 bytes per token and layer CP all-gathers: K and V of the KV heads, or MLA's latent + rope key."""
    if args.is_mla:
        return 2.0 * (args.kv_lora_rank + args.rotary_dim)
    return 2.0 * 2 * args.num_key_value_heads * args.head_dim


def predict_trainer(
    args,
    plan,
    inputs: PlanSection,
    *,
    tokens_per_step: float,
    mean_sample_tokens: float,
    activation_checkpointing: bool = True,
    gpus_per_node: int = 8,
) -> TrainerTime:
    """Trainer step time for `tokens_per_step` tokens in rows of `plan.row_tokens` over `plan`'s layout."""
    D, K = args.hidden_size, args.top_k
    layers, moe_layers = args.num_hidden_layers, len(args.moe_layers)
    dense_layers = layers - moe_layers
    world, ep, cp, dp = plan.world, plan.ep, plan.cp, plan.dp
    micro_batches = max(1, math.ceil(tokens_per_step / plan.row_tokens / dp))
    tokens_per_gpu = plan.row_tokens / cp  # per micro-batch
    layer_passes = 4.0 if activation_checkpointing else 3.0  # forward (+ recompute) + backward (2x)
    shared = 3 * D * args.moe_intermediate_size * args.num_shared_experts
    dense_params = (
        layers * args.attention_params()
        + dense_layers * 3 * D * args.intermediate_size
        + moe_layers * (shared + args.num_experts * D)
    )
    head_params = args.vocab_size * D
    grouped_params = moe_layers * K * 3 * D * args.moe_intermediate_size
    attention_flops = layers * _attention_core_flops(args, mean_sample_tokens / 2)
    per_token = {
        "dense": 2.0 * (layer_passes * dense_params + 3.0 * head_params),
        "grouped": 2.0 * layer_passes * grouped_params,
        "attention": layer_passes * attention_flops,
    }
    work = micro_batches * tokens_per_gpu
    dense_s = work * per_token["dense"] / (inputs.dense_gemm_tflops * 1e12)
    grouped_s = work * per_token["grouped"] / (inputs.grouped_gemm_tflops * 1e12)
    attention_rate = inputs.cp_attention_tflops if cp > 1 else inputs.attention_tflops
    attention_s = work * per_token["attention"] / (attention_rate * 1e12)
    compute_s = dense_s + grouped_s + attention_s + micro_batches * inputs.step_overhead_s

    counts = args.param_counts()
    expert_params = counts["experts"]
    other_params = counts["total"] - expert_params
    dense_bw = collective_bandwidth(list(range(world)), inputs, gpus_per_node=gpus_per_node)
    expert_group = world // ep
    expert_bw = collective_bandwidth(
        [k * ep for k in range(expert_group)], inputs, gpus_per_node=gpus_per_node
    )
    # Per micro-batch: bf16 all-gather in forward and again in backward, fp32 reduce-scatter of gradients.
    fsdp_bytes_dense = _ring_bytes(other_params * (2 * 2 + 4), world)
    fsdp_bytes_experts = _ring_bytes(expert_params / ep * (2 * 2 + 4), expert_group)
    fsdp_s = micro_batches * (fsdp_bytes_dense / (dense_bw * 1e9) + fsdp_bytes_experts / (expert_bw * 1e9))

    ep_s = 0.0
    if ep > 1:
        # dispatch + combine of every routed copy (bf16), in forward, recompute and backward.
        passes = 3 if activation_checkpointing else 2
        sent = passes * 2 * tokens_per_gpu * K * D * 2.0 * (ep - 1) / ep * moe_layers
        on_node = min(ep, gpus_per_node)
        inter_share = (ep - on_node) / (ep - 1)
        ep_s = micro_batches * max(
            sent * (1 - inter_share) / (inputs.nvlink_gbs * 1e9),
            sent * inter_share / (inputs.infiniband_gbs * 1e9),
        )
    cp_s = 0.0
    if cp > 1:
        passes = (
            3 if activation_checkpointing else 2
        )  # all-gather forward (+ recompute), reduce-scatter backward
        received = passes * (cp - 1) * tokens_per_gpu * _kv_bytes_per_token(args) * layers
        cp_s = (
            micro_batches
            * received
            / (collective_bandwidth(list(range(cp)), inputs, gpus_per_node=gpus_per_node) * 1e9)
        )
    # AdamW over this rank's fp32 shard: read weight, grad, two moments; write weight and moments.
    optimizer_s = counts["total"] / world * 28.0 / (inputs.hbm_gbs * 1e9)
    terms = {
        "compute_s": compute_s,
        "dense_gemm_s": dense_s,
        "grouped_gemm_s": grouped_s,
        "attention_s": attention_s,
        "fsdp_s": fsdp_s,
        "ep_all_to_all_s": ep_s,
        "cp_all_gather_s": cp_s,
        "optimizer_s": optimizer_s,
    }
    return TrainerTime(
        terms=terms,
        counts={
            "micro_batches": micro_batches,
            "tokens_per_gpu": tokens_per_gpu,
            "flops_per_token": sum(per_token.values()),
        },
    )


def weight_sync_s(total_params: float, inputs: PlanSection) -> float:
    """bf16 weights from the trainer to the servers at `weight_sync_gbs` (default: InfiniBand)."""
    return total_params * 2.0 / ((inputs.weight_sync_gbs or inputs.infiniband_gbs) * 1e9)


def loop_step_s(*, trainer_s: float, generation_s: float, sync_s: float, max_off_policy_steps: int) -> float:
    """The async loop's steady step: generation overlaps training when off-policy steps are allowed;
    the weight sync (trainer gather + server load, generation paused) is on the critical path either way."""
    if max_off_policy_steps >= 1:
        return max(trainer_s, generation_s) + sync_s
    return trainer_s + generation_s + sync_s


def format_terms(terms: dict[str, float]) -> str:
    """`name value` pairs of a dict of seconds (or counts), for a plan line."""
    return ", ".join(f"{name} {value:.3g}" for name, value in terms.items())


# ------------------------------------------------------------------------------------------ a run
def engine_shape(deployment):
    """Engines, GPUs per engine and FP8 of an inference `InferenceConfig` (P/D counted as engines of
    `nodes_per_instance` nodes, prefill and decode alike)."""
    fp8 = deployment.uses_fp8()
    if deployment.kind == "replicas":
        return EngineShape(
            engines=deployment.replicas, gpus_per_engine=deployment.tensor_parallel_size, fp8=fp8
        )
    if deployment.kind == "wide_ep":
        return EngineShape(engines=1, gpus_per_engine=deployment.nodes * deployment.gpus_per_node, fp8=fp8)
    if deployment.kind == "pd" and not deployment.pd_pair():
        return EngineShape(
            engines=deployment.nodes // deployment.nodes_per_instance,
            gpus_per_engine=deployment.nodes_per_instance * deployment.gpus_per_node,
            fp8=fp8,
        )
    return EngineShape(engines=1, gpus_per_engine=deployment.tensor_parallel_size, fp8=fp8)


@dataclass
class RunPrediction:
    """Predicted seconds per RL step of a run and the inputs and counts behind them."""

    trainer: TrainerTime
    generation: dict[str, float]
    weight_sync_s: float
    loop_s: float
    workload: dict[str, float]
    inputs: PlanSection

    def lines(self) -> list[str]:
        w, g = self.workload, self.generation
        sync_gbs = self.inputs.weight_sync_gbs or self.inputs.infiniband_gbs
        measured_gbs = MEASURED_WEIGHT_SYNC[0] / MEASURED_WEIGHT_SYNC[1] / 1e9
        return [
            f"# workload: {w['samples']:.0f} samples/step x {w['mean_sample_tokens']:.0f} tokens (mean; "
            f"{w['seq_len']:.0f} max), {w['tokens_per_step'] / 1e6:.2f}M tokens/step, {w['concurrency']:.0f} "
            f"rollouts in flight, max_off_policy_steps={w['max_off_policy_steps']:.0f}",
            f"# trainer: {self.trainer.total_s:.1f} s = max(compute, fsdp) + ep_all_to_all + cp_all_gather + "
            f"optimizer [{format_terms(self.trainer.terms)}] ({format_terms(self.trainer.counts)})",
            f"# generation: {g['generation_s']:.1f} s [{format_terms(g)}]",
            f"# weight sync: {self.weight_sync_s:.1f} s (bf16 weights at "
            f"{sync_gbs:.0f} GB/s, not overlapped); measured {measured_gbs:.1f} GB/s end to end by "
            f"{MEASURED_WEIGHT_SYNC[2]}: {self.weight_sync_s * sync_gbs / measured_gbs:.0f} s at that rate",
            f"# predicted step: {self.loop_s:.1f} s "
            + (
                "= max(trainer, generation) + weight sync"
                if w["max_off_policy_steps"] >= 1
                else "= trainer + generation + weight sync (synchronous)"
            ),
            "# inputs: " + ", ".join(f"{k}={v}" for k, v in self.inputs.model_dump().items()),
        ]


def run_workload(config) -> dict[str, float]:
    """Samples, tokens and concurrency of one step of a `RunConfig`."""
    orch = config.orchestrator
    seq_len = config.model.max_seq_len or config.trainer.row_tokens
    mean = config.plan.mean_sample_fraction * seq_len
    samples = orch.groups_per_step * orch.rollouts_per_group
    return {
        "samples": samples,
        "seq_len": seq_len,
        "mean_sample_tokens": mean,
        "tokens_per_step": samples * mean,
        "concurrency": orch.max_concurrent_rollouts,
        "max_off_policy_steps": orch.max_off_policy_steps,
    }


def predict_run(config, layout, args=None) -> RunPrediction:
    """The step-time prediction of a GPU `RunConfig` with its trainer `layout` (`plan.trainer_plan`)."""
    args = args or MoEModelArgs.for_model(config.model.name)
    inputs = config.plan
    workload = run_workload(config)
    trainer = predict_trainer(
        args,
        layout,
        inputs,
        tokens_per_step=workload["tokens_per_step"],
        mean_sample_tokens=workload["mean_sample_tokens"],
        activation_checkpointing=config.trainer.parallel.activation_checkpointing,
        gpus_per_node=config.launch.gpus_per_node,
    )
    generation = predict_generation(
        args,
        engine_shape(config.inference),
        inputs,
        samples=int(workload["samples"]),
        mean_sample_tokens=workload["mean_sample_tokens"],
        concurrency=int(workload["concurrency"]),
    )
    sync = weight_sync_s(args.param_counts()["total"], inputs)
    loop = loop_step_s(
        trainer_s=trainer.total_s,
        generation_s=generation["generation_s"],
        sync_s=sync,
        max_off_policy_steps=int(workload["max_off_policy_steps"]),
    )
    return RunPrediction(
        trainer=trainer,
        generation=generation,
        weight_sync_s=sync,
        loop_s=loop,
        workload=workload,
        inputs=inputs,
    )
