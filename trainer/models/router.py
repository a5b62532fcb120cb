"""Token-choice top-k router for GLM-4.5 and Qwen3-MoE, with Router Replay (R3).

Built on torchtitan's `TokenChoiceTopKRouter` (its config, gate `Linear` and group-limited
selection), with the Hugging Face semantics of both architectures:

* GLM-4.5: ``scores = sigmoid(x W^T)`` in float32; experts are *chosen* on
  ``scores + e_score_correction_bias`` restricted to the ``topk_group`` best groups (a
  group's score is the sum of its two best experts); gate weights are the *unbiased*
  scores of the chosen experts, renormalised (``norm_topk_prob``) and multiplied by
  ``routed_scaling_factor``.
* Qwen3-MoE: ``scores = softmax(x W^T)``, plain top-k, optional renormalisation.

Router Replay: when the caller passes the experts inference routed each token to
(``replay_expert_ids``), those ids replace the router's own choice for every token whose
``replay_mask`` is True. Gate weights are still gathered from the live scores, so the
gate receives gradients exactly as it would had it chosen those experts itself.

The gate (``x W^T``) runs in float32 unless ``gate_dtype`` names a reduced precision (``trainer.router_float32 =
false``): then it is a bf16/fp16 matmul whose result is widened to float32, as CUDA vLLM 0.24's Qwen3-MoE gate.

Replaying the gate weights too (``replay_weights``, the third arm, prime-rl's "full recall"):
for replayed tokens whose weights are known (finite), the forward uses inference's final gate
weights (renormalised and scaled as inference applied them) and the backward the live ones'
gradient (a straight-through estimate: ``replayed + live - live.detach()``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import TokenChoiceTopKRouter

__all__ = ["MoERouter", "build_router"]


class MoERouter(TokenChoiceTopKRouter):
    """torchtitan's router with HF-exact GLM/Qwen scoring and Router Replay."""

    gate_dtype: torch.dtype | None = None
    """None: the gate in float32; else the reduced dtype it is computed in (see the module docstring)."""

    def forward(  # type: ignore[override]
        self,
        x_TD: torch.Tensor,
        correction_bias_E: torch.Tensor | None = None,
        *,
        replay_expert_ids_TK: torch.Tensor | None = None,
        replay_mask_T: torch.Tensor | None = None,
        replay_weights_TK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``(T, D)`` tokens; returns ``(gate weights (T, K) float32, expert ids (T, K))``."""
        with torch.autocast(x_TD.device.type, enabled=False):  # float32 gate, as vLLM's and HF's GLM-4.5
            if self.gate_dtype is None:
                logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
            else:
                logits_TE = F.linear(x_TD.to(self.gate_dtype), self.gate.weight.to(self.gate_dtype)).float()
        if self.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
        else:
            scores_TE = torch.softmax(logits_TE, dim=-1)
        if replay_expert_ids_TK is not None and replay_mask_T is not None and bool(replay_mask_T.all()):
            expert_ids_TK = replay_expert_ids_TK.long().contiguous()
        else:
            with torch.no_grad():
                choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E.float()
                if self.num_expert_groups is not None and self.num_expert_groups > 1:
                    choice_TE = self._get_node_limited_routing_scores(choice_TE)
                expert_ids_TK = torch.topk(choice_TE, k=self.top_k, dim=-1, sorted=False)[1]
            if replay_expert_ids_TK is not None and replay_mask_T is not None:
                expert_ids_TK = torch.where(
                    replay_mask_T[:, None], replay_expert_ids_TK.long(), expert_ids_TK
                ).contiguous()
        weights_TK = scores_TE.gather(-1, expert_ids_TK)
        if self.route_norm:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        weights_TK = weights_TK * self.route_scale
        if replay_weights_TK is not None and replay_mask_T is not None:
            known_T = replay_mask_T & torch.isfinite(replay_weights_TK).all(dim=-1)
            replayed_TK = torch.nan_to_num(replay_weights_TK.to(weights_TK.dtype))
            weights_TK = torch.where(known_T[:, None], replayed_TK + (weights_TK - weights_TK.detach()), weights_TK)
        return weights_TK, expert_ids_TK


def build_router(
    *,
    hidden_size: int,
    num_experts: int,
    top_k: int,
    score_func: str,
    num_expert_groups: int,
    num_limited_groups: int,
    route_norm: bool,
    route_scale: float,
) -> MoERouter:
    """Construct the router through torchtitan's config objects."""
    config = TokenChoiceTopKRouter.Config(
        num_experts=num_experts,
        gate=Linear.Config(in_features=hidden_size, out_features=num_experts, bias=False),
        num_expert_groups=num_expert_groups if num_expert_groups > 1 else None,
        num_limited_groups=num_limited_groups if num_expert_groups > 1 else None,
        top_k=top_k,
        score_func=score_func,  # type: ignore[arg-type]
        route_norm=route_norm,
        route_scale=route_scale,
    )
    return MoERouter(config)
