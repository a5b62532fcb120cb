"""Parallel layout for the trainer: planner, memory estimate, and FSDP2 + EP + CP + AC.

Layout over ``world`` ranks (rank = dp_rank * cp + cp_rank):

* FSDP2 (torch's ``fully_shard``; torchtitan's own FSDP wrapper does not import on the
  GPU machines' torch 2.11) shards every dense parameter over all ranks, with bf16
  compute and fp32 gradient reduction. Gradients are *summed* across ranks (divide
  factor 1): the loss is already divided by the global loss-token count.
* Expert parallel (EP): ranks form groups of ``ep`` consecutive ranks; each holds
  ``num_experts / ep`` experts, and tokens travel with torchtitan's all-to-all token
  dispatcher. Experts are FSDP-sharded over the ``world / ep`` ranks holding the same
  experts (torchtitan's "edp" mesh).
* Context parallel (CP): the ``cp`` ranks of a group share a packed row, each taking two
  of its ``2 cp`` chunks (zigzag, balanced causal work); attention all-gathers K/V
  (`models.attention`).
* Activation checkpointing: each decoder layer is recomputed in backward.

`plan_layout` picks ``ep`` (``auto``: the largest divisor of the world size that divides
the expert count) and ``cp`` (``auto``: the smallest degree whose memory estimate fits)
and returns the per-GPU memory estimate that `agentrl train --dry-run` prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agentrl.errors import AgentrlError
from agentrl.trainer.models.args import MoEModelArgs

__all__ = ["LayoutPlan", "plan_layout", "estimate_memory", "Meshes", "build_meshes", "apply_parallelism",
           "clip_grad_norm", "EPTokenDispatcher"]

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
) -> dict[str, float]:
    """Per-GPU peak memory estimate by component (bytes).

    * states: fp32 master weights, fp32 gradients and two fp32 Adam moments, sharded over
      ``world`` (experts over ``ep`` x ``world/ep``): 16 bytes per parameter / world.
    * unsharded_params: with FSDP, the root (embedding, LM head; kept unsharded through
      the step) and one all-gathered layer in compute precision; in one process, the
      autocast copy of the LM head.
    * activations: the saved input of every layer (checkpointing) plus the larger of one
      MoE layer's recompute/backward working set and one logits chunk; without
      checkpointing, every layer's working set.
    """
    counts = args.param_counts()
    tokens = row_tokens // cp
    D, K = args.hidden_size, args.top_k
    states = 16.0 * counts["total"] / world
    head = args.vocab_size * D
    root = head if args.tie_word_embeddings else 2 * head
    layer = args.attention_params() + 3 * D * args.moe_intermediate_size * args.num_shared_experts \
        + args.num_experts * D + args.expert_params_per_layer() / ep
    if world > 1:
        unsharded = compute_bytes * (root + layer)
        residual_bytes = compute_bytes
    else:
        unsharded = compute_bytes * head if compute_bytes < 4 else 0.0
        residual_bytes = 4  # autocast keeps the residual stream in fp32
    moe_working = tokens * K * D * MOE_WORKING_BYTES * (compute_bytes / 2 if compute_bytes < 4 else 1.5)
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
    if activation_checkpointing:
        activations = saved_inputs + max(moe_working + attention_saved, logits)
    else:
        activations = args.num_hidden_layers * moe_working + logits
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
) -> LayoutPlan:
    """Choose ep and cp for ``world`` ranks and estimate memory; one-line errors for impossible layouts."""
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
                               logprob_chunk_tokens=logprob_chunk_tokens)
    if cp == "auto":
        candidates = [d for d in _divisors(world) if d == 1 or row_tokens % (2 * d) == 0]
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
    return LayoutPlan(world=world, cp=cp, ep=ep, row_tokens=row_tokens, memory=_estimate(cp))


# ---------------------------------------------------------------------------------- meshes
@dataclass
class Meshes:
    """Device meshes and groups of one rank for a `LayoutPlan`."""

    fsdp: Any = None
    ep: Any = None
    ep_fsdp: Any = None
    cp_group: Any = None
    dp_rank: int = 0
    cp_rank: int = 0
    rank: int = 0


def build_meshes(plan: LayoutPlan, *, device_type: str) -> Meshes:
    """Create the meshes (needs an initialised process group when ``world > 1``)."""
    if plan.world == 1:
        return Meshes()
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    fsdp = init_device_mesh(device_type, (plan.world,), mesh_dim_names=("fsdp",))
    meshes = Meshes(fsdp=fsdp, rank=rank, dp_rank=rank // plan.cp, cp_rank=rank % plan.cp)
    if plan.ep > 1:
        ep_mesh = init_device_mesh(device_type, (plan.ep_fsdp, plan.ep), mesh_dim_names=("ep_fsdp", "ep"))
        meshes.ep, meshes.ep_fsdp = ep_mesh["ep"], ep_mesh["ep_fsdp"]
    if plan.cp > 1:
        cp_mesh = init_device_mesh(device_type, (plan.dp, plan.cp), mesh_dim_names=("dp", "cp"))
        meshes.cp_group = cp_mesh["cp"].get_group()
    return meshes


# ---------------------------------------------------------------------------------- expert parallel
class _AllToAll(torch.autograd.Function):
    """Variable-size all-to-all whose backward is the reverse all-to-all (works on gloo and NCCL)."""

    @staticmethod
    def forward(ctx, tensor, output_splits, input_splits, group):  # type: ignore[override]
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        out = tensor.new_empty((sum(output_splits),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out = grad.new_empty((sum(ctx.input_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return out, None, None, None


def _torchtitan_plain_collectives() -> None:
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("dtensor")  # use ep_mesh.get_group() rather than spmd_types' global mesh


def _ep_dispatcher_class():
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    class EPTokenDispatcher(AllToAllTokenDispatcher):
        """torchtitan's all-to-all dispatcher with c10d collectives (gloo on CPU, NCCL on GPU)."""

        def _token_count_exchange(self, counts, pg, ep_size):
            out = torch.empty_like(counts)
            dist.all_to_all_single(out, counts.contiguous(), group=self.ep_mesh.get_group())
            return out.view(ep_size, -1)

        def _sync_token_count_exchange(self, counts, received, ep_size):
            received_E = received.reshape(-1)
            input_splits = counts.view(ep_size, -1).sum(dim=1).tolist()
            output_splits = received_E.view(ep_size, -1).sum(dim=1).tolist()
            return received_E, input_splits, output_splits

        def _dispatch_token_exchange(self, routed, pg, output_splits, input_splits):
            return _AllToAll.apply(routed, output_splits, input_splits, self.ep_mesh.get_group())

        def _combine_token_exchange(self, routed_out, pg, input_splits, output_splits):
            return _AllToAll.apply(routed_out, input_splits, output_splits, self.ep_mesh.get_group())

    return EPTokenDispatcher


