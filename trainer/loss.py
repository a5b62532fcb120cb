"""The training losses: token-level policy gradient with trust-region masking, and SFT.

RL (``mode="rl"``), per loss token *t* with trainer logprob ``lp``, inference logprob
``lp_inf`` and advantage ``A``:

    ratio_t   = exp(lp_t - lp_inf_t)                  # importance ratio trainer / inference
    keep_t    = ratio_low <= ratio_t <= ratio_high     # trust region; tokens outside are masked
    k3_t      = ratio_t - 1 - log(ratio_t)             # KL(inference || trainer) estimator
    loss_t    = -ratio_t * A_t + kl_coef * k3_t        # for kept tokens, 0 otherwise
    loss      = sum_t loss_t / N                       # N = loss tokens over all ranks and rows

The gradient of ``-ratio_t * A_t`` is ``-ratio_t * A_t * grad lp_t``: REINFORCE
importance-weighted towards the inference policy that sampled the tokens. A token whose
inference logprob is not finite is masked (counted in ``masked_tokens``). The mismatch
KL reported every step is the mean of ``k3_t`` over all loss tokens, masked ones included; given
``on_policy`` (the tokens of samples generated wholly by the trainer's current weights), also over
those alone: in an async run the KL of the others carries the policy's own change since they were
sampled, so only the on-policy share measures how far inference's numerics are from the trainer's.
Beside the mean, the R3 paper's and prime-rl's figures of the same samples: the share of loss tokens whose
trainer and inference probabilities differ by more than 2x (``|lp_t - lp_inf_t| > ln 2``), and the
largest ``|lp_t - lp_inf_t|`` (``mismatch_max`` stats are maxima, reduced with max, not summed).
SFT (``mode="sft"``): ``loss = -sum_t lp_t / N`` over loss tokens.

Every statistic is returned as a *sum* so the trainer can add them over micro-batches
and ranks before dividing by the global token count.
"""

from __future__ import annotations

import math

import torch

from agentrl.trainer.config import LossConfig

__all__ = ["LARGE_LOG_RATIO", "LossConfig", "LossScale", "compute_loss", "is_max_stat"]

_MAX_LOG_RATIO = 20.0
LARGE_LOG_RATIO = math.log(2.0)
"""A token whose trainer and inference probabilities differ by more than 2x, either way, is a large deviation."""


def is_max_stat(name: str) -> bool:
    """Whether a `compute_loss` stat is a maximum (combined with max over micro-batches and ranks), not a sum."""
    return name.startswith("mismatch_max")


def compute_loss(
    logprobs: torch.Tensor,
    *,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    total_loss_tokens: float,
    config: LossConfig,
    on_policy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch (already divided by the global loss-token count) and summed stats.

    Stats: ``loss_tokens``, ``masked_tokens`` (outside the trust region),
    ``mismatch_kl_sum``, ``mismatch_large_tokens`` (probabilities more than 2x apart),
    ``mismatch_max_log_ratio`` (a maximum), ``pg_loss_sum``, ``kl_sum``, ``ratio_sum``; with ``on_policy``
    (bool per token) also ``on_policy_tokens``, ``mismatch_kl_on_policy_sum`` and
    ``mismatch_large_on_policy_tokens``.
    """
    mask = loss_mask.bool()
    denominator = max(float(total_loss_tokens), 1.0)
    zero = logprobs.new_zeros(())
    if config.mode == "sft":
        token_loss = torch.where(mask, -logprobs, zero)
        loss = token_loss.sum() / denominator
        stats = {"loss_tokens": mask.sum().float(), "nll_sum": token_loss.detach().sum()}
        return loss, stats
    # A non-finite inference logprob (a broken response) masks its token instead of
    # poisoning the gradient; the log-ratio is clamped so exp() stays finite (NaN x 0 = NaN
    # would otherwise flow back through the masked branch).
    finite = torch.isfinite(inference_logprobs)
    inference_logprobs = torch.where(finite, inference_logprobs, logprobs.detach())
    log_ratio = torch.where(mask, logprobs - inference_logprobs, zero).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    in_region = (ratio >= config.ratio_low) & (ratio <= config.ratio_high) & finite
    keep = mask & in_region
    # k3 = r - 1 - log r >= 0, written as expm1(x) - x: at the on-policy scale (|x| ~ 1e-5 in
    # float32) r - 1 loses the digits and the difference comes out slightly negative.
    k3 = torch.expm1(log_ratio) - log_ratio
    pg = -ratio * advantages
    token_loss = pg + config.kl_coef * k3 if config.kl_coef else pg
    token_loss = torch.where(keep, token_loss, zero)
    loss = token_loss.sum() / denominator
    with torch.no_grad():
        large = log_ratio.abs() > LARGE_LOG_RATIO
        stats = {
            "loss_tokens": mask.sum().float(),
            "masked_tokens": (mask & ~in_region).sum().float(),
            "mismatch_kl_sum": torch.where(mask, k3.clamp_min(0.0), zero).sum(),
            "mismatch_large_tokens": (mask & large).sum().float(),
            "mismatch_max_log_ratio": torch.where(mask, log_ratio.abs(), zero).max(),
            "pg_loss_sum": torch.where(keep, pg, zero).sum(),
            "kl_sum": torch.where(keep, k3, zero).sum(),
            "ratio_sum": torch.where(mask, ratio, zero).sum(),
        }
        if on_policy is not None:
            current = mask & on_policy.bool()
            stats["on_policy_tokens"] = current.sum().float()
            stats["mismatch_kl_on_policy_sum"] = torch.where(current, k3.clamp_min(0.0), zero).sum()
            stats["mismatch_large_on_policy_tokens"] = (current & large).sum().float()
    return loss, stats


class LossScale:
    """Dynamic loss scale for float16 compute: gradients that would underflow float16 are scaled up.

    The trainer multiplies the loss by `value` before backward and divides the gradients by it
    before clipping. A step whose gradient norm is not finite is skipped (the trainer does that
    for any dtype) and halves the scale; `growth_interval` finite steps in a row double it.
    The global gradient norm is already reduced over all ranks, so every rank makes the same
    decision (torch's `GradScaler` checks only local shards).
    """

    def __init__(self, *, initial: float = 2.0**16, growth_interval: int = 200, minimum: float = 1.0,
                 maximum: float = 2.0**24) -> None:
        self.value = float(initial)
        self.growth_interval = growth_interval
        self.minimum, self.maximum = minimum, maximum
        self.good_steps = 0

    def update(self, *, finite: bool) -> None:
        """After a step: back off on overflow, grow after `growth_interval` clean steps."""
        if not finite:
            self.value = max(self.minimum, self.value / 2)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.value = min(self.maximum, self.value * 2)
            self.good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.good_steps = int(state["good_steps"])
