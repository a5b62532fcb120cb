"""Model hyper-parameters for the trainer's MoE decoders, read from a Hugging Face config.

One dataclass, `MoEModelArgs`, describes the three supported architectures:

* ``glm4_moe`` (GLM-4.5 / GLM-4.5-Air): sigmoid router with an expert-score correction
  bias and group-limited top-k, shared experts, the first ``first_k_dense_replace`` layers
  dense, GQA attention with partial RoPE and qkv bias (optional qk-norm).
* ``qwen3_moe`` (Qwen3-MoE): softmax top-k router, no shared expert, no correction bias,
  per-head qk RMSNorm, full RoPE.
* ``nemotron_h`` (NVIDIA Nemotron-3): one mixer per layer after the config's layer pattern
  (``layer_types``: Mamba-2, attention without RoPE, MoE or a squared-ReLU MLP); MoE layers
  have non-gated squared-ReLU experts, one shared expert, the GLM-style sigmoid router and,
  for Super, a latent projection around the routed experts (``moe_latent_size``).
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

SUPPORTED_MODEL_TYPES = ("glm4_moe", "qwen3_moe", "nemotron_h", "deepseek_v3", "kimi_k2")
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
"""config.json model types with DeepSeek-V3's architecture (Kimi-K2 publishes ``kimi_k2``)."""

_LAYER_TYPES = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp", "linear_attention": "mamba",
                "mamba": "mamba", "full_attention": "attention", "attention": "attention", "moe": "moe", "mlp": "mlp"}
"""Layer kinds of a nemotron_h config: its ``hybrid_override_pattern`` characters and ``layers_block_type`` names."""


