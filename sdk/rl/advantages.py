"""Group advantages, the orchestrator's: each rollout's reward minus its group's mean, optionally over the std.

A group is the set of rollouts sampled for one task. ``A_i = r_i - mean(r)``; with
``std_normalize`` it becomes ``(r_i - mean(r)) / (std(r) + eps)`` (population std). A
group whose rewards are all equal gets zero advantages (it carries no signal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from agentrl.errors import AgentrlError

__all__ = ["group_advantages", "batch_advantages"]


def group_advantages(rewards: Sequence[float], *, std_normalize: bool = False, eps: float = 1e-6) -> list[float]:
    """Advantages of one group of rewards."""
    if not rewards:
        raise AgentrlError("group_advantages: the group is empty; every task needs at least one rollout")
    values = [float(r) for r in rewards]
    if any(math.isnan(v) for v in values):
        raise AgentrlError("group_advantages: a reward is NaN; check the rubric's reward functions")
    mean = sum(values) / len(values)
    centered = [v - mean for v in values]
    if not std_normalize:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / len(values))
    return [c / (std + eps) for c in centered]


def batch_advantages(
    groups: Sequence[Sequence[float]], *, std_normalize: bool = False, eps: float = 1e-6
) -> list[list[float]]:
    """Advantages for several groups at once, each normalised within its own group."""
    return [group_advantages(group, std_normalize=std_normalize, eps=eps) for group in groups]
