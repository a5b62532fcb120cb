"""How specialised a MoE's experts are, measured on held-out text: the figures `agentrl pretrain` reports.

Router Replay matters as much as a routing flip changes the model's output, and a flip
changes little while the experts are interchangeable (weights created from a seed). These
figures say where a model stands, per MoE layer, on the same held-out rows, so a trained
model can be set against its own initialisation:

- ``router_entropy``: the mean entropy of each token's routing distribution (the router's
  scores normalised to sum to 1), divided by ln(experts): 1 is indifferent, lower is decided.
- ``load_max_over_mean`` and ``load_cv``: the busiest expert's share of the top-k
  assignments against the mean share (1 is perfectly balanced), and the shares' coefficient
  of variation.
- ``class_nmi`` and ``token_nmi``: the mutual information between the expert an assignment
  goes to and the token's class (lower, upper, digit, space, newline, punct, other) or its
  id, divided by the smaller of the two entropies: 0 when experts see the same mix of
  tokens, 1 when the expert determines the class. ``experts`` lists each expert's load and
  its three most over-represented classes (its share of the class against the layer's).
- ``flip_kl``: the mean per-token KL(live || flipped) of the next-token distribution when, at
  this layer only, every token's weakest chosen expert is swapped for the best expert not
  chosen (the near-tie a numerical difference between trainer and inference flips), the
  routing of every other layer held as it was (replayed). It is what a routing flip costs.

``heldout_nll`` is the mean next-token negative log-likelihood over the same rows. One
process only (the pretraining run's trainer); rows are `trainer.packing.PackedRow`s.
"""

from __future__ import annotations

import math
import string
from typing import Any

import torch
import torch.nn.functional as F

from agentrl.errors import AgentrlError
from agentrl.trainer.models.attention import build_segments
from agentrl.trainer.packing import PackedRow
from agentrl.trainer.trainer import _real_tokens

__all__ = ["TOKEN_CLASSES", "heldout_figures", "token_classes"]

TOKEN_CLASSES = ("lower", "upper", "digit", "space", "newline", "punct", "other")
_TOKEN_NMI_LIMIT = 50_000_000
"""Above experts x vocabulary counts, token_nmi is left out (its table would not fit comfortably)."""


def _token_class(text: str) -> str:
    if "\n" in text:
        return "newline"
    stripped = text.strip()
    if not stripped:
        return "space"
    first = stripped[0]
    if first.islower():
        return "lower"
    if first.isupper():
        return "upper"
    if first.isdigit():
        return "digit"
    return "punct" if first in string.punctuation else "other"


def token_classes(tokenizer: Any, vocab_size: int) -> list[int]:
    """Per token id, the index of its class in `TOKEN_CLASSES` (special and unknown tokens: other)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    other = TOKEN_CLASSES.index("other")
    classes = []
    for token_id in range(vocab_size):
        if token_id in special or token_id >= len(tokenizer):
            classes.append(other)
            continue
        classes.append(TOKEN_CLASSES.index(_token_class(tokenizer.decode([token_id]))))
    return classes


def _entropy(counts: torch.Tensor) -> float:
    p = counts.double() / counts.sum().clamp(min=1)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def _nmi(joint: torch.Tensor) -> float:
    """I(rows; columns) / min(H(rows), H(columns)) of a count table."""
    h_rows, h_cols = _entropy(joint.sum(1)), _entropy(joint.sum(0))
    mutual = h_rows + h_cols - _entropy(joint.flatten())
    smaller = min(h_rows, h_cols)
    return max(0.0, mutual / smaller) if smaller > 0 else 0.0


class _Recorder:
    """Forward hooks on every router: live expert ids, choice scores and routing entropy per call."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        self.enabled = True
        self._handles = [block.router.register_forward_hook(self._hook) for block in blocks]

    def _hook(self, router: torch.nn.Module, inputs: tuple, output: tuple) -> None:
        if not self.enabled:
            return
        x_TD, bias_E = inputs[0], inputs[1] if len(inputs) > 1 else None
        logits = F.linear(x_TD.float(), router.gate.weight.float())
        scores = torch.sigmoid(logits) if router.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        p = scores / scores.sum(-1, keepdim=True).clamp(min=1e-20)
        entropy_T = -(p * p.clamp(min=1e-30).log()).sum(-1)
        choice = scores if bias_E is None else scores + bias_E.float()
        self.calls.append({"ids": output[1].detach(), "choice": choice.detach(), "entropy": entropy_T})

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _flipped(ids_TK: torch.Tensor, choice_TE: torch.Tensor) -> torch.Tensor:
    """Each token's weakest chosen expert replaced by its best unchosen one."""
    chosen_scores = choice_TE.gather(-1, ids_TK)
    weakest = chosen_scores.argmin(-1, keepdim=True)
    masked = choice_TE.scatter(-1, ids_TK, float("-inf"))
    best_unchosen = masked.argmax(-1, keepdim=True)
    return ids_TK.scatter(-1, weakest, best_unchosen)


