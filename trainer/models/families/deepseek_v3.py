"""The DeepSeek-V3 family (``DeepseekV3ForCausalLM``; Kimi-K2's ``kimi_k2`` too): a row of the family table.

GLM-4.5's router and MoE layout (`glm4_moe.moe_routing_fields`) with Multi-head Latent Attention:
low-rank query and key-value compression, a decoupled RoPE head and YaRN scaling
(`mla_config.mla_fields`). ``head_dim`` is then the query/key head width (nope + rope), ``rotary_dim``
the RoPE part. The model is `mla.MLADecoder`, the weights map through `decoder_weights`.
"""

from __future__ import annotations

from typing import Any

from agentrl.trainer.models.families.glm4_moe import moe_routing_fields
from agentrl.trainer.models.family import Family, transformer_fields
from agentrl.trainer.models.mla_config import mla_fields

__all__ = ["FAMILY", "args_from_hf"]


def args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """`MoEModelArgs` fields of a DeepSeek-V3-architecture ``config.json`` (DeepSeek-V3, Kimi-K2)."""
    fields = transformer_fields(config)
    fields.update(mla_fields(config))
    return dict(model_type="deepseek_v3", **fields, **moe_routing_fields(config))


FAMILY = Family(model_type="deepseek_v3", config_types=("kimi_k2",), architectures=("DeepseekV3ForCausalLM",),
                args_from_hf=args_from_hf, decoder="agentrl.trainer.models.mla:MLADecoder",
                weights="agentrl.trainer.models.decoder_weights")
