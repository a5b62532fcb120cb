"""The trainer's parallel layout planner and memory estimate, torch-free at import.

`plan_layout` picks ``ep`` (``auto``: the largest divisor of the world size that divides
the expert count) and ``cp`` (``auto``: the smallest degree whose memory estimate fits)
and returns the per-GPU memory estimate that `agentrl train --dry-run` and `agentrl
trainer-plan` print, so planning needs no torch (a laptop without the `train` extra plans a
GPU cluster). `agentrl.trainer.parallel` applies the layout (FSDP2 + EP + CP + AC) and
re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrl.errors import AgentrlError
from agentrl.trainer.models.args import MoEModelArgs

__all__ = ["GIB", "MOE_WORKING_BYTES", "LayoutPlan", "estimate_memory", "plan_layout"]

GIB = 1024**3


@dataclass
class LayoutPlan:
    """A parallel layout and its per-GPU memory estimate (bytes)."""

    world: int
    cp: int
    ep: int
    row_tokens: int
    memory: dict[str, float] = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def ep_fsdp(self) -> int:
        return self.world // self.ep

    @property
    def estimated_bytes(self) -> float:
        return float(sum(self.memory.values()))

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.memory.items())
        return (f"world={self.world} dp={self.dp} cp={self.cp} ep={self.ep} (experts fsdp={self.ep_fsdp}); "
                f"row_tokens={self.row_tokens}; est. {self.estimated_bytes / GIB:.2f} GiB/GPU [{parts}]")


# Bytes of recompute/backward working set per (token x top_k x hidden) element of one MoE
# layer under activation checkpointing: the routed copies of the tokens (input, bf16 cast,
# expert output, fp32 weighted output) and their gradients. Calibrated on an H200 with
# GLM-4.5-Air-shaped layers at 32k tokens (1 and 2 GPUs: 18.6 and 19.5); see docs/gpu.md.
MOE_WORKING_BYTES = 19.0


def estimate_memory(
    args: MoEModelArgs,
    *,
    world: int,
    ep: int,
    cp: int,
    row_tokens: int,
    activation_checkpointing: bool = True,
    compute_bytes: int = 2,
    logprob_chunk_tokens: int = 4096,
    trainable_params: float | None = None,
) -> dict[str, float]:
    """Per-GPU peak memory estimate by component (bytes).

    * states: fp32 master weights, fp32 gradients and two fp32 Adam moments, sharded over
      ``world`` (experts over ``ep`` x ``world/ep``): 16 bytes per parameter / world. With
      ``trainable_params`` (LoRA: the adapters' count, `lora.adapter_param_count`) only those have
      gradients and moments: 4 bytes per frozen base parameter and 16 per adapter parameter, / world.
    * unsharded_params: with FSDP, the root (embedding, LM head; kept unsharded through
      the step) and one all-gathered layer in compute precision; in one process, the
      autocast copy of the LM head.
    * activations: the saved input of every layer (checkpointing) plus the larger of one
      MoE layer's recompute/backward working set, one Mamba-2 layer's (nemotron_h: its float32
      scan matrices, chunk states and conv buffers, `MoEModelArgs.mamba_working_bytes_per_token`)
      and one logits chunk; without checkpointing, every layer's working set.
    """
    counts = args.param_counts()
    tokens = row_tokens // cp
    D, K = args.hidden_size, args.top_k
    states = (16.0 * counts["total"] if trainable_params is None
              else 4.0 * counts["total"] + 16.0 * trainable_params) / world
    head = args.vocab_size * D
    root = head if args.tie_word_embeddings else 2 * head
    layer = args.attention_params() + 3 * D * args.moe_intermediate_size * args.num_shared_experts \
        + args.num_experts * D + args.expert_params_per_layer() / ep
    if args.layer_types:  # nemotron_h: one mixer per layer; the largest is all-gathered
        layer = max(args.layer_params(i, ep=ep) for i in range(args.num_hidden_layers))
    if world > 1:
        unsharded = compute_bytes * (root + layer)
        residual_bytes = compute_bytes
    else:
        unsharded = compute_bytes * head if compute_bytes < 4 else 0.0
        residual_bytes = 4  # autocast keeps the residual stream in fp32
    moe_working = tokens * K * args.expert_dim * MOE_WORKING_BYTES * (compute_bytes / 2 if compute_bytes < 4 else 1.5)
    # A recomputed layer keeps its attention inputs/outputs for the attention backward while
    # the MoE backward runs: q and o, and the keys/values each query segment reads. Under CP a
    # rank reads keys from the document start ((2cp+1)/(2cp) of the row for one document) and,
    # where varlen has no GQA (torch 2.11), K/V are repeated to every query head.
    heads_q, hd = args.num_attention_heads, args.head_dim
    keys = tokens if cp == 1 else row_tokens * (2 * cp + 1) / (2 * cp)
    kv_heads = args.num_key_value_heads if cp == 1 else heads_q
    attention_saved = compute_bytes * hd * (2 * tokens * heads_q + 2 * keys * kv_heads)
    logits = min(tokens, logprob_chunk_tokens) * args.vocab_size * 4 * 3
    saved_inputs = args.num_hidden_layers * tokens * D * residual_bytes
    mamba = tokens * args.mamba_working_bytes_per_token() if args.mamba_layers else 0.0
    if activation_checkpointing:
        activations = saved_inputs + max(moe_working + attention_saved, mamba, logits)
    else:
        activations = args.num_hidden_layers * moe_working + len(args.mamba_layers) * mamba + logits
    return {"states": states, "unsharded_params": unsharded, "activations": activations}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_layout(
    args: MoEModelArgs,
    *,
    world: int,
    row_tokens: int,
    ep: int | str = "auto",
    cp: int | str = 1,
    gpu_memory_bytes: float = 80 * GIB,
    activation_checkpointing: bool = True,
    compute_bytes: int = 2,
    logprob_chunk_tokens: int = 4096,
    trainable_params: float | None = None,
) -> LayoutPlan:
    """Choose ep and cp for ``world`` ranks and estimate memory (``trainable_params``: see `estimate_memory`);
    one-line errors for impossible layouts."""
    if world < 1:
        raise AgentrlError(f"world size {world}: need at least one rank")
    if ep == "auto":
        ep = max(d for d in _divisors(world) if args.num_experts % d == 0)
    ep = int(ep)
    if ep < 1 or world % ep or args.num_experts % ep:
        raise AgentrlError(
            f"trainer.parallel.ep={ep}: must divide the world size ({world}) and the expert count ({args.num_experts})"
        )
    def _estimate(cp_degree: int) -> dict[str, float]:
        return estimate_memory(args, world=world, ep=ep, cp=cp_degree, row_tokens=row_tokens,
                               activation_checkpointing=activation_checkpointing, compute_bytes=compute_bytes,
                               logprob_chunk_tokens=logprob_chunk_tokens, trainable_params=trainable_params)
    def _mamba_splits(degree: int) -> bool:  # Mamba-2 CP gives each rank heads / cp heads and n_groups / cp groups
        return not args.mamba_layers or (args.mamba_num_heads % degree == 0 and args.mamba_n_groups % degree == 0)
    if cp == "auto":
        candidates = [d for d in _divisors(world) if d == 1 or (row_tokens % (2 * d) == 0 and _mamba_splits(d))]
        for degree in candidates:
            if sum(_estimate(degree).values()) <= gpu_memory_bytes:
                cp = degree
                break
        else:
            best = sum(_estimate(candidates[-1]).values())
            raise AgentrlError(
                f"no layout fits {gpu_memory_bytes / GIB:.0f} GiB/GPU: even cp={candidates[-1]} needs "
                f"~{best / GIB:.1f} GiB; use more GPUs or lower trainer.row_tokens ({row_tokens})"
            )
    cp = int(cp)
    if cp < 1 or world % cp or (cp > 1 and row_tokens % (2 * cp)):
        raise AgentrlError(
            f"trainer.parallel.cp={cp}: must divide the world size ({world}), and 2 x cp must divide "
            f"trainer.row_tokens ({row_tokens})"
        )
    if not _mamba_splits(cp):
        raise AgentrlError(f"trainer.parallel.cp={cp}: Mamba-2 context parallelism splits the heads "
                           f"({args.mamba_num_heads}) and n_groups ({args.mamba_n_groups}) over the CP ranks; "
                           "use a cp that divides both")
    return LayoutPlan(world=world, cp=cp, ep=ep, row_tokens=row_tokens, memory=_estimate(cp))


def trainable_param_count(args: MoEModelArgs, lora: object | None) -> int | None:
    """What the memory plan trains: None (every parameter) without ``lora`` (a `LoraConfig`), else its adapters'
    count (`lora.adapter_param_count`, which needs torch: imported only for a LoRA run)."""
    if lora is None:
        return None
    from agentrl.trainer.models.lora import adapter_param_count

    return adapter_param_count(args, rank=lora.rank, targets=lora.targets)  # type: ignore[attr-defined]
