"""Exact weights, checked after every update: the served parameters against the trainer's tensors.

After a weight update loads, and before the server resumes, the publisher asks every server
for the digest of what it now holds (`vllm_worker_ext.WorkerChecks.agentrl_weight_digest`: per
vLLM parameter its dtype, element count, and float64 sum and sum of squares) and compares it
with the digest of the tensors the trainer sent (`agentrl.weight_digest.tensor_digests`). vLLM keeps some tensors
fused (`qkv_proj` = q, k, v; `gate_up_proj`; `experts.w13_weight` = every expert's gate and up;
`fused_qkv_a_proj` for MLA), so each trainer tensor is counted in the served parameter it loads
into (`served_group`), rounded as it reaches that parameter: to its wire dtype (what the
transport sends) and then to the parameter's dtype. Sums of identical values agree to float64
rounding (values of 16-bit floats and their squares are exact in float64), so the tolerance
is tight: a tensor not sent, sent in another dtype, or loaded into the wrong place changes
its group's sums far beyond it, while any change that does not move the served values (a
float32 step smaller than a bf16 step) is, correctly, no difference.

FP8 parameters (`inference.fp8`: vLLM quantizes the bf16 weights it receives, at load and after every
update) cannot equal the trainer's tensors; the worker digests the values they stand for (FP8 times
scale) and each is checked within what one FP8 rounding can move: every value by at most 2^-4 of
itself (3 mantissa bits), or by half the smallest subnormal step times the scale near zero, which
bounds the sum and the sum of squares; and the largest |value| must come back exactly (to float32
rounding), since a scale computed from the weights sent maps it to 448 x scale. So a parameter loaded
without re-quantizing, a scale stale or overwritten, or an update that moved the largest weight and
did not arrive fails; values moved by less than one FP8 rounding are, by design, not seen.
`WeightCheck.fp8_largest_error` reports how close the largest values came.

A mismatch stops the update with `WeightMismatchError`, one line naming the served
parameter, the trainer tensors behind it and both sums. So does a served parameter that no
tensor the trainer sent loads into (a tensor not sent). Trainer tensors the server has no
parameter for (e.g. multi-token-prediction layers vLLM skips) are listed in the result.

The comparison is torch-free; the digest math is `agentrl.weight_digest`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import AgentrlError

__all__ = ["WeightMismatchError", "WeightCheck", "served_group", "group_by_served", "merge_worker_digests",
           "compare_digests"]

RELATIVE_TOLERANCE = 1e-11
"""Of sqrt(numel * sum of squares), which bounds the sum of |values|: float64 summation in another order
stays orders of magnitude inside it, one element moved by one bf16 step of a 1.5-billion-element
parameter does not."""

# vLLM's fused parameters: a checkpoint tensor's name -> the served parameters it may load into (vLLM 0.24
# names routed experts `mlp.experts.w13_weight`, 0.32 `mlp.experts.routed_experts.w13_weight`).
_FUSED = [
    (re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$"),
     (r"\1.w13_weight", r"\1.routed_experts.w13_weight")),
    (re.compile(r"^(.*\.experts)\.\d+\.(down_proj|w2)\.weight$"), (r"\1.w2_weight", r"\1.routed_experts.w2_weight")),
    (re.compile(r"^(.*)\.(q_proj|k_proj|v_proj)\.(weight|bias)$"), (r"\1.qkv_proj.\3",)),
    (re.compile(r"^(.*)\.(gate_proj|up_proj)\.weight$"), (r"\1.gate_up_proj.weight",)),
    (re.compile(r"^(.*)\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"), (r"\1.fused_qkv_a_proj.weight",)),
]


class WeightMismatchError(AgentrlError):
    """The server's weights after an update are not the trainer's."""


class WeightCheck(BaseModel):
    """The outcome of one server's check."""

    model_config = ConfigDict(extra="forbid")

    checked: int
    """Served parameters compared."""
    trainer_tensors: int
    """Trainer tensors counted in them."""
    max_error: float
    """Largest |difference of sums| over its tolerance, over every compared sum (below 1 passes)."""
    unserved: list[str] = Field(default_factory=list)
    """Trainer tensors the server has no parameter for."""
    fp8_checked: int = 0
    """Of the compared parameters, those served in FP8 (checked within one FP8 rounding)."""
    fp8_largest_error: float = 0.0
    """Over the FP8 parameters, the largest relative difference of the largest |value| from the trainer's
    (0 up to float32 rounding for a per-tensor scale computed from the weights sent)."""


