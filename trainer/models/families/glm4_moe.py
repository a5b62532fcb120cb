"""The GLM-4.5 family (``Glm4MoeForCausalLM``, model_type ``glm4_moe``): a row of the family table.

GLM-4.5 / GLM-4.5-Air: a sigmoid router with an expert-score correction bias and group-limited
top-k, shared experts, the first ``first_k_dense_replace`` layers dense, GQA attention with partial
RoPE and qkv bias (optional qk-norm). The model is `common.MoEDecoder`, the weights map through
`decoder_weights`. `moe_routing_fields` is the routing and MoE layout DeepSeek-V3 shares.
"""

from __future__ import annotations

from typing import Any

from agentrl.trainer.models.family import Family, partial_rotary_factor, transformer_fields

__all__ = ["FAMILY", "args_from_hf", "moe_routing_fields"]


def moe_routing_fields(config: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's (and DeepSeek-V3's) MoE layout and router: sigmoid scores, correction bias, groups."""
    layers = int(config["num_hidden_layers"])
    first_dense = int(config.get("first_k_dense_replace", 0))
    return {
        "num_experts": int(config["n_routed_experts"]),
        "num_shared_experts": int(config.get("n_shared_experts") or 0),
        "dense_layers": list(range(min(first_dense, layers))),
        "n_group": int(config.get("n_group") or 1),
        "topk_group": int(config.get("topk_group") or 1),
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "score_func": "sigmoid",
        "use_correction_bias": True,
    }


def args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """`MoEModelArgs` fields of a GLM-4.5 ``config.json``."""
    fields = transformer_fields(config)
    fields.update(rotary_dim=int(fields["head_dim"] * partial_rotary_factor(config)),
                  use_qk_norm=bool(config.get("use_qk_norm", False)))
    return dict(model_type="glm4_moe", **fields, **moe_routing_fields(config))


FAMILY = Family(model_type="glm4_moe", architectures=("Glm4MoeForCausalLM",), args_from_hf=args_from_hf,
                decoder="agentrl.trainer.models.common:MoEDecoder",
                weights="agentrl.trainer.models.decoder_weights")
