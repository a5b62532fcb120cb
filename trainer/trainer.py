"""The trainer: one optimizer step of the MoE policy on a packed `TrainBatch`.

    trainer = Trainer(TrainerConfig(...), model_dir="path/to/hf-model")   # every rank
    metrics = trainer.step(pack_samples(samples, row_tokens=..., ...))   # or trainer.train_on_samples(samples)
    trainer.save_checkpoint("runs/x/checkpoints/step_3"); trainer.export_hf("runs/x/hf/step_3")
    # with trainer.lora: export_hf writes the adapters merged in; export_adapter the adapters alone (PEFT)

Run under ``torchrun`` (or any launcher that initialises ``torch.distributed``) for
several ranks; without a process group it trains in one process. Each data-parallel
rank takes every ``dp``-th row of the batch (the batch is padded with empty rows so all
ranks run the same number of micro-batches); CP ranks of a group split each row. The
loss is normalised by the number of loss tokens summed over all ranks, and gradients
are summed across ranks, so the step equals a single-process step on the whole batch.

Metrics: ``loss`` (the step's objective), ``mismatch_kl`` (mean KL(inference || trainer)
over loss tokens, the k3 estimator), ``mismatch_large_fraction`` (loss tokens whose probabilities differ
more than 2x) and ``mismatch_max_log_ratio`` (the largest |log ratio|), each also ``_on_policy``
where a share is, ``masked_fraction`` (loss tokens outside the trust region),
``grad_norm`` (before clipping), ``tokens`` (non-padding tokens), ``loss_tokens``,
``importance_ratio`` (mean), ``skipped`` (1 when a non-finite gradient norm skipped the
update), ``replayed_fraction`` (loss tokens whose experts were replayed
from inference, R3), ``step``, ``policy_version``; when the samples carried routed experts,
``replay_skipped_<reason>`` (loss tokens routed live instead, per reason of
`agentrl.trainer.packing.REPLAY_SKIP_REASONS`: ``no_experts``, ``layout``, ``unknown``,
``router_replay_off``); with ``router_replay_diagnostics``,
``mismatch_kl_live_routing`` (the mismatch KL of the trainer's own routing on the same
samples, also as ``mismatch_large_fraction_live_routing`` and ``mismatch_max_log_ratio_live_routing``)
and ``live_routing_agreement`` (the share of the (token, MoE layer) expert sets
inference reported that the trainer's own routers chose alike); with float16 compute,
``loss_scale``.

Per-token logprobs: ``step(batch, logprobs_of=[i, ...])`` also returns, under
``token_logprobs``, the trainer's logprob of each token of those samples (indices into the
packed samples), taken from the step's own forward pass (no second forward): a list as long
as the sample's ``token_ids``, None for the first token and tokens outside the loss mask (and,
on a rank that computes only part of a row, for the tokens it did not compute: the ranks'
lists are merged by `agentrl.rl.groups.TrainerGroup`), floats rounded to `TOKEN_LOGPROB_DIGITS` digits.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.gpu_memory import GIB, process_gpu_bytes
from agentrl.trainer.checkpoint import export_hf, load_checkpoint, save_checkpoint
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.diagnostic_arms import add_arm_stats, arm_metrics, set_gate_dtype
from agentrl.trainer.loss import LossScale, compute_loss, is_max_stat
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import build_segments, cp_token_index
from agentrl.trainer.models.build import build_model, init_weights
from agentrl.trainer.models.ssd_fla import use_mamba_scan
from agentrl.trainer.models.state_dict import load_hf_weights, load_hf_weights_sharded
from agentrl.trainer.packing import PackedRow, TrainBatch, pack_samples
from agentrl.trainer.parallel import apply_parallelism, build_meshes, clip_grad_norm, plan_layout
from agentrl.types import TrainingSample

__all__ = ["TOKEN_LOGPROB_DIGITS", "Trainer", "resolve_model_dir"]

logger = logging.getLogger("agentrl.trainer")

TOKEN_LOGPROB_DIGITS = 6
"""Decimal digits kept of a returned per-token logprob (well below float32's error at these magnitudes)."""

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_model_dir(name_or_path: str) -> Path:
    """A HF folder path as is, else a preset name resolved by `agentrl.models`."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
        from agentrl.models import ensure_model
    except ImportError as exc:
        raise NotFoundError(
            f"trainer.model={name_or_path!r}: no such folder; pass a Hugging Face model folder"
        ) from exc
    return Path(ensure_model(name_or_path))


class Trainer:
    """Builds the parallel model from a HF folder and runs optimizer steps (see module docstring)."""

    def __init__(self, config: TrainerConfig, *, model_dir: str | Path | None = None,
                 device: str | torch.device | None = None, model_args: MoEModelArgs | None = None) -> None:
        """Build from ``model_dir`` (HF folder, default ``config.model``), or from ``model_args``
        with random weights (benchmarks) when no folder is given."""
        self.config = config
        if model_args is not None and model_dir is None:
            self.model_dir = None
            self.args = model_args
        else:
            self.model_dir = Path(model_dir) if model_dir is not None else resolve_model_dir(config.model)
            self.args = MoEModelArgs.from_hf_dir(self.model_dir)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if device is None:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        parallel = config.parallel
        compute_dtype = _DTYPES[parallel.compute_dtype(self.device.type)]
        from agentrl.trainer.layout import trainable_param_count

        self.plan = plan_layout(
            self.args, world=self.world, row_tokens=config.row_tokens, ep=config.layout_ep(), cp=parallel.cp,
            gpu_memory_bytes=parallel.gpu_memory_gib * 1024**3,
            activation_checkpointing=parallel.activation_checkpointing,
            compute_bytes=compute_dtype.itemsize,
            logprob_chunk_tokens=config.logprob_chunk_tokens,
            trainable_params=trainable_param_count(self.args, config.lora),
        )
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("trainer layout: %s", self.plan.describe())
        torch.manual_seed(config.seed)
        # Several ranks: build on the meta device, shard, then materialise only this rank's
        # shards and read only those tensors from the checkpoint (no rank holds the full model).
        sharded = self.world > 1
        model = build_model(self.args, device="meta" if sharded else self.device)
        lora = config.lora
        if lora is not None:  # before loading, FSDP and EP: the adapters live inside the modules they adapt
            from agentrl.trainer.models.lora import add_adapters

            add_adapters(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets)
        if config.fp8 != "off":  # before loading and sharding: the swapped modules keep their parameters' names
            from agentrl.trainer.models.build import train_in_float8

            train_in_float8(model, experts=config.fp8 == "all", device_type=self.device.type)
        scan = use_mamba_scan(model, config.mamba_scan, device_type=self.device.type)
        if scan and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info("Mamba-2 scan: %s", scan)
        if not sharded:
            self._fill_weights(model)
        model.logprob_chunk_tokens = config.logprob_chunk_tokens
        self.meshes = build_meshes(self.plan, device_type=self.device.type)
        self.ep_rank = self.meshes.ep.get_local_rank() if self.plan.ep > 1 else None
        self.model = apply_parallelism(
            model, self.plan, self.meshes,
            activation_checkpointing=parallel.activation_checkpointing,
            param_dtype=compute_dtype if self.world > 1 else None,
            reduce_dtype=_DTYPES[parallel.reduce_dtype] if self.device.type == "cuda" else None,
        )
        if sharded:
            self.model.to_empty(device=self.device)
            self._fill_weights(self.model, sharded=True)
        self.compute_dtype = compute_dtype
        self._autocast = self.world == 1 and compute_dtype != torch.float32
        if self._autocast and self.device.type == "cpu" and config.round_like_vllm_cpu:
            model.round_like_vllm_cpu(compute_dtype)
        if not config.router_float32 and compute_dtype != torch.float32:
            set_gate_dtype(self.model, compute_dtype)
        self.loss_scale = LossScale() if compute_dtype == torch.float16 else None
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]  # LoRA: the adapters
        experts = [p for n, p in trained if ".experts.w" in n]
        expert_ids = {id(p) for p in experts}
        dense = [p for _, p in trained if id(p) not in expert_ids]
        opt = config.optimizer
        groups = [{"params": dense}] + ([{"params": experts}] if experts else [])
        self.optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                           weight_decay=opt.weight_decay,
                                           **({"fused": True} if self.device.type == "cuda" and self.world == 1
                                              else {"foreach": self.device.type == "cuda"}))
        self.step_count = 0

    def _fill_weights(self, model: torch.nn.Module, *, sharded: bool = False) -> None:
        if self.model_dir is None:
            init_weights(model, seed=self.config.seed)
        elif sharded:
            load_hf_weights_sharded(model, self.model_dir)
        else:
            load_hf_weights(model, self.model_dir)
        if self.config.lora is not None:
            from agentrl.trainer.models.lora import init_adapters

            init_adapters(model, seed=self.config.seed)

    # ------------------------------------------------------------------ stepping
    def pack(self, samples: Sequence[TrainingSample]) -> TrainBatch:
        """Pack samples into this trainer's row budget (with routed experts when R3 is on)."""
        carried = any(s.routed_experts for s in samples)
        replay = self.config.router_replay and carried
        batch = pack_samples(samples, row_tokens=self.config.row_tokens,
                             moe_layers=len(self.args.moe_layers) if replay else None,
                             top_k=self.args.top_k if replay else None, min_rows=self.plan.dp,
                             moe_layer_indices=self.args.moe_layers, num_layers=self.args.num_hidden_layers)
        if carried and not replay:
            batch.replay_skipped = {"router_replay_off": batch.loss_tokens}
        return batch

    def train_on_samples(self, samples: Sequence[TrainingSample], *,
                         logprobs_of: Sequence[int] = ()) -> dict[str, Any]:
        """Pack and take one step (with `logprobs_of`: see the module docstring)."""
        return self.step(self.pack(samples), logprobs_of=logprobs_of)

    def _my_rows(self, batch: TrainBatch) -> list[PackedRow]:
        rows = list(batch.rows)
        for row in rows:
            if row.num_tokens != self.config.row_tokens:
                raise AgentrlError(f"batch row has {row.num_tokens} tokens; this trainer packs rows of "
                                   f"trainer.row_tokens={self.config.row_tokens}")
        moe_layers = len(self.args.moe_layers) if rows and rows[0].routed_experts is not None else None
        while len(rows) % self.plan.dp:
            rows.append(PackedRow.padding(self.config.row_tokens, moe_layers=moe_layers,
                                          top_k=self.args.top_k if moe_layers else None))
        return rows[self.meshes.dp_rank :: self.plan.dp]

    def step(self, batch: TrainBatch, *, logprobs_of: Sequence[int] = ()) -> dict[str, Any]:
        """One optimizer step on the batch (every rank passes the same batch).

        `logprobs_of`: samples whose per-token logprobs come back under ``token_logprobs``.
        """
        if not batch.rows:
            raise AgentrlError("trainer.step: the batch has no rows; pack at least one sample")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model.train()
        rows = self._my_rows(batch)
        cp, cp_rank = self.plan.cp, self.meshes.cp_rank
        cp_window = cp_token_index(self.config.row_tokens, cp_rank=cp_rank, cp_size=cp) if cp > 1 else None
        local_loss_tokens = sum(int(row.loss_mask[_window(row, cp_window)].sum()) for row in rows)
        total = torch.tensor([float(local_loss_tokens)], device=self.device)
        if self.world > 1:
            dist.all_reduce(total)
        total_loss_tokens = float(total.item())
        sums: dict[str, torch.Tensor] = {}
        objective = torch.zeros((), device=self.device)
        wanted = set(logprobs_of)
        token_logprobs: dict[int, list[float | None]] = {}
        for row in rows:
            window = _window(row, cp_window)
            segments = build_segments(row.positions if cp > 1 else row.positions[window], cp_rank=cp_rank,
                                      cp_size=cp, cp_group=self.meshes.cp_group).to(self.device)
            replay = self.config.router_replay and row.routed_experts is not None
            weighted = replay and self.config.router_replay_weights and row.routed_weights is not None
            with self.autocast():
                logprobs = self.model(
                    row.tokens[window].to(self.device), row.positions[window].to(self.device), segments,
                    targets_T=row.targets[window].to(self.device),
                    replay_experts_TLK=row.routed_experts[window].to(self.device) if replay else None,
                    replay_mask_T=row.replay_mask[window].to(self.device) if replay else None,
                    replay_weights_TLK=row.routed_weights[window].to(self.device) if weighted else None,
                    needed_T=row.loss_mask[window].to(self.device),
                )
            loss, stats = compute_loss(
                logprobs.float(),
                inference_logprobs=row.inference_logprobs[window].to(self.device),
                advantages=row.advantages[window].to(self.device),
                loss_mask=row.loss_mask[window].to(self.device),
                total_loss_tokens=total_loss_tokens, config=self.config.loss,
                # Samples whose every token came from the weights this step starts from (the version after
                # `step_count` steps); a sample that spanned an update attends to context of older weights.
                on_policy=None if row.oldest_versions is None else
                (row.oldest_versions[window] == self.step_count).to(self.device),
            )
            if wanted.intersection(row.sample_indices):
                token_logprobs.update(_row_token_logprobs(row, window, logprobs, wanted))
            if self.config.router_replay_diagnostics and "mismatch_kl_sum" in stats:  # RL steps
                add_arm_stats(self, row, window, segments, stats, replay=replay, weighted=weighted)
            (loss * self.loss_scale.value if self.loss_scale else loss).backward()
            objective += loss.detach()
            replayed = (row.replay_mask[window] & row.loss_mask[window]).sum() if replay else 0
            stats["replayed_tokens"] = torch.tensor(float(replayed), device=self.device)
            weights_known = (row.replay_mask[window] & torch.isfinite(row.routed_weights[window]).all(-1).all(-1)
                             & row.loss_mask[window]).sum() if weighted else 0
            stats["replayed_weights_tokens"] = torch.tensor(float(weights_known), device=self.device)
            for key, value in stats.items():
                if is_max_stat(key):
                    sums[key] = torch.maximum(sums[key], value) if key in sums else value
                else:
                    sums[key] = sums.get(key, torch.zeros((), device=self.device)) + value
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.loss_scale:
            for param in params:
                if param.grad is not None:
                    param.grad.div_(self.loss_scale.value)
        grad_norm = clip_grad_norm(params, self.config.optimizer.max_grad_norm, world=self.world)
        skipped = not math.isfinite(grad_norm)
        if self.loss_scale:
            self.loss_scale.update(finite=not skipped)
        if skipped:  # never let a NaN/inf gradient reach the weights or the Adam moments
            logger.warning(
                "trainer step %d: gradient norm is %s; the update is skipped", self.step_count + 1, grad_norm
            )
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        keys = sorted(key for key in sums if not is_max_stat(key))
        maxima = sorted(key for key in sums if is_max_stat(key))
        packed = torch.stack([objective] + [sums[k] for k in keys]).float()
        largest = torch.stack([sums[k] for k in maxima]).float() if maxima else None
        if self.world > 1:
            dist.all_reduce(packed)
            if largest is not None:  # every rank has the same keys (RL steps on every rank)
                dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        reduced = dict(zip(["loss"] + keys, packed.tolist()))
        if largest is not None:
            reduced.update(zip(maxima, largest.tolist()))
        loss_tokens = max(reduced.get("loss_tokens", 0.0), 1.0)
        metrics = {
            "loss": reduced["loss"],
            "loss_tokens": reduced.get("loss_tokens", 0.0),
            "grad_norm": grad_norm,
            "tokens": float(sum(_real_tokens(r) for r in batch.rows)),
            "step": float(self.step_count),
            "skipped": float(skipped),
            "policy_version": float(batch.policy_version),
        }
        metrics["replayed_fraction"] = reduced.get("replayed_tokens", 0.0) / loss_tokens
        metrics["replayed_weights_fraction"] = reduced.get("replayed_weights_tokens", 0.0) / loss_tokens
        # the batch is the same on every rank: its counts need no reduction
        metrics.update({f"replay_skipped_{reason}": float(count) for reason, count in batch.replay_skipped.items()})
        if self.loss_scale:
            metrics["loss_scale"] = self.loss_scale.value
        if self.config.loss.mode == "rl":
            metrics["mismatch_kl"] = reduced["mismatch_kl_sum"] / loss_tokens
            metrics["mismatch_large_fraction"] = reduced["mismatch_large_tokens"] / loss_tokens
            metrics["mismatch_max_log_ratio"] = reduced["mismatch_max_log_ratio"]
            if reduced.get("on_policy_tokens"):  # only the on-policy tokens: inference's numerics against ours
                metrics["mismatch_kl_on_policy"] = reduced["mismatch_kl_on_policy_sum"] / reduced["on_policy_tokens"]
                metrics["mismatch_large_fraction_on_policy"] = (reduced["mismatch_large_on_policy_tokens"]
                                                                / reduced["on_policy_tokens"])
            metrics["on_policy_fraction"] = reduced.get("on_policy_tokens", 0.0) / loss_tokens
            metrics.update(arm_metrics(reduced, loss_tokens, router_float32=self.config.router_float32))
            metrics["masked_fraction"] = reduced["masked_tokens"] / loss_tokens
            metrics["importance_ratio"] = reduced["ratio_sum"] / loss_tokens
        else:
            metrics["nll"] = reduced["nll_sum"] / loss_tokens
        metrics.update(self.memory_metrics())
        if wanted:
            metrics["token_logprobs"] = token_logprobs
        return metrics

    def autocast(self) -> torch.autocast:
        """The forward's autocast context: the compute dtype in one process (off in float32 and under FSDP)."""
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self._autocast)

    def memory_metrics(self) -> dict[str, float]:
        """This process's GPU memory (GiB; none on the CPU): `mem/trainer_peak_gib` (tensors at the peak of the
        step, since `step` reset the counter), `mem/trainer_reserved_gib` (what the allocator holds now),
        `mem/trainer_process_gib` (the driver's count: context and libraries too, where NVML can see it)."""
        if self.device.type != "cuda":
            return {}
        metrics = {"mem/trainer_peak_gib": torch.cuda.max_memory_allocated(self.device) / GIB,
                   "mem/trainer_reserved_gib": torch.cuda.memory_reserved(self.device) / GIB}
        used = process_gpu_bytes(os.getpid())
        if used is not None:
            metrics["mem/trainer_process_gib"] = used / GIB
        return metrics

    def release_cached_memory(self) -> None:
        """Give the allocator's cached blocks back to the GPU (a server sharing it is about to need them)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ state
    def save_checkpoint(self, path: str | Path) -> Path:
        return save_checkpoint(self, path)

    def load_checkpoint(self, path: str | Path) -> int:
        return load_checkpoint(self, path)

    def export_adapter(self, out_dir: str | Path) -> Path | None:
        """The LoRA adapters alone as a PEFT folder (`peft_adapter`); collective, rank 0 writes."""
        from agentrl.trainer.peft_adapter import save_peft_adapter

        return save_peft_adapter(self, out_dir)

    def export_hf(self, out_dir: str | Path, *, dtype: torch.dtype | None = None, digest: bool = False) -> Path | None:
        """HF safetensors of the current weights (in the source checkpoint's dtype unless given); `digest`: their
        digest beside them, for the servers' weight check."""
        if dtype is None and self.model_dir is not None:
            config = json.loads((self.model_dir / "config.json").read_text())
            name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
                name, torch.bfloat16
            )
        return export_hf(self, out_dir, dtype=dtype, digest=digest)


