"""Causal attention over packed documents, with context parallelism.

A packed row holds several samples back to back; a token may only attend to earlier
tokens of its own sample. `AttentionSegments` describes that as segments: segment *s*
has queries ``[q_start, q_end)`` in the local token tensor and keys ``[k_start, k_end)``
in the key/value tensor, with causality aligned bottom-right (the last query sees the
last key). Two kernels consume it:

* CUDA with bf16: `torch.nn.attention.varlen.varlen_attn` (flash varlen, the kernel
  torchtitan's `VarlenAttention` wraps) with ``cu_seq_q``/``cu_seq_k`` -- always under
  CP, and without CP when the installed torch's varlen takes GQA directly.
* Otherwise (CPU, or GQA without varlen GQA support): one flash/SDPA
  `scaled_dot_product_attention` call per segment with ``enable_gqa``.

Context parallelism (CP): each CP rank holds a contiguous chunk of the row's tokens.
Keys and values are all-gathered across the CP group (autograd-aware), and every
segment's keys run from the document's start to the end of the local query range, so
attention is exact and needs no mask beyond the segments. Gathering K/V (not Q) is the
all-gather CP of Llama 3; with GQA the K/V are the small tensors.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["AttentionSegments", "build_segments", "segment_attention", "gather_kv"]


@dataclass
class AttentionSegments:
    """Per-segment query and key ranges of one packed row (see module docstring)."""

    q_bounds: list[tuple[int, int]]
    """(start, end) of each segment's queries in the local tokens."""
    k_bounds: list[tuple[int, int]]
    """(start, end) of each segment's keys in the (gathered) key/value tensor."""
    cu_seq_q: torch.Tensor
    """int32 cumulative query lengths, for varlen kernels."""
    cu_seq_k: torch.Tensor
    """int32 cumulative key lengths, for varlen kernels."""
    max_q: int
    """Longest query segment."""
    max_k: int
    """Longest key segment."""
    kv_index: torch.Tensor | None
    """Indices into the gathered K/V that lay keys out segment after segment (CP only)."""
    cp_group: object | None = None
    """The CP process group K/V are gathered over, or None without CP."""

    def to(self, device: torch.device) -> "AttentionSegments":
        return AttentionSegments(
            q_bounds=self.q_bounds,
            k_bounds=self.k_bounds,
            cu_seq_q=self.cu_seq_q.to(device),
            cu_seq_k=self.cu_seq_k.to(device),
            max_q=self.max_q,
            max_k=self.max_k,
            kv_index=None if self.kv_index is None else self.kv_index.to(device),
            cp_group=self.cp_group,
        )


def _document_bounds(positions: list[int]) -> list[tuple[int, int]]:
    starts = [i for i, p in enumerate(positions) if p == 0 or i == 0]
    ends = starts[1:] + [len(positions)]
    return list(zip(starts, ends))


def build_segments(
    positions_T: torch.Tensor, *, cp_rank: int = 0, cp_size: int = 1, cp_group: object | None = None
) -> AttentionSegments:
    """Segments for a packed row whose positions restart at 0 at each sample.

    ``positions_T`` is the whole row (all CP ranks' tokens); with ``cp_size > 1`` the
    row is split into ``cp_size`` equal contiguous chunks and this rank's queries are
    chunk ``cp_rank``.
    """
    positions = positions_T.tolist()
    total = len(positions)
    if total % cp_size:
        raise ValueError(f"row length {total} is not divisible by cp={cp_size}")
    chunk = total // cp_size
    lo, hi = cp_rank * chunk, (cp_rank + 1) * chunk
    q_bounds: list[tuple[int, int]] = []
    k_bounds: list[tuple[int, int]] = []
    kv_index: list[torch.Tensor] = []
    k_cursor = 0
    for start, end in _document_bounds(positions):
        q_start, q_end = max(start, lo), min(end, hi)
        if q_start >= q_end:
            continue
        q_bounds.append((q_start - lo, q_end - lo))
        if cp_size == 1:
            k_bounds.append((q_start, q_end))
        else:
            length = q_end - start
            k_bounds.append((k_cursor, k_cursor + length))
            kv_index.append(torch.arange(start, q_end))
            k_cursor += length
    q_lens = [e - s for s, e in q_bounds]
    k_lens = [e - s for s, e in k_bounds]
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return AttentionSegments(
        q_bounds=q_bounds,
        k_bounds=k_bounds,
        cu_seq_q=cu_q,
        cu_seq_k=cu_k,
        max_q=max(q_lens, default=0),
        max_k=max(k_lens, default=0),
        kv_index=torch.cat(kv_index) if cp_size > 1 else None,
        cp_group=cp_group if cp_size > 1 else None,
    )


