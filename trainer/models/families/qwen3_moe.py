"""The Qwen3-MoE family (``Qwen3MoeForCausalLM``, model_type ``qwen3_moe``): a row of the family table.

Qwen3-MoE: a softmax top-k router without shared experts or correction bias, per-head qk RMSNorm,
full RoPE; dense layers where ``mlp_only_layers`` or ``decoder_sparse_step`` say. The model is
`common.MoEDecoder`, the weights map through `decoder_weights`.
"""

from __future__ import annotations

from typing import Any

from agentrl.trainer.models.family import Family, transformer_fields

__all__ = ["FAMILY", "args_from_hf"]


def args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """`MoEModelArgs` fields of a Qwen3-MoE ``config.json``."""
    fields = transformer_fields(config)
    layers = fields["num_hidden_layers"]
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    mlp_only = set(config.get("mlp_only_layers") or [])
    dense = [i for i in range(layers) if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0)]
    return dict(
        model_type="qwen3_moe",
        rotary_dim=fields["head_dim"],
        use_qk_norm=True,
        num_experts=num_experts,
        num_shared_experts=0,
        dense_layers=dense,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        score_func="softmax",
        use_correction_bias=False,
        **fields,
    )


FAMILY = Family(model_type="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), args_from_hf=args_from_hf,
                decoder="agentrl.trainer.models.common:MoEDecoder",
                weights="agentrl.trainer.models.decoder_weights")
