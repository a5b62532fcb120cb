"""Routed experts (Router Replay) as one compact array per sequence.

`RoutedExperts` wraps an `int16` numpy array shaped (tokens, layers, top_k): per token,
per layer, the expert ids inference routed the token to; -1 marks what is unknown (a
token whose experts inference did not report, e.g. the last sampled token, which was
never forwarded). It replaces nested `list[list[list[int]]]` so completions, rollouts and
training samples validate, pickle (Ray) and pack without per-token Python work.

vLLM sends them per request as base64 of a `.npy` array shaped (prompt + completion - 1, layers,
top_k), uint8/uint16 (layers without experts, e.g. GLM's dense first layers, hold zeros):
`decode_routed_experts_array` reads that string and `split_routed_experts` cuts its rows into
prompt rows and completion rows aligned with the tokens (the last sampled token has no row: it
was never forwarded; -1 there).

Gate weights (the third Router Replay arm) travel beside the ids when the server records them
(`inference.routed_weights`): `RoutedExperts.weights` is then a float32 array of the same shape,
NaN where unknown, and vLLM's array is float32 shaped (tokens, layers, top_k, 2), ids then weights
(`routing_arrays` separates them).

`RoutedExpertsField` is the pydantic field type: it validates from a `RoutedExperts`, a
numpy array or nested lists (also the older ragged form where an unknown token is
`[[], [], ...]` or `[]`), and serializes to nested lists with unknown tokens as
`[[], [], ...]`, the JSON shape `results.jsonl` has always had.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
from pydantic import PlainSerializer, PlainValidator, WithJsonSchema

from agentrl.errors import AgentrlError

__all__ = ["EXPERT_DTYPE", "RoutedExperts", "RoutedExpertsField", "decode_routed_experts_array", "routing_arrays",
           "split_routed_experts"]

EXPERT_DTYPE = np.int16
"""Expert ids fit int16 (vLLM sends uint8/uint16; models have at most a few hundred experts)."""
_MAX_ID = int(np.iinfo(EXPERT_DTYPE).max)


class RoutedExperts:
    """(tokens, layers, top_k) int16 expert ids, -1 where unknown, and optionally their gate weights (float32,
    NaN where unknown); compares equal by value."""

    __slots__ = ("array", "weights")
    __hash__ = None  # type: ignore[assignment]  # equal by value, like the lists it replaces

    def __init__(self, array: np.ndarray, weights: np.ndarray | None = None) -> None:
        self.array = _checked(np.asarray(array))
        if weights is not None:
            weights = np.asarray(weights, dtype=np.float32)
            if weights.shape != self.array.shape:
                raise ValueError(f"routed experts: gate weights shaped {weights.shape} for ids shaped "
                                 f"{self.array.shape}")
        self.weights = weights

    @classmethod
    def validate(cls, value: Any) -> RoutedExperts:
        """A `RoutedExperts` as is; an array or (possibly ragged) nested lists converted."""
        if isinstance(value, RoutedExperts):
            return value
        if isinstance(value, np.ndarray):
            return cls(value)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"routed experts: expected an array or nested lists, got {type(value).__name__}")
        try:
            array = np.asarray(value)
            if array.dtype == object:
                raise ValueError("ragged")
        except ValueError:  # ragged: some tokens (or layers) have no experts
            try:
                array = _from_ragged(value)
            except TypeError as error:
                raise ValueError(f"routed experts: expected [token][layer][k] nested lists ({error})") from None
        return cls(array)

    @classmethod
    def assemble(cls, tokens: int, parts: Sequence[tuple[int, RoutedExperts]]) -> RoutedExperts:
        """One (tokens, layers, top_k) array from `(start, rows)` parts; rows no part covers are -1.

        Parts without rows are skipped; the others must agree on (layers, top_k). Gate weights are kept
        when every part has them (NaN where no part covers a token).
        """
        filled = [(start, rows) for start, rows in parts if len(rows)]
        layout = filled[0][1].shape[1:] if filled else (0, 0)
        out = np.full((tokens, *layout), -1, dtype=EXPERT_DTYPE)
        weighted = bool(filled) and all(rows.weights is not None for _, rows in filled)
        weights = np.full((tokens, *layout), np.nan, dtype=np.float32) if weighted else None
        for start, rows in filled:
            if rows.shape[1:] != layout:
                raise ValueError(f"routed experts: rows shaped {rows.shape[1:]} after rows shaped {layout}")
            if start + len(rows) > tokens:
                raise ValueError(f"routed experts: rows {start}..{start + len(rows)} past {tokens} tokens")
            out[start: start + len(rows)] = rows.array
            if weights is not None:
                weights[start: start + len(rows)] = rows.weights
        return cls(out, weights)

    def __getitem__(self, rows: slice) -> RoutedExperts:
        """The rows of a slice of tokens (ids and weights)."""
        return RoutedExperts(self.array[rows], None if self.weights is None else self.weights[rows])

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.array.shape  # type: ignore[return-value]

    def known(self) -> np.ndarray:
        """(tokens,) bool: True where every layer's experts are reported."""
        return (self.array >= 0).all(axis=(1, 2))

    def tolist(self) -> list[list[list[int]]]:
        """Nested lists [token][layer][k]; unknown tokens as `[[], [], ...]` (the JSON shape)."""
        rows = self.array.tolist()
        layers = self.array.shape[1]
        for index in np.flatnonzero(~self.known()).tolist():
            if (self.array[index] < 0).all():
                rows[index] = [[] for _ in range(layers)]
        return rows

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutedExperts):
            try:
                other = RoutedExperts.validate(other)
            except ValueError:
                return NotImplemented
        if (self.weights is None) != (other.weights is None):
            return False
        if self.weights is not None and not np.array_equal(self.weights, other.weights, equal_nan=True):
            return False
        return self.array.shape == other.array.shape and bool(np.array_equal(self.array, other.array))

    def __reduce__(self) -> tuple[type, tuple[np.ndarray, np.ndarray | None]]:
        return RoutedExperts, (self.array, self.weights)

    def __repr__(self) -> str:
        return f"RoutedExperts(shape={self.shape}, known={int(self.known().sum())})"


