"""Model hyper-parameters for the trainer's MoE decoder, read from a Hugging Face config.

One dataclass, `MoEModelArgs`, describes both supported architectures:

* ``glm4_moe`` (GLM-4.5 / GLM-4.5-Air): sigmoid router with an expert-score correction
  bias and group-limited top-k, shared experts, the first ``first_k_dense_replace`` layers
  dense, GQA attention with partial RoPE and qkv bias (optional qk-norm).
* ``qwen3_moe`` (Qwen3-MoE): softmax top-k router, no shared expert, no correction bias,
  per-head qk RMSNorm, full RoPE.
* ``deepseek_v3`` (DeepSeek-V3, and Kimi-K2, which is the same architecture): GLM-4.5's
  router and MoE layout with Multi-head Latent Attention (`agentrl.trainer.models.mla`):
  low-rank query and key-value compression, a decoupled RoPE head and YaRN scaling.
  ``head_dim`` is then the query/key head width (nope + rope), ``rotary_dim`` the RoPE part.

It also counts parameters and training FLOPs per token, which the layout planner
(`agentrl.trainer.parallel`) and the MFU benchmark use.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.errors import AgentrlError, NotFoundError

__all__ = ["MoEModelArgs", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("glm4_moe", "qwen3_moe", "deepseek_v3", "kimi_k2")
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
"""config.json model types with DeepSeek-V3's architecture (Kimi-K2 publishes ``kimi_k2``)."""

@dataclass(kw_only=True)
class MoEModelArgs:
    """Architecture of one MoE decoder (see the module docstring for the two variants)."""

    model_type: Literal["glm4_moe", "qwen3_moe", "deepseek_v3"] = "glm4_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    use_qk_norm: bool = False
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    dense_layers: list[int] = field(default_factory=list)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    score_func: Literal["sigmoid", "softmax"] = "sigmoid"
    use_correction_bias: bool = True
    tie_word_embeddings: bool = False
    # Multi-head Latent Attention (deepseek_v3 only; see `agentrl.trainer.models.mla`)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    rope_scaling: dict[str, Any] | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "MoEModelArgs":
        """Build from a Hugging Face ``config.json`` dict (glm4_moe, qwen3_moe, deepseek_v3 or kimi_k2)."""
        model_type = config.get("model_type")
        if "DeepseekV3ForCausalLM" in (config.get("architectures") or []):
            model_type = "deepseek_v3"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise AgentrlError(
                f"config.json model_type {model_type!r} is not supported by the trainer; "
                f"use one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        rope = config.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
        layers = int(config["num_hidden_layers"])
        common = dict(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size", 0)),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rope_theta=rope_theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            top_k=int(config["num_experts_per_tok"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
        if model_type in MLA_MODEL_TYPES:
            from agentrl.trainer.models.mla_config import mla_fields

            common.update(mla_fields(config))
        if model_type in ("glm4_moe",) + MLA_MODEL_TYPES:
            first_dense = int(config.get("first_k_dense_replace", 0))
            if model_type == "glm4_moe":
                common.update(rotary_dim=int(head_dim * partial), use_qk_norm=bool(config.get("use_qk_norm", False)))
            return cls(
                model_type="glm4_moe" if model_type == "glm4_moe" else "deepseek_v3",
                attention_bias=bool(config.get("attention_bias", False)),
                num_experts=int(config["n_routed_experts"]),
                num_shared_experts=int(config.get("n_shared_experts") or 0),
                dense_layers=list(range(min(first_dense, layers))),
                n_group=int(config.get("n_group") or 1),
                topk_group=int(config.get("topk_group") or 1),
                routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
                score_func="sigmoid",
                use_correction_bias=True,
                **common,
            )
        num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        step = int(config.get("decoder_sparse_step") or 1)
        mlp_only = set(config.get("mlp_only_layers") or [])
        dense = [i for i in range(layers) if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0)]
        return cls(
            model_type="qwen3_moe",
            rotary_dim=head_dim,
            attention_bias=bool(config.get("attention_bias", False)),
            use_qk_norm=True,
            num_experts=num_experts,
            num_shared_experts=0,
            dense_layers=dense,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            score_func="softmax",
            use_correction_bias=False,
            **common,
        )

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> "MoEModelArgs":
        """Read ``config.json`` in a Hugging Face model folder."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise NotFoundError(f"{path}: no config.json; pass a Hugging Face model folder")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise AgentrlError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
        return cls.from_hf_config(config)

    @classmethod
    def for_model(cls, name_or_path: str | Path) -> "MoEModelArgs":
        """A HF folder, a preset with a known config (shapes only), or a preset `agentrl.models` resolves."""
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            return cls.from_hf_dir(path)
        from agentrl.models import resolve_model

        spec = resolve_model(str(name_or_path))
        if spec.path is None and spec.hf_config is not None:  # shapes only: the weights need not be here
            return cls.from_hf_config(spec.hf_config)
        return cls.from_hf_dir(spec.local_path())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------ structure
    @property
    def is_mla(self) -> bool:
        """Multi-head Latent Attention (DeepSeek-V3 / Kimi-K2) rather than GQA."""
        return self.model_type == "deepseek_v3"

    @property
    def value_head_dim(self) -> int:
        """Width of one attention head's values (``head_dim`` except under MLA)."""
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers whose MLP is a mixture of experts."""
        dense = set(self.dense_layers)
        return [i for i in range(self.num_hidden_layers) if i not in dense]

    # ------------------------------------------------------------------ counting
    def attention_params(self) -> int:
        if self.is_mla:
            from agentrl.trainer.models.mla_config import mla_attention_params

            return mla_attention_params(self)
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        params = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        if self.attention_bias:
            params += q + 2 * kv
        if self.use_qk_norm:
            params += 2 * self.head_dim
        return params + 2 * self.hidden_size  # two RMSNorms

    def expert_params_per_layer(self) -> int:
        """Routed-expert parameters of one MoE layer (all experts)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def param_counts(self) -> dict[str, int]:
        """Parameter counts: total, routed experts, dense (everything else), active per token."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        attention = self.attention_params() * self.num_hidden_layers
        dense_mlp = 3 * self.hidden_size * self.intermediate_size * len(self.dense_layers)
        moe_layers = len(self.moe_layers)
        shared = 3 * self.hidden_size * self.moe_intermediate_size * self.num_shared_experts * moe_layers
        router = (self.num_experts * self.hidden_size) * moe_layers
        experts = self.expert_params_per_layer() * moe_layers
        dense_total = embed + head + attention + dense_mlp + shared + router + self.hidden_size
        active_experts = self.top_k * 3 * self.hidden_size * self.moe_intermediate_size * moe_layers
        return {
            "total": dense_total + experts,
            "experts": experts,
            "dense": dense_total,
            "active": dense_total - embed + active_experts,
        }

    def training_flops_per_token(self, *, mean_context: float) -> float:
        """Forward+backward FLOPs per token: 6 x active matmul params + causal attention.

        ``mean_context`` is the average number of keys a query attends to (L/2 for one
        causal document of length L). Embedding lookups are not counted.
        """
        # "active" holds the LM head but not the embedding lookup; a tied head is the embedding
        matmul_params = self.param_counts()["active"]
        if self.tie_word_embeddings:
            matmul_params += self.vocab_size * self.hidden_size
        dense_flops = 6.0 * matmul_params
        attention_flops = 6.0 * self.num_hidden_layers * self.num_attention_heads * mean_context * (
            self.head_dim + self.value_head_dim)
        return dense_flops + attention_flops
