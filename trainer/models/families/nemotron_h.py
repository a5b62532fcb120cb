"""The NVIDIA Nemotron-3 family (``NemotronHForCausalLM``, model_type ``nemotron_h``): a row of the table.

One mixer per layer after the config's layer pattern (``hybrid_override_pattern`` characters or
``layers_block_type`` names: Mamba-2, attention without RoPE, MoE or a squared-ReLU MLP); MoE layers
have non-gated squared-ReLU experts, one shared expert, the GLM-style sigmoid router and, for Super, a
latent projection around the routed experts (``moe_latent_size``). The model is
`hybrid.NemotronHDecoder`, the weights map through `nemotron_h_weights`.
"""

from __future__ import annotations

from typing import Any

from agentrl.errors import AgentrlError
from agentrl.trainer.models.family import Family

__all__ = ["FAMILY", "args_from_hf"]

_LAYER_TYPES = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp", "linear_attention": "mamba",
                "mamba": "mamba", "full_attention": "attention", "attention": "attention", "moe": "moe", "mlp": "mlp"}
"""Layer kinds of a nemotron_h config: its ``hybrid_override_pattern`` characters and ``layers_block_type`` names."""


def args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """`MoEModelArgs` fields of a Nemotron-3 ``config.json`` (Nano, Super)."""
    pattern = config.get("layers_block_type") or config.get("layer_types") or config.get("hybrid_override_pattern")
    if not pattern:
        raise AgentrlError("config.json (nemotron_h): needs hybrid_override_pattern or layers_block_type")
    unknown = sorted({str(kind) for kind in pattern if kind not in _LAYER_TYPES})
    if unknown:
        raise AgentrlError(f"config.json (nemotron_h): unknown layer kinds {unknown} in the layer pattern; "
                           f"use {', '.join(sorted(_LAYER_TYPES))}")
    layer_types = [_LAYER_TYPES[kind] for kind in pattern]
    if config.get("mlp_hidden_act", "relu2") != "relu2":
        raise AgentrlError(f"config.json (nemotron_h): mlp_hidden_act {config['mlp_hidden_act']!r} is not "
                           "supported; the trainer has the squared-ReLU MLPs of Nemotron-3 (relu2)")
    hidden = int(config["hidden_size"])
    heads = int(config.get("num_attention_heads") or 1)
    latent = config.get("moe_latent_size")
    num_experts = int(config.get("n_routed_experts") or 0)
    shared = int(config.get("moe_shared_expert_intermediate_size") or 0) if config.get("n_shared_experts", 1) else 0
    return {
        "model_type": "nemotron_h",
        "vocab_size": int(config["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(config.get("intermediate_size") or 0),
        "moe_intermediate_size": int(config.get("moe_intermediate_size") or 0),
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": int(config.get("head_dim") or hidden // heads),
        "rotary_dim": 0,
        "rms_norm_eps": float(config.get("layer_norm_epsilon", 1e-5)),
        "attention_bias": False,  # NemotronH's projections have no bias (transformers ignores attention_bias)
        "num_experts": num_experts,
        "top_k": int(config.get("num_experts_per_tok") or 0),
        "num_shared_experts": 1 if shared else 0,
        "dense_layers": [i for i, kind in enumerate(layer_types) if kind != "moe"],
        "n_group": int(config.get("n_group") or 1),
        "topk_group": int(config.get("topk_group") or 1),
        "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "score_func": "sigmoid",
        "use_correction_bias": True,
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "layer_types": layer_types,
        "expert_gated": False,
        "shared_expert_intermediate_size": shared,
        "moe_latent_size": int(latent) if latent else None,
        "mlp_bias": bool(config.get("mlp_bias", False)),
        "mamba_num_heads": int(config.get("mamba_num_heads", 128)),
        "mamba_head_dim": int(config.get("mamba_head_dim", 64)),
        "ssm_state_size": int(config.get("ssm_state_size", 128)),
        "mamba_n_groups": int(config.get("n_groups", config.get("mamba_n_groups", 8))),
        "conv_kernel": int(config.get("conv_kernel", config.get("mamba_d_conv", 4))),
        "mamba_chunk_size": int(config.get("chunk_size", config.get("mamba_chunk_size", 128))),
        "use_conv_bias": bool(config.get("use_conv_bias", config.get("mamba_conv_bias", True))),
        "mamba_proj_bias": bool(config.get("use_bias", False)),
        "dt_min": float((config.get("time_step_limit") or config.get("mamba_dt_limit") or (0.0,))[0]),
    }


FAMILY = Family(model_type="nemotron_h", architectures=("NemotronHForCausalLM",), args_from_hf=args_from_hf,
                decoder="agentrl.trainer.models.hybrid:NemotronHDecoder",
                weights="agentrl.trainer.models.nemotron_h_weights")
