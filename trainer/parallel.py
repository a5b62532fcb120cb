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
  (`models.attention`); Mamba-2 layers trade the sequence split for a head split by an
  all-to-all (`all_to_all_rows`, `models.mamba2`) and scan whole documents.
* Activation checkpointing: each decoder layer is recomputed in backward.

`plan_layout` picks ``ep`` (``auto``: the largest divisor of the world size that divides
the expert count) and ``cp`` (``auto``: the smallest degree whose memory estimate fits)
and returns the per-GPU memory estimate that `agentrl train --dry-run` prints; it lives in
the torch-free `agentrl.trainer.layout` and is re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agentrl.trainer.layout import GIB, MOE_WORKING_BYTES, LayoutPlan, estimate_memory, plan_layout

__all__ = ["GIB", "MOE_WORKING_BYTES", "LayoutPlan", "plan_layout", "estimate_memory", "Meshes",
           "build_meshes", "apply_parallelism", "clip_grad_norm", "EPTokenDispatcher", "all_to_all_rows"]


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


def all_to_all_rows(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware all-to-all of row blocks (``input_splits`` rows to each rank; Mamba-2 CP uses it)."""
    return _AllToAll.apply(tensor, output_splits, input_splits, group)


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
            if not hasattr(experts, name):  # non-gated experts have no w3
                continue
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