def _window(row: PackedRow, cp_window: torch.Tensor | None) -> torch.Tensor | slice:
    """The row's tokens this rank computes: its CP share, or (without CP) the row up to its padding.

    Without CP nothing needs rows of equal length (FSDP gathers weights, EP exchanges token
    counts), so the padding tail is not computed at all: it never reaches the loss, and as
    one long segment its causal attention cost grows with the square of its length. A row of
    pure padding (a rank's filler row) keeps a few tokens so every rank still runs the layers.
    """
    if cp_window is not None:
        return cp_window
    return slice(0, _real_tokens(row) or min(row.num_tokens, _FILLER_TOKENS))


_FILLER_TOKENS = 8


def _row_token_logprobs(row: PackedRow, window: torch.Tensor | slice, logprobs: torch.Tensor,
                        wanted: set[int]) -> dict[int, list[float | None]]:
    """Per wanted sample of the row: its tokens' logprobs from this forward (None where not computed)."""
    full = torch.full((row.num_tokens,), float("nan"))
    full[window] = logprobs.detach().float().cpu()
    full = torch.where(row.loss_mask, full, torch.full_like(full, float("nan")))
    starts = (row.positions == 0).nonzero().flatten().tolist() + [row.num_tokens]
    found: dict[int, list[float | None]] = {}
    for segment, index in enumerate(row.sample_indices):
        if index not in wanted:
            continue
        values = full[starts[segment]: starts[segment + 1]].tolist()  # target t is token t + 1 of the sample
        found[index] = [None] + [round(v, TOKEN_LOGPROB_DIGITS) if v == v else None for v in values]
    return found


def _real_tokens(row: PackedRow) -> int:
    """Non-padding tokens of a row (padding is the tail after the last sample)."""
    starts = (row.positions == 0).nonzero().flatten().tolist()
    if not row.sample_indices:
        return 0
    pad_start = starts[len(row.sample_indices)] if len(starts) > len(row.sample_indices) else row.num_tokens
    return int(pad_start)
