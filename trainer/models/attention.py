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

Context parallelism (CP): the row is cut into 2 x cp chunks and rank *r* holds chunks *r*
and 2cp-1-r (zigzag), which gives every rank the same causal-attention work. Keys and
values are all-gathered across the CP group (autograd-aware), and every segment's keys
run from the document's start to the end of its query range, so attention is exact and
needs no mask beyond the segments. Gathering K/V (not Q) is the all-gather CP of Llama 3;
with GQA the K/V are the small tensors.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["AttentionSegments", "build_segments", "cp_chunks", "cp_token_index", "query_tail", "segment_attention",
           "gather_kv"]


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

    def to(self, device: torch.device) -> AttentionSegments:
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


def cp_chunks(total: int, *, cp_rank: int, cp_size: int) -> list[tuple[int, int]]:
    """The (start, end) token ranges a CP rank holds, in local order (load-balanced zigzag).

    The row is cut into ``2 * cp_size`` equal chunks; rank *r* takes chunks *r* and
    ``2 * cp_size - 1 - r``, so every rank gets the same causal-attention work.
    """
    if cp_size == 1:
        return [(0, total)]
    if total % (2 * cp_size):
        raise ValueError(f"row length {total} is not divisible by 2 x cp = {2 * cp_size}")
    chunk = total // (2 * cp_size)
    return [(r * chunk, (r + 1) * chunk) for r in (cp_rank, 2 * cp_size - 1 - cp_rank)]


def cp_token_index(total: int, *, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Row positions of this CP rank's tokens, in local order."""
    return torch.cat([torch.arange(lo, hi) for lo, hi in cp_chunks(total, cp_rank=cp_rank, cp_size=cp_size)])


def build_segments(
    positions_T: torch.Tensor, *, cp_rank: int = 0, cp_size: int = 1, cp_group: object | None = None
) -> AttentionSegments:
    """Segments for a packed row whose positions restart at 0 at each sample.

    ``positions_T`` is the whole row (all CP ranks' tokens); with ``cp_size > 1`` this
    rank's queries are its `cp_chunks` (load-balanced), and the keys of each segment run
    from its document's start to the query range's end, addressed in the K/V gathered from
    all ranks (rank-major, each rank's tokens in its local order).
    """
    positions = positions_T.tolist()
    total = len(positions)
    documents = _document_bounds(positions)
    q_bounds: list[tuple[int, int]] = []
    k_bounds: list[tuple[int, int]] = []
    kv_index: list[torch.Tensor] = []
    gathered_position = None
    if cp_size > 1:
        order = torch.cat([cp_token_index(total, cp_rank=r, cp_size=cp_size) for r in range(cp_size)])
        gathered_position = torch.empty(total, dtype=torch.long)
        gathered_position[order] = torch.arange(total)
    k_cursor = 0
    local_base = 0
    for lo, hi in cp_chunks(total, cp_rank=cp_rank, cp_size=cp_size):
        for start, end in documents:
            q_start, q_end = max(start, lo), min(end, hi)
            if q_start >= q_end:
                continue
            q_bounds.append((local_base + q_start - lo, local_base + q_end - lo))
            if cp_size == 1:
                k_bounds.append((q_start, q_end))
            else:
                length = q_end - start
                k_bounds.append((k_cursor, k_cursor + length))
                kv_index.append(gathered_position[start:q_end])
                k_cursor += length
        local_base += hi - lo
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


def query_tail(segments: AttentionSegments, needed_T: torch.Tensor) -> tuple[AttentionSegments, torch.Tensor] | None:
    """Segments whose queries run from each segment's first needed token to its end, and those tokens' indices.

    The model's last layer only has to produce the tokens whose output is used (the loss
    tokens); keys and values still come from every token, and bottom-right causal
    alignment gives each kept query exactly the keys it had. A segment with no needed
    token keeps its last token, so no kernel sees an empty segment. The returned segments
    address queries in the kept tokens (in order) and keys as before. None under CP, whose
    zigzag layout keeps every query.
    """
    if segments.cp_group is not None:
        return None
    needed = needed_T.nonzero().flatten().tolist()
    q_bounds: list[tuple[int, int]] = []
    kept: list[torch.Tensor] = []
    cursor = 0
    needed_at = 0
    for start, end in segments.q_bounds:
        while needed_at < len(needed) and needed[needed_at] < start:
            needed_at += 1
        first = needed[needed_at] if needed_at < len(needed) and needed[needed_at] < end else end - 1
        q_bounds.append((cursor, cursor + end - first))
        kept.append(torch.arange(first, end))
        cursor += end - first
    q_lens = [e - s for s, e in q_bounds]
    tail = AttentionSegments(
        q_bounds=q_bounds,
        k_bounds=segments.k_bounds,
        cu_seq_q=torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(segments.cu_seq_q.device),
        cu_seq_k=segments.cu_seq_k,
        max_q=max(q_lens, default=0),
        max_k=segments.max_k,
        kv_index=None,
    )
    index = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long)
    return tail, index.to(needed_T.device)


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


