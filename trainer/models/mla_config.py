"""Multi-head Latent Attention hyper-parameters from a DeepSeek-V3 / Kimi-K2 ``config.json`` (torch-free).

`MoEModelArgs.from_hf_config` calls `mla_fields` for ``model_type`` ``deepseek_v3`` or
``kimi_k2`` (or any config whose architecture is ``DeepseekV3ForCausalLM``); the layout
planner counts MLA's parameters with `mla_attention_params`. The model itself is
`agentrl.trainer.models.mla`.

RoPE: ``rope_parameters`` (transformers 5) or the published ``rope_scaling`` with a
top-level ``rope_theta`` (DeepSeek-V3's and Kimi-K2's hub configs); ``default`` and
``yarn`` are supported. YaRN rescales the rotary frequencies and, when ``mscale_all_dim``
is set, multiplies the softmax scale by ``mscale(factor, mscale_all_dim) ** 2``
(`mla_softmax_scale`), as DeepSeek-V3 does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from agentrl.errors import AgentrlError

if TYPE_CHECKING:
    from agentrl.trainer.models.args import MoEModelArgs

__all__ = ["mla_fields", "mla_attention_params", "mla_softmax_scale", "yarn_mscale"]

_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate")


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the YaRN parameters or None for plain RoPE)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise AgentrlError(f"config.json rope_scaling type {rope_type!r} is not supported for DeepSeek-V3 "
                           "attention; use 'yarn' or 'default'")
    original = params.get("original_max_position_embeddings")
    if not original:
        raise AgentrlError("config.json rope_scaling: yarn needs original_max_position_embeddings")
    yarn = {key: params[key] for key in _YARN_KEYS if params.get(key) is not None}
    if "factor" not in yarn:  # as transformers: the context extension ratio
        yarn["factor"] = float(config["max_position_embeddings"]) / float(original)
    return theta, {"rope_type": "yarn", **yarn}


def mla_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The `MoEModelArgs` fields of a DeepSeek-V3-architecture config (attention and RoPE)."""
    scoring = config.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise AgentrlError(f"config.json scoring_func {scoring!r}: DeepSeek-V3 routing scores with 'sigmoid' "
                           "(DeepSeek-V2's softmax router is not supported)")
    topk_method = config.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise AgentrlError(f"config.json topk_method {topk_method!r}: only DeepSeek-V3's 'noaux_tc' "
                           "(group-limited top-k with a correction bias) is supported")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not config.get(key):
            raise AgentrlError(f"config.json {key} is missing; a DeepSeek-V3 config needs it")
    theta, yarn = _rope(config)
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    q_lora = config.get("q_lora_rank")
    return {
        "head_dim": nope + rope,
        "rotary_dim": rope,
        "num_key_value_heads": int(config["num_attention_heads"]),
        "rope_theta": theta,
        "rope_scaling": yarn,
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(config["kv_lora_rank"]),
        "qk_nope_head_dim": nope,
        "v_head_dim": int(config["v_head_dim"]),
        "rope_interleave": bool(config.get("rope_interleave", True)),
        "use_qk_norm": False,
    }


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(args: MoEModelArgs) -> float:
    """``1 / sqrt(qk head dim)``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    scale = args.head_dim ** -0.5
    yarn = args.rope_scaling or {}
    if yarn.get("mscale_all_dim"):
        scale *= yarn_mscale(float(yarn["factor"]), float(yarn["mscale_all_dim"])) ** 2
    return scale


def mla_attention_params(args: MoEModelArgs) -> int:
    """Parameters of one MLA block with its two RMSNorms (query path, latent kv path, output)."""
    heads, hidden, bias = args.num_attention_heads, args.hidden_size, int(args.attention_bias)
    q_out = heads * args.head_dim
    if args.q_lora_rank:
        query = hidden * args.q_lora_rank + bias * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * q_out
    else:
        query = hidden * q_out
    latent = args.kv_lora_rank + args.rotary_dim
    kv = hidden * latent + bias * latent + args.kv_lora_rank
    kv += args.kv_lora_rank * heads * (args.qk_nope_head_dim + args.v_head_dim)
    out = heads * args.v_head_dim * hidden + bias * hidden
    return query + kv + out + 2 * hidden
