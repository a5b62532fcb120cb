"""The Mamba-2 mixer of NVIDIA Nemotron-3 (NemotronH), in pure torch, over packed documents.

`Mamba2Mixer` holds the checkpoint's parameters under their Hugging Face names (``in_proj``,
``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``) and computes, per token:
``in_proj`` -> (gate z, conv input xBC, step dt); a causal depthwise conv over xBC with SiLU;
the selective state-space scan (SSD) of x with input B, output C, decay ``exp(dt * A)``,
``A = -exp(A_log)``, ``dt = clamp(softplus(dt + dt_bias), dt_min)`` and the ``D`` skip; the gated
RMSNorm ``norm(y * silu(z))`` over ``n_groups`` groups of channels; ``out_proj``.

Packed rows: the conv and the SSM state restart at every document boundary (a document starts
where its position is 0, as `attention.build_segments` reads them), so a row of several samples
gives each sample exactly what it would get alone. `causal_conv` masks the conv taps that
would reach into the previous document; `ssd_scan` is the chunked SSD of Mamba-2 (the
"minimal" torch form transformers falls back to) with the intra-chunk decay matrix, the chunk
states and the inter-chunk recurrence masked at document boundaries, no -inf involved. A mixer whose
``scan_kernel`` is "fla" (`trainer.mamba_scan`, CUDA) runs the same scan through fla's Triton kernels
(`ssd_fla`).

Context parallelism: a CP rank holds a zigzag share of the row's tokens (`attention.cp_chunks`);
a scan needs whole documents. `MambaSequences.for_row` describes the row once per forward; under
CP each Mamba layer exchanges its conv input and dt by an all-to-all over heads (each rank then
holds every token of the row for ``heads / cp`` heads and ``n_groups / cp`` B/C groups), scans
whole documents, and a second all-to-all restores the sequence sharding before the gated norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.errors import AgentrlError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import cp_token_index
from agentrl.trainer.models.ssd_fla import ssd_scan_gla
from agentrl.trainer.parallel import all_to_all_rows

__all__ = ["Mamba2Mixer", "MambaSequences", "causal_conv", "ssd_scan", "gated_rms_norm"]


@dataclass
class MambaSequences:
    """Document layout of one packed row as the Mamba layers need it."""

    doc_T: torch.Tensor
    """(T,) int64 document number of each token of the whole row, in row order (non-decreasing)."""
    cp_group: object | None = None
    """The CP process group, or None without CP."""
    to_row: torch.Tensor | None = None
    """CP: indices that put the tokens gathered from the CP ranks (rank-major) in row order."""
    to_gathered: torch.Tensor | None = None
    """CP: the inverse of ``to_row``."""

    @classmethod
    def for_row(cls, positions_T: torch.Tensor, *, cp_group: object | None = None) -> MambaSequences:
        """From this rank's positions (restarting at 0 per document); under CP, gathers the row's."""
        if cp_group is None:
            return cls(doc_T=_documents(positions_T))
        import torch.distributed as dist

        cp = dist.get_world_size(cp_group)
        parts = [torch.empty_like(positions_T) for _ in range(cp)]
        dist.all_gather(parts, positions_T.contiguous(), group=cp_group)
        total = positions_T.numel() * cp
        gathered_index = torch.cat([cp_token_index(total, cp_rank=r, cp_size=cp) for r in range(cp)])
        to_row = torch.empty_like(gathered_index)
        to_row[gathered_index] = torch.arange(total)
        row_positions = torch.cat(parts)[to_row.to(positions_T.device)]
        device = positions_T.device
        return cls(doc_T=_documents(row_positions), cp_group=cp_group, to_row=to_row.to(device),
                   to_gathered=gathered_index.to(device))


def _documents(positions_T: torch.Tensor) -> torch.Tensor:
    starts = positions_T == 0
    starts[0] = True
    return torch.cumsum(starts.long(), 0) - 1


def _offsets_in_document(doc_T: torch.Tensor) -> torch.Tensor:
    """Each token's index within its document."""
    index = torch.arange(doc_T.numel(), device=doc_T.device)
    starts = torch.ones_like(doc_T, dtype=torch.bool)
    starts[1:] = doc_T[1:] != doc_T[:-1]
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
    return index - first


