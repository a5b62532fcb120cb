"""bench/kl_decomposition.py's arithmetic: the loop's k3 estimator on paired logprobs, and the parts of the mismatch
with their shares of what Router Replay leaves."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import kl_decomposition  # noqa: E402


def test_k3_is_the_loops_estimator_and_refuses_unpaired_logprobs():
    assert kl_decomposition.k3_mean([-1.0, -2.0], [-1.0, -2.0]) == 0.0
    x = 0.1
    assert kl_decomposition.k3_mean([-1.0], [-1.0 + x]) == pytest.approx(math.expm1(x) - x)
    assert kl_decomposition.k3_mean([-1.0, -1.0], [-1.1, -0.9]) > 0
    with pytest.raises(ValueError, match="give the same tokens"):
        kl_decomposition.k3_mean([-1.0], [])


def test_the_parts_and_their_shares():
    parts = kl_decomposition.decompose(total_live=4e-4, total_replayed=1e-4, inference_self=2e-5, kernels=7e-5)
    assert parts["routing_flips"] == pytest.approx(3e-4) and parts["r3_reduction"] == pytest.approx(4.0)
    shares = parts["share_of_replayed"]
    assert shares["inference_self"] == pytest.approx(0.2) and shares["kernels"] == pytest.approx(0.7)
    assert shares["unexplained"] == pytest.approx(0.1)