def served_group(name: str, served: Mapping[str, Any] | set[str]) -> str | None:
    """The served parameter the checkpoint tensor `name` loads into, None when the server has none."""
    if name in served:
        return name
    for pattern, replacements in _FUSED:
        if pattern.match(name):
            for replacement in replacements:
                group = pattern.sub(replacement, name)
                if group in served:
                    return group
    return None


def group_by_served(names: Iterable[str], served: Mapping[str, Any] | set[str]) -> tuple[dict[str, list[str]],
                                                                                          list[str]]:
    """({served parameter: the checkpoint tensors that load into it}, the tensors no served parameter takes)."""
    groups: dict[str, list[str]] = {}
    unserved = []
    for name in names:
        group = served_group(name, served)
        if group is None:
            unserved.append(name)
        else:
            groups.setdefault(group, []).append(name)
    return groups, unserved


def merge_worker_digests(results: list[Mapping[str, list[Any]]]) -> dict[str, list[Any]]:
    """One digest from each worker's (tensor or expert parallel): a parameter every worker holds alike
    (replicated) counts once, a sharded one is the sum of its shards."""
    if len(results) == 1:
        return dict(results[0])
    merged: dict[str, list[Any]] = {}
    for name in results[0]:
        entries = [result[name] for result in results if name in result]
        if all(entry == entries[0] for entry in entries):
            merged[name] = list(entries[0])
        else:
            merged[name] = [entries[0][0], sum(entry[1] for entry in entries),
                            math.fsum(entry[2] for entry in entries), math.fsum(entry[3] for entry in entries),
                            *([max(entry[4] for entry in entries)] if all(len(e) > 4 for e in entries) else [])]
    return merged


def compare_digests(expected: Mapping[str, Mapping[str, list[float]]], served: Mapping[str, list[Any]], *,
                    where: str, checkpoint: set[str] | None = None) -> WeightCheck:
    """Compare the trainer's per-tensor digests with a server's per-parameter digest; `WeightMismatchError`
    (one line, `where` naming the server and version) on the first parameter whose sums differ.

    A served parameter no sent tensor loads into is an error when a tensor of the server's own checkpoint
    (`checkpoint`: its names) loads into it, or, without those names, when it is a `weight` or `bias`; other
    parameters a server makes itself (e.g. attention's KV-cache scales) are not the trainer's to check.
    """
    groups, unserved = group_by_served(expected, served)
    worst = 0.0
    fp8_checked, fp8_largest = 0, 0.0
    for group, names in groups.items():
        dtype, numel, total, squares = served[group][0], float(served[group][1]), served[group][2], served[group][3]
        if dtype.startswith("float8"):
            error, largest = _fp8_error(expected, served[group], group=group, names=names, where=where)
            worst, fp8_checked, fp8_largest = max(worst, error), fp8_checked + 1, max(fp8_largest, largest)
            continue
        missing = [name for name in names if dtype not in expected[name]]
        if missing:
            raise WeightMismatchError(f"{where}: {group} is served in {dtype}; the trainer's digest of {missing[0]} "
                                      f"has only {', '.join(expected[missing[0]])}")
        want_numel = sum(expected[name][dtype][0] for name in names)
        want_total = math.fsum(expected[name][dtype][1] for name in names)
        want_squares = math.fsum(expected[name][dtype][2] for name in names)
        sources = names[0] if len(names) == 1 else f"{len(names)} trainer tensors from {names[0]}"
        if want_numel != numel:
            raise WeightMismatchError(f"{where}: {group} holds {int(numel)} values, the trainer sent {int(want_numel)} "
                                      f"({sources})")
        error = _relative_error(total, want_total, squares, want_squares, numel)
        worst = max(worst, error)
        if error >= 1.0:
            raise WeightMismatchError(
                f"{where}: {group} differs from the trainer's weights ({sources}): sum {total:.9g} vs {want_total:.9g},"
                f" sum of squares {squares:.9g} vs {want_squares:.9g}"
            )
    if checkpoint:
        owed = {group for name in checkpoint if (group := served_group(name, served)) is not None}
    else:
        owed = {name for name in served if name.endswith(("weight", "bias"))}
    unchecked = sorted(owed - set(groups))
    if unchecked:
        raise WeightMismatchError(f"{where}: the server holds {unchecked[0]}"
                                  f"{f' and {len(unchecked) - 1} more parameters' if len(unchecked) > 1 else ''}"
                                  f" that no tensor the trainer sent loads into")
    return WeightCheck(checked=len(groups), trainer_tensors=sum(map(len, groups.values())), max_error=worst,
                       unserved=sorted(unserved), fp8_checked=fp8_checked, fp8_largest_error=fp8_largest)