def _split_sizes(bounds: list[tuple[int, int]], total: int) -> tuple[list[int], list[int]] | None:
    """Sizes that cut ``[0, total)`` at every bound (gaps become pieces too) and each bound's piece.

    None when the bounds overlap or are out of order (then pieces cannot be split views).
    """
    sizes: list[int] = []
    index: list[int] = []
    cursor = 0
    for start, end in bounds:
        if start < cursor or end < start:
            return None
        if start > cursor:
            sizes.append(start - cursor)
            cursor = start
        index.append(len(sizes))
        sizes.append(end - start)
        cursor = end
    if cursor > total:
        return None
    if cursor < total:
        sizes.append(total - cursor)
    return sizes, index


def _attend(q_seg, k_seg, v_seg, scale: float) -> torch.Tensor:
    """Bottom-right causal SDPA of one segment, ``(q_len, heads, dim)`` in and out."""
    q_len, k_len = q_seg.shape[0], k_seg.shape[0]
    q_seg, k_seg, v_seg = (t.transpose(0, 1).unsqueeze(0) for t in (q_seg, k_seg, v_seg))
    if q_len == k_len:
        o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, is_causal=True, scale=scale, enable_gqa=True)
    else:  # bottom-right causal: query i sees keys <= i + (k_len - q_len)
        keep = torch.arange(k_len, device=q_seg.device)[None, :] <= (
            torch.arange(q_len, device=q_seg.device)[:, None] + (k_len - q_len)
        )
        o = F.scaled_dot_product_attention(q_seg, k_seg, v_seg, attn_mask=keep, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _sdpa_attention(q, k, v, segments: AttentionSegments, scale: float) -> torch.Tensor:
    q_split = _split_sizes(segments.q_bounds, q.shape[0])
    k_split = _split_sizes(segments.k_bounds, k.shape[0])
    if q_split is not None and k_split is not None:
        # Split views and one cat: backward is one cat of gradients, where per-segment slices
        # and index_copy would each write a zero-filled full-row tensor (measured: a third of
        # the CPU trainer's step on rows of ~70 samples).
        q_pieces = torch.split(q, q_split[0])
        k_pieces, v_pieces = torch.split(k, k_split[0]), torch.split(v, k_split[0])
        outputs: list[torch.Tensor | None] = [None] * len(q_pieces)
        for q_index, k_index in zip(q_split[1], k_split[1]):
            outputs[q_index] = _attend(q_pieces[q_index], k_pieces[k_index], v_pieces[k_index], scale)
        done = [o for o in outputs if o is not None]
        if len(done) == 1 and len(outputs) == 1:
            return done[0]
        dtype = done[0].dtype if done else q.dtype
        return torch.cat([o if o is not None else piece.new_zeros(piece.shape, dtype=dtype)
                          for o, piece in zip(outputs, q_pieces)])
    pieces = [(qs, qe, _attend(q[qs:qe], k[ks:ke], v[ks:ke], scale))
              for (qs, qe), (ks, ke) in zip(segments.q_bounds, segments.k_bounds)]
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