EPTokenDispatcher = None  # resolved lazily by apply_parallelism (keeps torchtitan out of import time)


def _apply_ep(model: nn.Module, plan: LayoutPlan, meshes: Meshes) -> None:
    _torchtitan_plain_collectives()
    dispatcher_cls = _ep_dispatcher_class()
    ep_rank = meshes.ep.get_local_rank()
    for block in model.moe_blocks():
        experts = block.experts
        local = experts.num_experts // plan.ep
        lo, hi = ep_rank * local, (ep_rank + 1) * local
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(full.detach()[lo:hi].clone(), requires_grad=full.requires_grad))
        experts.num_experts = local
        dispatcher = dispatcher_cls(dispatcher_cls.Config(num_experts=block.num_experts, top_k=block.top_k))
        dispatcher.wire_meshes(ep_mesh=meshes.ep)
        block.dispatcher = dispatcher
        block.expert_range = (lo, hi)


def apply_parallelism(
    model: nn.Module,
    plan: LayoutPlan,
    meshes: Meshes,
    *,
    activation_checkpointing: bool,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> nn.Module:
    """EP slicing, activation checkpointing and FSDP2 wrapping, in that order (in place)."""
    if plan.ep > 1:
        _apply_ep(model, plan, meshes)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for name, layer in list(model.layers.items()):
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
            wrapped.is_moe = layer.is_moe  # the decoder loop reads it
            model.layers[name] = wrapped
    if plan.world == 1:
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.layers.values():
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)
        if plan.ep > 1 and inner.is_moe:
            fully_shard(inner.mlp.experts, mesh=meshes.ep_fsdp, mp_policy=policy)
        fully_shard(layer, mesh=meshes.fsdp, mp_policy=policy)
    fully_shard(model, mesh=meshes.fsdp, mp_policy=policy, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float, *, world: int) -> float:
    """Global L2 gradient norm over every rank's shards (all shards are disjoint); clip if max_norm > 0."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    device = grads[0].to_local().device if isinstance(grads[0], DTensor) else grads[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        total += local.float().pow(2).sum()
    if world > 1:
        dist.all_reduce(total)
    norm = math.sqrt(float(total))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad in grads:
            grad.mul_(scale)
    return norm