class _AllGatherRows(torch.autograd.Function):
    """All-gather along dim 0; backward sums the gradient over ranks and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        world = dist.get_world_size(group)
        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None


def gather_kv(tensor: torch.Tensor, group) -> torch.Tensor:
    """Autograd-aware all-gather of this rank's K or V rows over the CP group."""
    return _AllGatherRows.apply(tensor, group)


_VARLEN_PARAMS: set[str] | None = None


def _varlen_params() -> set[str]:
    global _VARLEN_PARAMS
    if _VARLEN_PARAMS is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters)
    return _VARLEN_PARAMS


def _varlen_has_gqa() -> bool:
    return "enable_gqa" in _varlen_params()


def _varlen_attention(q, k, v, segments: AttentionSegments, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    _VARLEN_PARAMS = _varlen_params()
    kwargs: dict = {"scale": scale}
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
    return varlen_attn(q, k, v, segments.cu_seq_q, segments.cu_seq_k, segments.max_q, segments.max_k, **kwargs)


def _sdpa_attention(q, k, v, segments: AttentionSegments, scale: float) -> torch.Tensor:
    pieces = []
    for (qs, qe), (ks, ke) in zip(segments.q_bounds, segments.k_bounds):
        q_len, k_len = qe - qs, ke - ks
        q_seg = q[qs:qe].transpose(0, 1).unsqueeze(0)
        k_seg = k[ks:ke].transpose(0, 1).unsqueeze(0)
        v_seg = v[ks:ke].transpose(0, 1).unsqueeze(0)
        if q_len == k_len:
            o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, is_causal=True, scale=scale, enable_gqa=True)
        else:  # bottom-right causal: query i sees keys <= i + (k_len - q_len)
            keep = torch.arange(k_len, device=q.device)[None, :] <= (
                torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
            )
            o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, attn_mask=keep, scale=scale, enable_gqa=True)
        pieces.append((qs, qe, o[0].transpose(0, 1)))
    if len(pieces) == 1 and pieces[0][0] == 0 and pieces[0][1] == q.shape[0]:
        return pieces[0][2]
    out = q.new_zeros(q.shape, dtype=pieces[0][2].dtype if pieces else q.dtype)
    for qs, qe, o in pieces:
        out = out.index_copy(0, torch.arange(qs, qe, device=q.device), o)
    return out


def segment_attention(
    q_TND: torch.Tensor, k_TND: torch.Tensor, v_TND: torch.Tensor, segments: AttentionSegments, *, scale: float
) -> torch.Tensor:
    """Causal attention per segment; ``(T, heads, head_dim)`` in, same shape out.

    With CP, ``k``/``v`` are this rank's rows; they are gathered here.
    """
    if segments.cp_group is not None:
        k_TND = gather_kv(k_TND, segments.cp_group)
        v_TND = gather_kv(v_TND, segments.cp_group)
        assert segments.kv_index is not None
        k_TND = k_TND.index_select(0, segments.kv_index)
        v_TND = v_TND.index_select(0, segments.kv_index)
    if q_TND.is_cuda and q_TND.dtype in (torch.bfloat16, torch.float16):
        if segments.cp_group is not None or _varlen_has_gqa() or q_TND.shape[1] == k_TND.shape[1]:
            return _varlen_attention(q_TND, k_TND, v_TND, segments, scale)
        # torch without GQA in varlen (2.11): flash SDPA per segment handles GQA natively,
        # where varlen would need K/V repeated to every query head (measured 15% slower at 32k)
    return _sdpa_attention(q_TND, k_TND, v_TND, segments, scale)
