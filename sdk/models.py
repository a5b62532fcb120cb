"""Model presets and model resolution: a preset name, a local HF folder or an HF repo id.

`resolve_model(name_or_path)` returns a `ModelSpec` (architecture facts, HF repo id, the
GPUs a preset needs, the local folder when there is one). `ensure_model(name_or_path)`
returns a local folder with config, tokenizer and weights: `tiny-moe`, `tiny-nemotron`, `tiny-qwen3` and
`tiny-deepseek` are created on the spot (deterministic, cached under `$AGENTRL_CACHE/models`
or `~/.cache/agentrl/models`), real presets and repo ids must already be in the local Hugging
Face cache (nothing is downloaded here), a folder path is used as is.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from agentrl.created_models import (
    GLM_AIR_5B_CONFIG,
    GLM_AIR_32E_CONFIG,
    GLM_AIR_DEEP_CONFIG,
    GLM_AIR_NARROW_CONFIG,
    LOCAL_MODELS,
    NEMOTRON_NANO_7L_CONFIG,
    TINY_DEEPSEEK_CONFIG,
    TINY_QWEN3_CONFIG,
    ensure_local_model,
)
from agentrl.errors import NotFoundError

__all__ = ["PRESETS", "ModelSpec", "architecture_facts", "ensure_model", "list_presets", "resolve_model"]


class ModelSpec(BaseModel):
    """What agentrl knows about a model before loading it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str
    """Preset name, folder name or repo id; the served model name."""
    hf_repo: str | None = None
    """Hugging Face repo id of the weights (None for locally created models)."""
    architecture: str
    """HF architecture class, e.g. Glm4MoeForCausalLM."""
    family: str | None = None
    """The trainer's model family (a key of `agentrl.trainer.models.families.FAMILIES`, e.g. ``glm4_moe``);
    for a folder, its config.json ``model_type``."""
    layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Model width."""
    experts: int = 0
    """Routed experts per MoE layer (0 for dense models)."""
    experts_per_token: int = 0
    """Routed experts each token goes to (top-k)."""
    shared_experts: int = 0
    """Always-on shared experts per MoE layer."""
    dense_layers: int = 0
    """Leading dense (non-MoE) layers."""
    total_params: float | None = None
    """Total parameters."""
    active_params: float | None = None
    """Parameters active per token."""
    context: int
    """Longest context the model supports (tokens)."""
    inference_gpus: int = 0
    """H200-class GPUs one inference replica needs (0: runs on CPU)."""
    training_gpus: int = 0
    """H200-class GPUs a full RL run (trainer + inference) needs at minimum (0: runs on CPU)."""
    path: Path | None = None
    """Local folder with config, tokenizer and weights, when available."""
    description: str = ""
    """One line about the model."""
    hf_config: dict[str, Any] | None = None
    """The published config.json fields (shapes) of a preset whose weights need not be here: the trainer's
    layout planner and memory estimates read them. The architecture numbers above come from it."""

    @model_validator(mode="before")
    @classmethod
    def _facts_from_hf_config(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("hf_config"):
            data = {**architecture_facts(data["hf_config"]), **data}
        return data

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def local_path(self) -> Path:
        """The local model folder, created for tiny-moe, or a clear error when missing."""
        if self.path is not None:
            return self.path
        if self.name in LOCAL_MODELS and self.hf_repo is None:
            return ensure_local_model(self.name)
        found = _hf_cache_path(self.hf_repo) if self.hf_repo else None
        if found is None:
            raise NotFoundError(
                f"model {self.name!r}: {self.hf_repo} is not in the local Hugging Face cache; "
                f"download it first with `hf download {self.hf_repo}` or pass a local folder"
            )
        return found


def architecture_facts(config: dict[str, Any]) -> dict[str, int]:
    """Layers, width, experts, top-k, shared experts and dense layers of a HF config.json dict."""
    text = config.get("text_config", config)
    experts = text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts") or 0
    return {
        "layers": int(text.get("num_hidden_layers", 0)),
        "hidden_size": int(text.get("hidden_size", 0)),
        "experts": int(experts),
        "experts_per_token": int(text.get("num_experts_per_tok", 0) or 0),
        "shared_experts": int(text.get("n_shared_experts", 0) or 0),
        "dense_layers": int(text.get("first_k_dense_replace", 0) or 0),
    }


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="tiny-moe", family="glm4_moe",
            architecture="Glm4MoeForCausalLM", layers=4, hidden_size=64, experts=8,
            experts_per_token=2, shared_experts=1, dense_layers=1, total_params=473_152,
            active_params=251_992, context=2048,
            description="miniature GLM-4.5 MoE created locally (char tokenizer); runs on a CPU",
        ),
        ModelSpec(
            name="tiny-nemotron", family="nemotron_h",
            architecture="NemotronHForCausalLM", layers=6, hidden_size=64, experts=8,
            experts_per_token=2, shared_experts=1, total_params=349_296, active_params=201_840, context=2048,
            description="miniature Nemotron-3 (Mamba-2 + attention + MoE with non-gated relu2 experts, "
                        "layers MEME*E) created locally (char tokenizer); runs on a CPU",
        ),
        ModelSpec(
            name="tiny-deepseek", family="deepseek_v3",
            architecture="DeepseekV3ForCausalLM", total_params=1_138_880,
            active_params=909_504, context=2048,
            description="miniature DeepSeek-V3 (MLA, YaRN, group-limited routing) created locally (char tokenizer); "
                        "trains on a CPU",
            hf_config={"model_type": "deepseek_v3", **TINY_DEEPSEEK_CONFIG},
        ),
        ModelSpec(
            name="tiny-qwen3", family="qwen3_moe",
            architecture="Qwen3MoeForCausalLM", layers=4, hidden_size=64, experts=8, experts_per_token=2,
            shared_experts=0, dense_layers=1, total_params=436_544, active_params=215_360, context=2048,
            description="miniature Qwen3-MoE (softmax routing, q/k norm, no shared expert) created locally "
                        "(char tokenizer); runs on a CPU",
            hf_config={"model_type": "qwen3_moe", **TINY_QWEN3_CONFIG},
        ),
        ModelSpec(
            name="glm-air-5b", family="glm4_moe",
            architecture="Glm4MoeForCausalLM", total_params=4.928e9, active_params=0.7747e9,
            context=4096, inference_gpus=1, training_gpus=1,
            description="GLM-4.5-Air widths in 3 layers (1 dense + 2 MoE, 128 experts top-8), created locally with "
                        "the character tokenizer; one H200 (cookbook/gpu-1xh200)",
            hf_config={"model_type": "glm4_moe", **GLM_AIR_5B_CONFIG},
        ),
        ModelSpec(
            name="glm-air-32e", family="glm4_moe",
            architecture="Glm4MoeForCausalLM", total_params=1.605e9, active_params=0.774e9,
            context=4096, inference_gpus=1, training_gpus=1,
            description="glm-air-5b with 32 routed experts (top-8), created locally with the character tokenizer; "
                        "the one-GPU recipe on an 80 GiB card (cookbook/gpu-1xh200/*-80g.toml)",
            hf_config={"model_type": "glm4_moe", **GLM_AIR_32E_CONFIG},
        ),
        ModelSpec(
            name="nemotron-nano-7l", family="nemotron_h",
            architecture="NemotronHForCausalLM", total_params=4.033e9, active_params=0.3805e9,
            context=4096, inference_gpus=1, training_gpus=1,
            description="Nemotron-3-Nano's widths in its first 7 layers (MEMEM*E: Mamba-2, 128 non-gated experts "
                        "top-6, attention), created locally with the character tokenizer; one H200",
            hf_config={"model_type": "nemotron_h", **NEMOTRON_NANO_7L_CONFIG},
        ),
        ModelSpec(
            name="glm-air-deep", family="glm4_moe",
            architecture="Glm4MoeForCausalLM", total_params=3.752e9, active_params=0.567e9,
            context=4096, inference_gpus=1, training_gpus=1,
            description="GLM-4.5-Air's depth (46 layers: 1 dense + 45 MoE, 128 experts top-8) at a quarter of its "
                        "width (hidden 1024), created locally with the character tokenizer; Router Replay on one H200",
            hf_config={"model_type": "glm4_moe", **GLM_AIR_DEEP_CONFIG},
        ),
        ModelSpec(
            name="glm-air-narrow", family="glm4_moe",
            architecture="Glm4MoeForCausalLM", total_params=1.207e9, active_params=0.1452e9,
            context=4096, inference_gpus=1, training_gpus=1,
            description="GLM-4.5-Air's depth and routing at an eighth of its width (hidden 512), created locally "
                        "with the character tokenizer; pretrained until its experts specialise (agentrl pretrain)",
            hf_config={"model_type": "glm4_moe", **GLM_AIR_NARROW_CONFIG},
        ),
        ModelSpec(
            name="glm-4.5-air", family="glm4_moe",
            hf_repo="zai-org/GLM-4.5-Air", architecture="Glm4MoeForCausalLM",
            total_params=106e9, active_params=12e9, context=131072, inference_gpus=2, training_gpus=16,
            description="GLM-4.5-Air, 106B total / 12B active (bf16 weights ~212 GB)",
            hf_config={
                "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
                "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
                "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "rope_theta": 1000000.0,
                "rms_norm_eps": 1e-5, "attention_bias": True, "use_qk_norm": False, "n_routed_experts": 128,
                "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "tie_word_embeddings": False,
            },
        ),
        ModelSpec(
            name="qwen3-30b-a3b", family="qwen3_moe",
            hf_repo="Qwen/Qwen3-30B-A3B", architecture="Qwen3MoeForCausalLM",
            total_params=30.5e9, active_params=3.3e9, context=32768, inference_gpus=1, training_gpus=8,
            description="Qwen3-30B-A3B, 30.5B total / 3.3B active (131k context with YaRN)",
            hf_config={
                "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "tie_word_embeddings": False,
            },
        ),
        ModelSpec(
            name="nemotron-3-nano", family="nemotron_h", hf_repo="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
            architecture="NemotronHForCausalLM", total_params=31.6e9, active_params=3.2e9, context=262144,
            inference_gpus=1, training_gpus=9,  # trainer: 8 (cp=2 at 131k tokens, `agentrl trainer-plan`)
            description="NVIDIA Nemotron-3 Nano 30B-A3B: hybrid Mamba-2 / attention MoE, 52 layers (23 Mamba-2, "
                        "23 MoE, 6 attention), 128 routed + 1 shared relu^2 experts, top-6 (bf16 weights ~63 GB)",
            hf_config={
                "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688, "num_hidden_layers": 52,
                "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False,
                "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
                "chunk_size": 128, "use_conv_bias": True, "time_step_min": 0.001, "intermediate_size": 1856,
                "mlp_hidden_act": "relu2", "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 6,
                "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_group": 1,
                "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "layer_norm_epsilon": 1e-5,
                "max_position_embeddings": 262144, "tie_word_embeddings": False,
            },
        ),
        ModelSpec(
            name="nemotron-3-super", family="nemotron_h",
            hf_repo="nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
            architecture="NemotronHForCausalLM", total_params=120.7e9, active_params=12.2e9, context=262144,
            inference_gpus=2, training_gpus=26,  # trainer: 24 (cp=8 at 131k tokens, `agentrl trainer-plan`)
            description="NVIDIA Nemotron-3 Super 120B-A12B: 88 layers (40 Mamba-2, 40 latent MoE, 8 attention), "
                        "512 experts top-22 in a 1024-wide latent (4096 -> 1024), 1 shared expert (bf16 ~242 GB); "
                        "the layer order here is a stand-in with the published counts",
            hf_config={
                "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 4096, "num_hidden_layers": 88,
                "hybrid_override_pattern": "MEMEMEMEME*" * 8,
                "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False,
                "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4,
                "chunk_size": 128, "use_conv_bias": True, "time_step_min": 0.001, "mlp_hidden_act": "relu2",
                "n_routed_experts": 512, "n_shared_experts": 1, "num_experts_per_tok": 22,
                "moe_intermediate_size": 2688, "moe_latent_size": 1024, "moe_shared_expert_intermediate_size": 5376,
                "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 5.0,
                "layer_norm_epsilon": 1e-5, "max_position_embeddings": 262144, "tie_word_embeddings": False,
                "num_nextn_predict_layers": 1,
            },
        ),
        ModelSpec(
            name="deepseek-v3", family="deepseek_v3",
            hf_repo="deepseek-ai/DeepSeek-V3", architecture="DeepseekV3ForCausalLM",
            total_params=671e9, active_params=37e9, context=131072,
            inference_gpus=8, training_gpus=128,
            description="DeepSeek-V3, 671B total / 37B active (FP8 weights ~700 GB), multi-node",
            hf_config={  # the published config.json (multi-token-prediction layer left out: not trained)
                "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8,
                "n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
                "topk_method": "noaux_tc", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
                "rope_theta": 10000, "rope_scaling": {
                    "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                "tie_word_embeddings": False,
            },
        ),
        ModelSpec(
            name="kimi-k2", family="deepseek_v3",
            hf_repo="moonshotai/Kimi-K2-Instruct", architecture="DeepseekV3ForCausalLM",
            total_params=1.04e12, active_params=32e9, context=131072, inference_gpus=16, training_gpus=144,
            description="Kimi-K2, 1.04T total / 32B active (MLA, 384 experts top-8; FP8 weights ~1 TB), "
                        "multi-node",
            # config.json of moonshotai/Kimi-K2-Instruct (model_type kimi_k2 with DeepSeek-V3's config class);
            # inference_gpus: FP8 weights need 2 nodes of H200s with room for KV; training_gpus: the smallest
            # cluster `agentrl train --model kimi-k2 --seq-len 131072 --dry-run` fits (cookbook/kimi-k2/).
            hf_config={
                "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840,
                "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
                "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
                "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "max_position_embeddings": 131072,
                "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
            },
        ),
    ]
}

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def list_presets() -> list[ModelSpec]:
    """All presets, in registry order."""
    return list(PRESETS.values())


def _hf_cache_path(repo_id: str) -> Path | None:
    """The local snapshot of `repo_id` in the HF cache, or None (never downloads)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover
        return None
    try:
        # HF_HUB_CACHE is read at call time so a changed cache location is honoured.
        cache_dir = os.environ.get("HF_HUB_CACHE") or None
        path = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return path if (path / "config.json").is_file() else None