FP8_RELATIVE_STEP = 2.0**-4
"""The most one FP8 (e4m3) rounding moves a normal value, relative to it: half a step of 3 mantissa bits."""
FP8_LARGEST_TOLERANCE = 1e-5
"""Of the largest |value|: a scale computed from the weights sent (largest / 448, per tensor, expert or block)
maps the largest value to exactly 448 x scale, so it comes back to float32 rounding."""
FP8_MAX = 448.0
"""The largest e4m3 value: a scale maps a weight's largest |value| to it (or below, for rounded-up scales)."""


def _fp8_error(expected: Mapping[str, Mapping[str, list[float]]], entry: list[Any], *, group: str, names: list[str],
               where: str) -> tuple[float, float]:
    """(difference over tolerance, relative difference of the largest |value|) of an FP8 parameter's dequantized
    digest against the trainer's tensors it was quantized from; `WeightMismatchError` beyond one FP8 rounding."""
    dtype, numel, total, squares = entry[0], float(entry[1]), entry[2], entry[3]
    if dtype.endswith("-unscaled"):
        raise WeightMismatchError(f"{where}: {group} is served in {dtype.removesuffix('-unscaled')} with no scale"
                                  " agentrl can read, so its values cannot be checked; set"
                                  " inference.verify_weights=false to serve it unchecked")
    reference = next((ref for ref in ("bfloat16", "float16", "float32") if all(ref in expected[n] for n in names)),
                     None)
    if reference is None or len(entry) < 5 or any(len(expected[name][reference]) < 4 for name in names):
        raise WeightMismatchError(f"{where}: {group} is served in {dtype}; the digests lack what its check needs")
    want_numel = sum(expected[name][reference][0] for name in names)
    if want_numel != numel:
        raise WeightMismatchError(f"{where}: {group} holds {int(numel)} values, the trainer sent {int(want_numel)}")
    want_total = math.fsum(expected[name][reference][1] for name in names)
    want_squares = math.fsum(expected[name][reference][2] for name in names)
    want_largest = max(expected[name][reference][3] for name in names)
    # Near zero a value moves by at most half the smallest subnormal step (2^-9) times its scale, and a scale is
    # at most twice largest / FP8_MAX (were it rounded up to a power of two).
    near_zero = 2.0 * want_largest / FP8_MAX * 2.0**-10
    spread = math.sqrt(numel * max(squares, want_squares))
    sum_tolerance = FP8_RELATIVE_STEP * spread + numel * near_zero
    squares_tolerance = ((2 * FP8_RELATIVE_STEP + FP8_RELATIVE_STEP**2) * max(squares, want_squares)
                         + 2.2 * near_zero * spread + 2 * numel * near_zero**2)
    largest_tolerance = FP8_LARGEST_TOLERANCE * want_largest
    largest = entry[4]
    error = max(abs(total - want_total) / max(sum_tolerance, 1e-300),
                abs(squares - want_squares) / max(squares_tolerance, 1e-300),
                abs(largest - want_largest) / max(largest_tolerance, 1e-300))
    if error >= 1.0:
        sources = names[0] if len(names) == 1 else f"{len(names)} trainer tensors from {names[0]}"
        raise WeightMismatchError(
            f"{where}: {group} (FP8) is not the trainer's weights within one FP8 rounding ({sources}): sum"
            f" {total:.6g} vs {want_total:.6g}, sum of squares {squares:.6g} vs {want_squares:.6g}, largest |value|"
            f" {largest:.6g} vs {want_largest:.6g}")
    return error, abs(largest - want_largest) / want_largest if want_largest else 0.0


def _relative_error(total: float, want_total: float, squares: float, want_squares: float, numel: float) -> float:
    """The larger difference (sum, sum of squares) over its tolerance: the sum's against sqrt(numel * sum of
    squares) (a bound of the sum of |values|), the sum of squares' against itself (its terms are positive)."""
    largest = max(squares, want_squares)
    if largest == 0.0:
        return 0.0 if total == want_total else math.inf
    sum_error = abs(total - want_total) / (RELATIVE_TOLERANCE * math.sqrt(numel * largest))
    return max(sum_error, abs(squares - want_squares) / (RELATIVE_TOLERANCE * largest))
