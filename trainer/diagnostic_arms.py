"""Router Replay's diagnostic arms (`trainer.router_replay_diagnostics`): one row, scored other ways.

The step trains on one arm (Router Replay of inference's expert ids, with its gate weights where
`router_replay_weights`). With the diagnostics on, each RL row is also scored, without gradient, by:

- live routing: the trainer's own routers choose the experts (`mismatch_kl_live_routing`, and
  `live_routing_agreement`: the share of inference's (token, MoE layer) expert sets the trainer chose alike);
- live routing with the gate in the other precision (float32 against the compute dtype), when the
  trainer computes in a reduced dtype (`mismatch_kl_live_routing_float32_gate` or `..._reduced_gate`);
- the replay arm the step does not train on: the ids without the gate weights, or with them
  (`mismatch_kl_replay_ids`, `mismatch_kl_replay_ids_weights`, over rows that carried gate weights).

`add_arm_stats` adds a row's sums to the step's stats (the same keys on every rank, zeros where a row has
no arm, since the ranks reduce them together); `arm_metrics` turns the reduced sums into metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from agentrl.trainer.loss import compute_loss
from agentrl.trainer.models.attention import query_tail
from agentrl.trainer.packing import PackedRow

if TYPE_CHECKING:
    from agentrl.trainer.trainer import Trainer

__all__ = ["add_arm_stats", "arm_metrics", "set_gate_dtype"]

_STAT_NAMES = (("mismatch_kl_sum", "mismatch_kl_{arm}_sum"), ("mismatch_large_tokens", "mismatch_large_{arm}_tokens"),
               ("mismatch_max_log_ratio", "mismatch_max_log_ratio_{arm}"))


def add_arm_stats(trainer: Trainer, row: PackedRow, window, segments, stats: dict[str, torch.Tensor], *,
                  replay: bool, weighted: bool) -> None:
    """Add the row's diagnostic arms to `stats` (its trained arm's stats: replayed when `replay`, with gate
    weights when `weighted`)."""
    device = trainer.device
    zero = torch.zeros((), device=device)
    if replay:
        live, agree, compared = _live_routing(trainer, row, window, segments)
    else:  # the same keys on every rank (they are reduced together)
        live, agree, compared = stats, zero, zero
    for key, name in _STAT_NAMES:
        stats[name.format(arm="live_routing")] = live[key]
    stats["live_routing_agree_sets"] = agree.to(device)
    stats["live_routing_compared_sets"] = compared.to(device)
    if trainer.compute_dtype != torch.float32:  # live routing, the gate in the other precision
        gate, gate_agree, gate_compared = (_other_gate(trainer, row, window, segments) if replay
                                           else (stats, zero, zero))
        for key, name in _STAT_NAMES:
            stats[name.format(arm="other_gate")] = gate[key]
        stats["other_gate_agree_sets"] = gate_agree.to(device)
        stats["other_gate_compared_sets"] = gate_compared.to(device)
    # The two replay arms on the same samples (rows without gate weights add zeros and no tokens).
    armed = replay and row.routed_weights is not None
    other = _replay_arm(trainer, row, window, segments, weights=not weighted) if armed else None
    for arm, arm_stats in (("replay_ids", other if weighted else stats),
                           ("replay_ids_weights", stats if weighted else other)):
        for key, name in _STAT_NAMES:
            stats[name.format(arm=arm)] = arm_stats[key] if armed else zero
    stats["replay_arm_tokens"] = stats["loss_tokens"] if armed else zero


def arm_metrics(reduced: dict[str, float], loss_tokens: float, *, router_float32: bool) -> dict[str, float]:
    """The arms' metrics from the step's reduced sums (none when the diagnostics were off)."""
    metrics: dict[str, float] = {}

    def add(arm: str, source: str, tokens: float) -> None:
        metrics[f"mismatch_kl_{arm}"] = reduced[f"mismatch_kl_{source}_sum"] / tokens
        metrics[f"mismatch_large_fraction_{arm}"] = reduced[f"mismatch_large_{source}_tokens"] / tokens
        metrics[f"mismatch_max_log_ratio_{arm}"] = reduced[f"mismatch_max_log_ratio_{source}"]

    if "mismatch_kl_live_routing_sum" in reduced:
        add("live_routing", "live_routing", loss_tokens)
    if "mismatch_kl_other_gate_sum" in reduced:
        arm = "live_routing_" + ("reduced_gate" if router_float32 else "float32_gate")
        add(arm, "other_gate", loss_tokens)
        if reduced.get("other_gate_compared_sets"):
            metrics[f"{arm}_agreement"] = reduced["other_gate_agree_sets"] / reduced["other_gate_compared_sets"]
    if reduced.get("replay_arm_tokens"):  # over the loss tokens of rows that carried gate weights
        for arm in ("replay_ids", "replay_ids_weights"):
            add(arm, arm, reduced["replay_arm_tokens"])
    if reduced.get("live_routing_compared_sets"):
        metrics["live_routing_agreement"] = reduced["live_routing_agree_sets"] / reduced["live_routing_compared_sets"]
    return metrics


def _row_stats(trainer: Trainer, row: PackedRow, window, logprobs: torch.Tensor) -> dict[str, Any]:
    device = trainer.device
    _, stats = compute_loss(
        logprobs.float(), inference_logprobs=row.inference_logprobs[window].to(device),
        advantages=row.advantages[window].to(device), loss_mask=row.loss_mask[window].to(device),
        total_loss_tokens=1.0, config=trainer.config.loss,
    )
    return stats


def _live_routing(trainer: Trainer, row: PackedRow, window, segments) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The row under the trainer's own routing (no replay, no gradient): its mismatch stats, and of the
    (token, MoE layer) expert sets inference reported (replay_mask tokens), how many the trainer's routers
    chose alike, out of how many."""
    device = trainer.device
    blocks = trainer.model.moe_blocks()
    needed_T = row.loss_mask[window].to(device)
    for block in blocks:
        block.record_routing = True
    try:
        with torch.no_grad(), trainer.autocast():
            live = trainer.model(row.tokens[window].to(device), row.positions[window].to(device),
                                 segments, targets_T=row.targets[window].to(device), needed_T=needed_T)
        chosen = [block.last_expert_ids for block in blocks]
    finally:
        for block in blocks:
            block.record_routing, block.last_expert_ids = False, None
    reported_TLK = row.routed_experts[window].to(device).long()
    known_T = row.replay_mask[window].to(device)
    agree = torch.zeros((), device=device)
    compared = torch.zeros((), device=device)
    for index, chosen_TK in enumerate(chosen):
        reported_TK, known = reported_TLK[:, index], known_T
        if chosen_TK.shape[0] != reported_TK.shape[0]:  # the last layer ran from each first loss token on
            tail_index = query_tail(segments, needed_T)[1]
            reported_TK, known = reported_TK.index_select(0, tail_index), known.index_select(0, tail_index)
        same = (chosen_TK.sort(dim=-1).values == reported_TK.sort(dim=-1).values).all(dim=-1)
        agree += same[known].sum()
        compared += known.sum()
    return _row_stats(trainer, row, window, live), agree, compared