def _logits(trainer: Any, tokens: torch.Tensor, positions: torch.Tensor, segments: Any, *,
            replay: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits over a row, with every MoE layer's experts replayed when `replay` is given."""
    with torch.no_grad(), torch.autocast(trainer.device.type, dtype=trainer.compute_dtype, enabled=trainer._autocast):
        mask = None if replay is None else torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        return trainer.model(tokens, positions, segments, replay_experts_TLK=replay, replay_mask_T=mask)


def heldout_figures(trainer: Any, rows: list[PackedRow], *, classes: list[int], flip_layers: int = 8) -> dict[str, Any]:
    """The module docstring's figures over `rows` (each row's real tokens), per MoE layer and averaged."""
    if trainer.world != 1:
        raise AgentrlError("routing figures: one process only (run agentrl pretrain without torchrun)")
    model = trainer.model
    blocks = model.moe_blocks()
    if not blocks:
        raise AgentrlError("routing figures: the model has no MoE layers")
    device, args = trainer.device, trainer.args
    experts, vocab = args.num_experts, args.vocab_size
    class_of = torch.tensor(classes, device=device)
    n_classes = len(TOKEN_CLASSES)
    moe_indices = list(args.moe_layers)
    measured = min(flip_layers, len(blocks))
    flip_at = sorted({round(i * (len(blocks) - 1) / max(1, measured - 1)) for i in range(measured)})
    class_counts = torch.zeros(len(blocks), experts, n_classes, dtype=torch.float64, device=device)
    keep_tokens = experts * vocab <= _TOKEN_NMI_LIMIT
    token_counts = torch.zeros(len(blocks), experts * vocab if keep_tokens else 1, dtype=torch.float64, device=device)
    entropy_sum = torch.zeros(len(blocks), dtype=torch.float64, device=device)
    flip_sum = torch.zeros(len(blocks), dtype=torch.float64, device=device)
    nll_sum = predicted = routed_tokens = 0.0
    recorder = _Recorder(blocks)
    was_training = model.training
    model.eval()
    try:
        for row in rows:
            end = _real_tokens(row)
            tokens = row.tokens[:end].to(device)
            positions = row.positions[:end].to(device)
            targets = row.targets[:end].to(device)
            mask = row.loss_mask[:end].to(device)
            segments = build_segments(positions).to(device)
            inputs = (tokens, positions, segments)

            recorder.calls.clear()
            recorder.enabled = True
            live_logprobs = torch.log_softmax(_logits(trainer, *inputs).float(), dim=-1)
            calls = list(recorder.calls)
            nll_sum += float(-(live_logprobs.gather(-1, targets[:, None]).squeeze(-1) * mask).sum())
            predicted += float(mask.sum())
            routed_tokens += tokens.shape[0]
            live_ids = torch.stack([call["ids"] for call in calls], dim=1)  # (T, L, K)
            for index, call in enumerate(calls):
                entropy_sum[index] += call["entropy"].double().sum()
                flat_ids = call["ids"].reshape(-1)
                token_class = class_of[tokens].repeat_interleave(call["ids"].shape[1])
                class_counts[index].view(-1).index_add_(
                    0, flat_ids * n_classes + token_class, torch.ones_like(flat_ids, dtype=torch.float64))
                if keep_tokens:
                    token_ids = tokens.repeat_interleave(call["ids"].shape[1])
                    token_counts[index].index_add_(0, flat_ids * vocab + token_ids,
                                                   torch.ones_like(flat_ids, dtype=torch.float64))
            recorder.enabled = False
            for index in flip_at:
                replay = live_ids.clone()
                replay[:, index] = _flipped(calls[index]["ids"], calls[index]["choice"])
                flipped = torch.log_softmax(_logits(trainer, *inputs, replay=replay).float(), dim=-1)
                kl = (live_logprobs.exp() * (live_logprobs - flipped)).sum(-1)
                flip_sum[index] += kl.double().sum()
    finally:
        recorder.close()
        model.train(was_training)
    log_experts = math.log(experts)
    layers = []
    for index, decoder_layer in enumerate(moe_indices):
        joint = class_counts[index]
        loads = joint.sum(1)
        shares = loads / loads.sum().clamp(min=1)
        overall = joint.sum(0) / joint.sum().clamp(min=1)
        profiles = []
        for expert in range(experts):
            share = joint[expert] / loads[expert].clamp(min=1)
            lift = share / overall.clamp(min=1e-12)
            top = torch.argsort(lift, descending=True)[:3].tolist()
            profiles.append({"load": round(float(shares[expert]), 5),
                             "top_classes": {TOKEN_CLASSES[c]: round(float(share[c]), 4) for c in top}})
        layer = {
            "layer": decoder_layer,
            "router_entropy": float(entropy_sum[index]) / max(routed_tokens, 1) / log_experts,
            "load_max_over_mean": float(shares.max()) * experts,
            "load_cv": float(shares.std(unbiased=False) / shares.mean().clamp(min=1e-12)),
            "class_nmi": _nmi(joint),
            "experts": profiles,
        }
        if keep_tokens:
            layer["token_nmi"] = _nmi(token_counts[index].view(experts, vocab))
        if index in flip_at:
            layer["flip_kl"] = float(flip_sum[index]) / max(routed_tokens, 1)
        layers.append(layer)
    means = {key: sum(layer[key] for layer in layers if key in layer) / max(1, sum(key in layer for layer in layers))
             for key in ("router_entropy", "load_max_over_mean", "load_cv", "class_nmi", "token_nmi", "flip_kl")
             if any(key in layer for layer in layers)}
    return {"heldout_nll": nll_sum / max(predicted, 1.0), "tokens": int(routed_tokens), "mean": means,
            "layers": layers}

