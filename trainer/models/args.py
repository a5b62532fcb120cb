"""Model hyper-parameters for the trainer's MoE decoders, read from a Hugging Face config (torch-free).

One dataclass, `MoEModelArgs`, holds the fields of every family in the family table
(`agentrl.trainer.models.families`: GLM-4.5, Qwen3-MoE, Nemotron-3, DeepSeek-V3 / Kimi-K2); each
family's module says which fields its ``config.json`` sets, and `from_hf_config` asks the table.
The fields after ``tie_word_embeddings`` belong to one family each (hybrid layers and Mamba-2:
nemotron_h; Multi-head Latent Attention: deepseek_v3) and keep their defaults elsewhere.

It also counts parameters and training FLOPs per token, which the layout planner
(`agentrl.trainer.parallel`) and the MFU benchmark use.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.trainer.models.families import family_for_config
from agentrl.trainer.models.mla_config import mla_attention_params

__all__ = ["MoEModelArgs"]


@dataclass(kw_only=True)
class MoEModelArgs:
    """Architecture of one MoE decoder (see the module docstring for the families)."""

    model_type: str = "glm4_moe"
    """The model's family: a key of the family table (`agentrl.trainer.models.families.FAMILIES`)."""
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
    def from_hf_config(cls, config: dict[str, Any]) -> MoEModelArgs:
        """Build from a Hugging Face ``config.json`` dict, read by its family (`families.family_for_config`)."""
        return cls(**family_for_config(config).args_from_hf(config))

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> MoEModelArgs:
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
    def for_model(cls, name_or_path: str | Path) -> MoEModelArgs:
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
        """Multi-head Latent Attention (DeepSeek-V3 / Kimi-K2: a compressed key-value latent) rather than GQA."""
        return self.kv_lora_rank > 0

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
        heads, head_dim = self.mamba_num_heads, self.mamba_head_dim
        state, chunk = self.ssm_state_size, self.mamba_chunk_size
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
        heads, head_dim = self.mamba_num_heads, self.mamba_head_dim
        state, chunk = self.ssm_state_size, self.mamba_chunk_size
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