def _spec_from_folder(path: Path, *, name: str, hf_repo: str | None = None) -> ModelSpec:
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise NotFoundError(f"model folder {path}: cannot read config.json ({exc})") from exc
    text = config.get("text_config", config)
    return ModelSpec(
        name=name, hf_repo=hf_repo, path=path, architecture=(config.get("architectures") or ["unknown"])[0],
        family=text.get("model_type"),
        context=int(text.get("max_position_embeddings", 0) or 0), description=f"local folder {path}",
        **architecture_facts(config),
    )


def _checkpoints_of(folder: Path) -> list[str]:
    """The `step_N` folders of a run's checkpoints folder, in step order ([] when there are none)."""
    if not folder.is_dir():
        return []
    steps = [child.name for child in folder.iterdir() if child.is_dir() and child.name.startswith("step_")
             and child.name[5:].isdigit()]
    return sorted(steps, key=lambda name: int(name[5:]))


def _missing_folder(path: Path) -> str:
    """Why a model path names nothing: the checkpoints its folder has, or the deepest folder of it that exists and
    the closest name there."""
    steps = _checkpoints_of(path.parent)
    if steps:
        return f"no checkpoint {path}: {path.parent} has {', '.join(steps[-5:])}"
    import difflib

    missing = path
    while str(missing.parent) not in ("", ".", missing.anchor) and not missing.parent.is_dir():
        missing = missing.parent
    where = missing.parent if missing.parent.is_dir() else Path(".")
    names = [child.name for child in where.iterdir() if child.is_dir()] if where.is_dir() else []
    close = difflib.get_close_matches(missing.name, names, n=1, cutoff=0.6)
    return (f"no model folder {path} ({where} has no {missing.name}"
            + (f"; did you mean {where / close[0]}?)" if close else ")")
            + ": pass an HF model folder, a run's checkpoint (RUN/checkpoints/step_N) or a preset")