def set_gate_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Every router's gate in `dtype` (None: float32, the default)."""
    for block in model.moe_blocks():
        block.router.gate_dtype = dtype


def _other_gate(trainer: Trainer, row: PackedRow, window, segments) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """`_live_routing` with the gate in the other precision (float32 <-> the compute dtype)."""
    configured = None if trainer.config.router_float32 else trainer.compute_dtype
    set_gate_dtype(trainer.model, trainer.compute_dtype if configured is None else None)
    try:
        return _live_routing(trainer, row, window, segments)
    finally:
        set_gate_dtype(trainer.model, configured)


def _replay_arm(trainer: Trainer, row: PackedRow, window, segments, *, weights: bool) -> dict:
    """The row's mismatch stats under Router Replay of the expert ids, with inference's gate weights or
    without them (no gradient): the replay arm the step does not train on."""
    device = trainer.device
    with torch.no_grad(), trainer.autocast():
        logprobs = trainer.model(
            row.tokens[window].to(device), row.positions[window].to(device), segments,
            targets_T=row.targets[window].to(device),
            replay_experts_TLK=row.routed_experts[window].to(device),
            replay_mask_T=row.replay_mask[window].to(device),
            replay_weights_TLK=row.routed_weights[window].to(device) if weights else None,
            needed_T=row.loss_mask[window].to(device),
        )
    return _row_stats(trainer, row, window, logprobs)