def causal_conv(x_TC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                doc_T: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv (kernel K) with SiLU, restarting at each document: ``(T, C)`` in and out."""
    kernel = weight_CK.shape[-1]
    offsets = _offsets_in_document(doc_T)
    out = x_TC * weight_CK[:, kernel - 1]
    for shift in range(1, kernel):  # tap `shift` tokens back, zero where it would cross into the previous document
        shifted = F.pad(x_TC[:-shift], (0, 0, shift, 0)) if shift < x_TC.shape[0] else torch.zeros_like(x_TC)
        keep = (offsets >= shift).to(x_TC.dtype)[:, None]
        out = out + shifted * keep * weight_CK[:, kernel - 1 - shift]
    if bias_C is not None:
        out = out + bias_C
    return F.silu(out)


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = x[..., j+1] + ... + x[..., i]`` for j <= i, -inf above the diagonal (stable form)."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~keep, -torch.inf)


def ssd_scan(x_THP: torch.Tensor, dt_TH: torch.Tensor, A_H: torch.Tensor, B_TGN: torch.Tensor, C_TGN: torch.Tensor,
             D_H: torch.Tensor, doc_T: torch.Tensor, *, chunk: int) -> torch.Tensor:
    """Chunked SSD scan in float32 with the state reset at each document; returns ``y (T, H, P)``.

    ``dt`` is the step after softplus and clamping. Padding to a whole number of chunks uses
    a document of its own and ``dt = 0`` (no input, no decay).
    """
    tokens, heads, head_dim = x_THP.shape
    groups = B_TGN.shape[1]
    pad = (-tokens) % chunk
    x, dt = x_THP.float(), dt_TH.float()
    B = B_TGN.float().repeat_interleave(heads // groups, dim=1)
    C = C_TGN.float().repeat_interleave(heads // groups, dim=1)
    skip = x * D_H.float()[:, None]
    docs = doc_T
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, B, C))
        docs = torch.cat([doc_T, doc_T.new_full((pad,), int(doc_T[-1]) + 1)])
    chunks = x.shape[0] // chunk
    x_dt = (x * dt[..., None]).view(chunks, chunk, heads, head_dim)
    B, C = B.view(chunks, chunk, heads, -1), C.view(chunks, chunk, heads, -1)
    docs = docs.view(chunks, chunk)
    A_hcl = (A_H.float()[None, :] * dt).view(chunks, chunk, heads).permute(2, 0, 1)
    A_cum = torch.cumsum(A_hcl, dim=-1)
    # 1. within each chunk: y_l = sum_{s <= l, same document} C_l.B_s exp(A_s+1..A_l) x_s dt_s
    same_doc = (docs[:, :, None] == docs[:, None, :]).float()
    decay = torch.exp(_segment_sum(A_hcl)) * same_doc[None]
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay.permute(1, 2, 3, 0)
    y = torch.einsum("clsh,cshp->clhp", scores, x_dt)
    # 2. each chunk's final state, from the tokens of the chunk's last document only
    last_doc = docs[:, -1]
    to_end = torch.exp(A_cum[:, :, -1:] - A_cum) * (docs == last_doc[:, None]).float()[None]
    states = torch.einsum("clhn,hcl,clhp->chpn", B, to_end, x_dt)
    # 3. states passed between chunks: chunk z's end state reaches chunk c's end only within one document
    states = torch.cat([torch.zeros_like(states[:1]), states])
    end_doc = torch.cat([last_doc.new_full((1,), -1), last_doc])
    chunk_decay = torch.exp(_segment_sum(F.pad(A_cum[:, :, -1], (1, 0)))) * \
        (end_doc[:, None] == end_doc[None, :]).float()[None]
    entering = torch.einsum("hcz,zhpn->chpn", chunk_decay, states)[:-1]
    # 4. the entering state's contribution, to the tokens of the document it belongs to
    continues = (docs == end_doc[:-1, None]).float()
    from_state = torch.einsum("clhn,chpn->clhp", C, entering) * \
        (torch.exp(A_cum).permute(1, 2, 0) * continues[..., None])[..., None]
    out = (y + from_state).reshape(chunks * chunk, heads, head_dim)[:tokens]
    return out + skip


def gated_rms_norm(y_TI: torch.Tensor, z_TI: torch.Tensor, weight_I: torch.Tensor, *, groups: int,
                   eps: float) -> torch.Tensor:
    """``weight * rmsnorm_per_group(y * silu(z))`` in float32 (norm after the gate, as Nemotron-3)."""
    dtype = y_TI.dtype
    h = y_TI.float() * F.silu(z_TI.float())
    grouped = h.view(*h.shape[:-1], groups, -1)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight_I * grouped.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """One Nemotron-3 Mamba-2 mixer on ``(T, D)`` tokens of a packed row (see module docstring)."""

    def __init__(self, args: MoEModelArgs) -> None:
        super().__init__()
        self.heads, self.head_dim = args.mamba_num_heads, args.mamba_head_dim
        self.groups, self.state = args.mamba_n_groups, args.ssm_state_size
        self.inner, self.conv_dim = args.mamba_intermediate_size, args.mamba_conv_dim
        self.chunk, self.dt_min, self.eps = args.mamba_chunk_size, args.dt_min, args.rms_norm_eps
        if self.heads % self.groups:
            raise AgentrlError(f"config.json: mamba_num_heads ({self.heads}) must be a multiple of n_groups "
                               f"({self.groups})")
        self.in_proj = nn.Linear(args.hidden_size, self.inner + self.conv_dim + self.heads, bias=args.mamba_proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, args.conv_kernel, groups=self.conv_dim,
                                padding=args.conv_kernel - 1, bias=args.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, args.hidden_size, bias=args.mamba_proj_bias)
        self.scan_kernel = "torch"
        """The SSD scan: "torch" (`ssd_scan`, float32) or "fla" (`ssd_fla.ssd_scan_gla`, Triton; `use_mamba_scan`)."""

    def forward(self, x_TD: torch.Tensor, sequences: MambaSequences) -> torch.Tensor:
        z, xbc, dt = torch.split(self.in_proj(x_TD), [self.inner, self.conv_dim, self.heads], dim=-1)
        if sequences.cp_group is None:
            y = self._scan(xbc, dt, sequences.doc_T, heads=range(self.heads))
        else:
            y = self._scan_context_parallel(xbc, dt, sequences)
        return self.out_proj(gated_rms_norm(y, z, self.norm.weight, groups=self.groups, eps=self.eps).to(x_TD.dtype))

    def _channels(self, heads: range) -> torch.Tensor:
        """Conv channels (x, B, C) of a contiguous range of heads and the B/C groups they read."""
        per_group = self.heads // self.groups
        g0, g1 = heads.start // per_group, (heads.stop - 1) // per_group + 1
        x = torch.arange(heads.start * self.head_dim, heads.stop * self.head_dim)
        b = self.inner + torch.arange(g0 * self.state, g1 * self.state)
        return torch.cat([x, b, b + self.groups * self.state]).to(self.A_log.device)

    def _scan(self, xbc_TC: torch.Tensor, dt_TH: torch.Tensor, doc_T: torch.Tensor, *, heads: range) -> torch.Tensor:
        """Conv + SSD scan of whole documents for ``heads`` (``xbc`` holds their channels); ``(T, len(heads) * P)``."""
        channels = self._channels(heads)
        weight, bias = self.conv1d.weight[:, 0, :], self.conv1d.bias
        if len(heads) != self.heads:
            weight = weight.index_select(0, channels)
            bias = None if bias is None else bias.index_select(0, channels)
        n_heads = len(heads)
        n_groups = max(1, n_heads * self.groups // self.heads)
        with torch.autocast(xbc_TC.device.type, enabled=False):
            conv = causal_conv(xbc_TC.float(), weight.float(), None if bias is None else bias.float(), doc_T)
            x, B, C = torch.split(conv, [n_heads * self.head_dim, n_groups * self.state, n_groups * self.state], dim=-1)
            h = slice(heads.start, heads.stop)
            dt = F.softplus(dt_TH.float() + self.dt_bias[h].float()).clamp(min=self.dt_min)
            inputs = (x.reshape(-1, n_heads, self.head_dim), dt, -torch.exp(self.A_log[h].float()),
                      B.reshape(-1, n_groups, self.state), C.reshape(-1, n_groups, self.state), self.D[h], doc_T)
            if self.scan_kernel == "fla":
                y = ssd_scan_gla(*inputs, dtype=xbc_TC.dtype)
            else:
                y = ssd_scan(*inputs, chunk=self.chunk)
        return y.reshape(y.shape[0], -1)

    def _scan_context_parallel(self, xbc_TC: torch.Tensor, dt_TH: torch.Tensor, seq: MambaSequences) -> torch.Tensor:
        import torch.distributed as dist

        cp, rank = dist.get_world_size(seq.cp_group), dist.get_rank(seq.cp_group)
        if self.heads % cp or self.groups % cp:
            raise AgentrlError(f"trainer.parallel.cp={cp}: Mamba-2 context parallelism splits heads "
                               f"({self.heads}) and n_groups ({self.groups}) over the CP ranks; use a cp that "
                               "divides both")
        share = self.heads // cp
        ranges = [range(r * share, (r + 1) * share) for r in range(cp)]
        tokens = xbc_TC.shape[0]
        # this rank's tokens, cut by head share: piece r goes to rank r
        send = torch.cat([torch.cat([xbc_TC.index_select(1, self._channels(heads)), dt_TH[:, heads.start:heads.stop]],
                                    dim=-1) for heads in ranges])
        received = all_to_all_rows(send, [tokens] * cp, [tokens] * cp, seq.cp_group)  # rank-major tokens, my heads
        received = received.index_select(0, seq.to_row)
        mine = ranges[rank]
        y = self._scan(received[:, :-share], received[:, -share:], seq.doc_T, heads=mine)
        back = all_to_all_rows(y.index_select(0, seq.to_gathered), [tokens] * cp, [tokens] * cp, seq.cp_group)
        return back.view(cp, tokens, -1).transpose(0, 1).reshape(tokens, -1)  # (my tokens, heads in order)