@dataclass(kw_only=True)
class MoEModelArgs:
    """Architecture of one MoE decoder (see the module docstring for the two variants)."""

    model_type: Literal["glm4_moe", "qwen3_moe", "nemotron_h", "deepseek_v3"] = "glm4_moe"
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
    # nemotron_h only (empty / unused for the two transformer decoders)
    layer_types: list[str] = field(default_factory=list)
    """Per layer: "mamba", "attention", "moe" or "mlp" (nemotron_h); empty for glm4_moe / qwen3_moe."""
    expert_gated: bool = True
    """SwiGLU experts (gate, up, down); False: squared-ReLU experts with up and down only (nemotron_h)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert when it is not ``num_shared_experts x moe_intermediate_size`` (nemotron_h)."""
    moe_latent_size: int | None = None
    """Routed experts work in this width, between two projections from/to the hidden size (Nemotron-3 Super)."""
    mlp_bias: bool = False
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    mamba_n_groups: int = 1
    conv_kernel: int = 4
    mamba_chunk_size: int = 128
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    dt_min: float = 0.0
    """Lower clamp of the Mamba step size after softplus: the config's ``time_step_limit[0]`` (0), as vLLM's
    mixer (``dt_limit=(0.0, inf)``) and NVIDIA's Mamba-2 clamp. transformers 5.19's mixer clamps at
    ``time_step_min`` (0.001) instead; trained weights put dt below it, where logprobs then differ from
    vLLM's (tiny-nemotron's SFT warm start: up to 0.036 on a 91-token sequence, an on-policy mismatch KL
    of 6e-5 instead of 2e-13 in the loop), so the trainer follows vLLM, the sampler."""
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
        if model_type == "nemotron_h":
            return cls._from_nemotron_h(config)
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
    def _from_nemotron_h(cls, config: dict[str, Any]) -> "MoEModelArgs":
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
        return cls(
            model_type="nemotron_h",
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
            num_hidden_layers=len(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rotary_dim=0,
            rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
            attention_bias=False,  # NemotronH's projections have no bias (transformers ignores attention_bias)
            num_experts=num_experts,
            top_k=int(config.get("num_experts_per_tok") or 0),
            num_shared_experts=1 if shared else 0,
            dense_layers=[i for i, kind in enumerate(layer_types) if kind != "moe"],
            n_group=int(config.get("n_group") or 1),
            topk_group=int(config.get("topk_group") or 1),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            score_func="sigmoid",
            use_correction_bias=True,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            layer_types=layer_types,
            expert_gated=False,
            shared_expert_intermediate_size=shared,
            moe_latent_size=int(latent) if latent else None,
            mlp_bias=bool(config.get("mlp_bias", False)),
            mamba_num_heads=int(config.get("mamba_num_heads", 128)),
            mamba_head_dim=int(config.get("mamba_head_dim", 64)),
            ssm_state_size=int(config.get("ssm_state_size", 128)),
            mamba_n_groups=int(config.get("n_groups", config.get("mamba_n_groups", 8))),
            conv_kernel=int(config.get("conv_kernel", config.get("mamba_d_conv", 4))),
            mamba_chunk_size=int(config.get("chunk_size", config.get("mamba_chunk_size", 128))),
            use_conv_bias=bool(config.get("use_conv_bias", config.get("mamba_conv_bias", True))),
            mamba_proj_bias=bool(config.get("use_bias", False)),
            dt_min=float((config.get("time_step_limit") or config.get("mamba_dt_limit") or (0.0,))[0]),
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

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the layers with attention (every layer but in nemotron_h)."""
        if not self.layer_types:
            return list(range(self.num_hidden_layers))
        return [i for i, kind in enumerate(self.layer_types) if kind == "attention"]

    @property
    def mamba_layers(self) -> list[int]:
        """Indices of the Mamba-2 layers (nemotron_h)."""
        return [i for i, kind in enumerate(self.layer_types) if kind == "mamba"]

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the Mamba causal conv: x, B and C."""
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.ssm_state_size

    @property
    def expert_dim(self) -> int:
        """Width the routed experts read and write (the latent size when there is one)."""
        return self.moe_latent_size or self.hidden_size

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
        return params + (self.hidden_size if self.layer_types else 2 * self.hidden_size)  # the layer's RMSNorms

    def expert_params_per_layer(self) -> int:
        """Routed-expert parameters of one MoE layer (all experts)."""
        return self.num_experts * (3 if self.expert_gated else 2) * self.expert_dim * self.moe_intermediate_size

    def shared_expert_params(self) -> int:
        """Shared-expert parameters of one MoE layer."""
        if self.shared_expert_intermediate_size:
            return (3 if self.expert_gated else 2) * self.hidden_size * self.shared_expert_intermediate_size
        return 3 * self.hidden_size * self.moe_intermediate_size * self.num_shared_experts

    def mamba_params(self) -> int:
        """Parameters of one Mamba-2 layer (in_proj, conv, dt bias, A, D, gated norm, out_proj, pre-norm)."""
        inner, heads, conv = self.mamba_intermediate_size, self.mamba_num_heads, self.mamba_conv_dim
        bias = (inner + conv + heads + self.hidden_size) if self.mamba_proj_bias else 0
        return (self.hidden_size * (inner + conv + heads) + conv * (self.conv_kernel + int(self.use_conv_bias))
                + 3 * heads + inner + inner * self.hidden_size + bias + self.hidden_size)

    def mamba_working_bytes_per_token(self) -> float:
        """Bytes per token one Mamba-2 layer holds while it is recomputed and backpropagated (estimate).

        The scan runs in float32: the intra-chunk score and decay matrices (chunk x heads per
        token, each with its gradient), B and C repeated to every head, x dt, y and their
        gradients, the chunk states (heads x head_dim x state per chunk), and the conv's input
        and output (x, B, C channels) with the in_proj output in compute precision. Under CP a
        rank holds the whole row for heads / cp heads: the same count per rank.
        """
        heads, head_dim, state, chunk = self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size, self.mamba_chunk_size
        scan = 4.0 * heads * (10 * chunk + 4 * state + 4 * head_dim) + 4.0 * 3 * heads * head_dim * state / chunk
        conv = 4.0 * 3 * self.mamba_conv_dim
        projections = 2.0 * 2 * (self.mamba_intermediate_size + self.mamba_conv_dim + self.mamba_num_heads)
        return scan + conv + projections

    def layer_params(self, index: int, *, ep: int = 1) -> int:
        """Parameters of one nemotron_h layer (routed experts: this EP rank's share)."""
        kind, hidden = self.layer_types[index], self.hidden_size
        if kind == "mamba":
            return self.mamba_params()
        if kind == "attention":
            return self.attention_params()
        if kind == "mlp":
            return 2 * hidden * self.intermediate_size + hidden
        latent = 2 * hidden * self.moe_latent_size if self.moe_latent_size else 0
        return (self.num_experts * hidden + latent + self.shared_expert_params() + hidden
                + self.expert_params_per_layer() // ep)

    def param_counts(self) -> dict[str, int]:
        """Parameter counts: total, routed experts, dense (everything else), active per token."""
        if self.layer_types:
            return self._hybrid_param_counts()
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

    def _hybrid_param_counts(self) -> dict[str, int]:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        moe_layers = len(self.moe_layers)
        experts = self.expert_params_per_layer() * moe_layers
        layers = sum(self.layer_params(i) for i in range(self.num_hidden_layers))
        dense_total = embed + head + layers - experts + self.hidden_size
        active_experts = self.top_k * (experts // max(self.num_experts, 1))
        return {"total": dense_total + experts, "experts": experts, "dense": dense_total,
                "active": dense_total - embed + active_experts}

    def mamba_scan_flops_per_token(self) -> float:
        """Forward FLOPs per token of one Mamba-2 layer's chunked scan (the SSD's four einsums)."""
        heads, head_dim, state, chunk = self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size, self.mamba_chunk_size
        return 2.0 * heads * (chunk * (state + head_dim) + 2 * state * head_dim)

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
        attention_flops = 6.0 * len(self.attention_layers) * self.num_attention_heads * mean_context * (
            self.head_dim + self.value_head_dim)
        scan_flops = 3.0 * len(self.mamba_layers) * self.mamba_scan_flops_per_token()
        return dense_flops + attention_flops + scan_flops
