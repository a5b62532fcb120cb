"""Group advantages, the orchestrator's: each rollout's reward minus its group's mean, optionally over the std.

A group is the set of rollouts sampled for one task. ``A_i = r_i - mean(r)``; with
``std_normalize`` it becomes ``(r_i - mean(r)) / (std(r) + eps)`` (population std). A
group whose rewards are all equal gets zero advantages (it carries no signal). With
``negative_scale`` below 1 the negative advantages (rollouts worse than their group) are scaled
down after that: 0 trains only on the rollouts that did better than their group, which raises
their likelihood without pushing the probability of a failed rollout's tokens onto everything
else (what breaks a small policy's output format at higher learning rates).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from agentrl.errors import AgentrlError

__all__ = ["group_advantages", "batch_advantages"]


def group_advantages(rewards: Sequence[float], *, std_normalize: bool = False, eps: float = 1e-6,
                     negative_scale: float = 1.0) -> list[float]:
    """Advantages of one group of rewards."""
    if not 0.0 <= negative_scale <= 1.0:
        raise AgentrlError(f"group_advantages: negative_scale={negative_scale} must be in [0, 1]")
    if not rewards:
        raise AgentrlError("group_advantages: the group is empty; every task needs at least one rollout")
    values = [float(r) for r in rewards]
    if any(math.isnan(v) for v in values):
        raise AgentrlError("group_advantages: a reward is NaN; check the rubric's reward functions")
    mean = sum(values) / len(values)
    centered = [v - mean for v in values]
    if std_normalize:
        std = math.sqrt(sum(c * c for c in centered) / len(values))
        centered = [c / (std + eps) for c in centered]
    return [c * negative_scale if c < 0 else c for c in centered]


def batch_advantages(
    groups: Sequence[Sequence[float]], *, std_normalize: bool = False, eps: float = 1e-6, negative_scale: float = 1.0
) -> list[list[float]]:
    """Advantages for several groups at once, each normalised within its own group."""
    return [group_advantages(group, std_normalize=std_normalize, eps=eps, negative_scale=negative_scale)
            for group in groups]