def resolve_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name, a local HF model folder or a cached HF repo id -> ModelSpec."""
    key = str(name_or_path)
    if key in PRESETS:
        spec = PRESETS[key]
        if spec.hf_repo and spec.path is None:
            cached = _hf_cache_path(spec.hf_repo)
            if cached is not None:
                return spec.model_copy(update={"path": cached})
        return spec
    path = Path(key).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            if (path / "adapter_config.json").is_file():  # a LoRA run's checkpoint: the adapters alone
                base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
                raise NotFoundError(f"model folder {path} holds a LoRA adapter for {base or 'its base model'}, not "
                                    "a model: serving base + adapter is not built yet; pass a full-weight model folder")
            steps = _checkpoints_of(path / "checkpoints")
            if steps:  # a run folder: its checkpoints are the models
                raise NotFoundError(f"model folder {path} is a run folder, not a model; pass one of its checkpoints: "
                                    f"{path / 'checkpoints' / steps[-1]} ({', '.join(steps[-5:])})")
            raise NotFoundError(f"model folder {path} has no config.json; pass an HF model folder")
        spec = _spec_from_folder(path.resolve(), name=path.resolve().name)
        marker = path / "agentrl_model.json"
        made = json.loads(marker.read_text()).get("name") if marker.is_file() else None
        if made in ("tiny-moe", "tiny-nemotron", "tiny-deepseek", "tiny-qwen3"):
            spec = PRESETS[made].model_copy(update={"path": path.resolve(), "name": path.resolve().name})
        return spec
    if not path.exists() and (key.startswith(("/", ".", "~")) or key.count("/") > 1 or (
            str(path.parent) not in ("", ".") and path.parent.is_dir())):
        raise NotFoundError(_missing_folder(path))
    if _REPO_ID.match(key) and not path.exists():
        cached = _hf_cache_path(key)
        if cached is None:
            raise NotFoundError(
                f"model {key!r} is not in the local Hugging Face cache; download it first with "
                f"`hf download {key}`, or use a preset: {', '.join(PRESETS)}"
            )
        return _spec_from_folder(cached, name=key, hf_repo=key)
    import difflib

    close = difflib.get_close_matches(key, list(PRESETS), n=1, cutoff=0.6)
    raise NotFoundError(
        f"unknown model {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        + f": use a preset ({', '.join(PRESETS)}), a local HF model folder or an HF repo id"
    )


def ensure_model(name_or_path: str | Path = "tiny-moe") -> Path:
    """A local folder with the model's config, tokenizer and weights (creates tiny-moe)."""
    return resolve_model(name_or_path).local_path()