def _checked(array: np.ndarray) -> np.ndarray:
    if array.size == 0:  # e.g. `[]` or `[[[], []]]`: nothing to check, any dtype
        shape = array.shape + (0,) * (3 - array.ndim) if array.ndim < 3 else array.shape
        return np.zeros(shape, dtype=EXPERT_DTYPE)
    if array.ndim != 3:
        raise ValueError(f"routed experts: expected (tokens, layers, top_k), got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise ValueError(f"routed experts: expected integer expert ids, got {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < -1 or high > _MAX_ID:
        raise ValueError(f"routed experts: ids must lie in -1..{_MAX_ID} (-1: unknown), got {low}..{high}")
    return array.astype(EXPERT_DTYPE, copy=False)


def _from_ragged(rows: Sequence[Any]) -> np.ndarray:
    """Nested lists where unknown tokens/layers are empty -> dense array with -1 there."""
    layers = max((len(row) for row in rows), default=0)
    top_k = max((len(ids) for row in rows for ids in row), default=0)
    out = np.full((len(rows), layers, top_k), -1, dtype=np.int64)
    for index, row in enumerate(rows):
        if len(row) == layers and all(len(ids) == top_k for ids in row):
            out[index] = row
        else:
            for layer, ids in enumerate(row):
                if len(ids) == top_k:
                    out[index, layer] = ids
    return out


RoutedExpertsField = Annotated[
    RoutedExperts,
    PlainValidator(RoutedExperts.validate),
    PlainSerializer(RoutedExperts.tolist, return_type=list),
    WithJsonSchema(
        {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}}
    ),
]
"""Pydantic field type for routed experts (see the module docstring)."""


def decode_routed_experts_array(encoded: str | np.ndarray | None) -> np.ndarray | None:
    """vLLM's base64 `.npy` string -> array (tokens, layers, top_k); None stays None, an array (already decoded,
    e.g. stitched by `clients.prefill_decode`) is checked and passed through."""
    if encoded is None or (isinstance(encoded, str) and not encoded):
        return None
    if isinstance(encoded, np.ndarray):
        array = encoded
    else:
        try:
            array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
        except (ValueError, OSError) as error:
            raise AgentrlError(f"routed_experts: not a base64 .npy array ({error})") from None
    if array.ndim != 3 and not (array.ndim == 4 and array.shape[-1] == 2 and array.dtype.kind == "f"):
        raise AgentrlError(f"routed_experts: expected (tokens, layers, top_k) ids or (tokens, layers, top_k, 2) ids "
                           f"and gate weights, got shape {array.shape}")
    return array


def routing_arrays(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """vLLM's rows -> (expert ids, gate weights or None): a 4-dimensional float array is ids then weights."""
    if rows.ndim == 4:
        return np.rint(rows[..., 0]).astype(EXPERT_DTYPE), rows[..., 1].astype(np.float32)
    return rows, None


def split_routed_experts(
    rows: np.ndarray, *, prompt_len: int, completion_len: int, strict: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Split vLLM's rows into prompt rows and completion rows (one per completion token): ids as int16, gate
    weights (float rows) as float32.

    The last completion token was sampled but never forwarded, so it has no row; its row is
    filled with -1 (weights: NaN) so both arrays line up with the tokens. `strict=False` accepts any row
    count instead of raising: missing rows are -1; with more rows than tokens nobody knows
    which row belongs to which token, so every row is -1 (Router Replay then routes those
    tokens live rather than replaying another token's experts).
    """
    expected = prompt_len + completion_len - 1
    if strict and len(rows) != expected:
        raise AgentrlError(
            f"routed_experts: {len(rows)} rows for {prompt_len} prompt + {completion_len} completion tokens"
            f" (expected {expected})"
        )
    if len(rows) > expected:
        rows = rows[:0]
    ids = rows.dtype.kind in "iu"
    out = np.full((prompt_len + completion_len, *rows.shape[1:]), -1 if ids else np.nan,
                  dtype=EXPERT_DTYPE if ids else np.float32)
    count = min(len(rows), len(out))
    out[:count] = rows[:count]
    return out[:prompt_len], out[prompt_len:]
