"""Figures framed against their noise: bootstrap intervals of means, of window deltas and of paired deltas.

A learning claim here is a difference of means (the last steps' reward against the first steps',
a checkpoint's held-out score against its base model's), and a difference is only worth stating
with its interval:

- `bootstrap_interval(values)`: the percentile bootstrap interval of the mean of `values`;
- `window_delta(series, window)`: the mean of the first and of the last `window` values of a run's
  series and the interval of their difference (each window resampled on its own);
- `paired_delta(before, after)`: per-item pairs (the same tasks evaluated twice), the mean of
  `after - before` and its interval (pairs resampled together);
- `paired_ratio(numerator, denominator)`: the ratio of the sums of two paired series (e.g. each
  step's mismatch KL under live routing and under Router Replay) and its interval (pairs resampled).

Deterministic: each takes a seed. numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

__all__ = ["Delta", "bootstrap_interval", "paired_delta", "paired_ratio", "window_delta"]

RESAMPLES = 2000
LEVEL = 0.95


class Delta(BaseModel):
    """A difference of two means with its bootstrap interval."""

    model_config = ConfigDict(extra="forbid")

    before: float
    """Mean of the first window (or of the baseline)."""
    after: float
    """Mean of the last window (or of the candidate)."""
    delta: float
    """after - before."""
    low: float
    """Lower end of the interval of the delta."""
    high: float
    """Upper end of the interval of the delta."""
    n: int
    """Values per window (or pairs)."""

    @property
    def significant(self) -> bool:
        """The interval leaves out zero."""
        return self.low > 0 or self.high < 0

    def text(self, *, digits: int = 3) -> str:
        """`0.852 -> 0.902 (+0.050, 95% CI +0.031 to +0.069)`."""
        return (f"{self.before:.{digits}f} -> {self.after:.{digits}f} ({self.delta:+.{digits}f}, "
                f"{LEVEL:.0%} CI {self.low:+.{digits}f} to {self.high:+.{digits}f})")


def _rng(seed: int):
    import numpy as np

    return np.random.default_rng(seed)


def bootstrap_interval(values: Sequence[float], *, seed: int = 0, resamples: int = RESAMPLES,
                       level: float = LEVEL) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (a single value: that value twice)."""
    import numpy as np

    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("bootstrap_interval: no values")
    means = data[_rng(seed).integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def window_delta(series: Sequence[float], window: int, *, seed: int = 0) -> Delta | None:
    """The first and last `window` values of `series` compared; None when the series has fewer than two windows
    (the window is shrunk to half the series when that is shorter, down to 2)."""
    import numpy as np

    values = [float(value) for value in series if value == value]  # NaN: failed steps
    window = min(window, len(values) // 2)
    if window < 2:
        return None
    first, last = np.asarray(values[:window]), np.asarray(values[-window:])
    rng = _rng(seed)
    picks = rng.integers(0, window, size=(2, RESAMPLES, window))
    deltas = last[picks[1]].mean(axis=1) - first[picks[0]].mean(axis=1)
    tail = (1 - LEVEL) / 2
    return Delta(before=float(first.mean()), after=float(last.mean()), delta=float(last.mean() - first.mean()),
                 low=float(np.quantile(deltas, tail)), high=float(np.quantile(deltas, 1 - tail)), n=window)


def paired_delta(before: Sequence[float], after: Sequence[float], *, seed: int = 0) -> Delta:
    """Mean of `after - before` over pairs (the same items measured twice) with its bootstrap interval."""
    import numpy as np

    a, b = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired_delta: {a.size} and {b.size} values; give the same items, at least one")
    low, high = bootstrap_interval(b - a, seed=seed)
    return Delta(before=float(a.mean()), after=float(b.mean()), delta=float((b - a).mean()), low=low, high=high,
                 n=int(a.size))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float], *,
                 seed: int = 0) -> tuple[float, float, float]:
    """sum(numerator) / sum(denominator) over pairs, and its percentile bootstrap interval (pairs resampled
    together): (ratio, low, high)."""
    import numpy as np

    a, b = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    if a.shape != b.shape or a.size == 0 or b.sum() <= 0:
        raise ValueError(f"paired_ratio: {a.size} and {b.size} values with a positive denominator sum are needed")
    picks = _rng(seed).integers(0, a.size, size=(RESAMPLES, a.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = a[picks].sum(axis=1) / b[picks].sum(axis=1)
    ratios = ratios[np.isfinite(ratios)]
    tail = (1 - LEVEL) / 2
    return float(a.sum() / b.sum()), float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))
