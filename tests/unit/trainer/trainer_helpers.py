"""Helpers for the trainer tests: tiny GLM-4.5 / Qwen3-MoE HF folders built with transformers."""

from __future__ import annotations

import torch


def tiny_glm_config(**overrides):
    from transformers import Glm4MoeConfig

    values = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, partial_rotary_factor=0.5,
        attention_bias=True, use_qk_norm=False, norm_topk_prob=True, routed_scaling_factor=1.5,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return Glm4MoeConfig(**values)


def make_hf_folder(path, config, *, seed: int = 0, max_shard_size: str | None = None):
    """Create a HF model folder with random weights (correction bias random too, so it matters)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.copy_(torch.randn_like(buffer) * 0.1)
        for name, param in model.named_parameters():  # larger weights so routing and logits are not flat
            param.mul_(3.0) if param.dim() > 1 else None
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model
