"""tiny-nemotron: a miniature Nemotron-3 made locally (deterministic, loadable, the tiny-moe tokenizer)."""

from __future__ import annotations

import json

import pytest

from agentrl.models import PRESETS, ensure_model, resolve_model

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def nemotron_path():
    return ensure_model("tiny-nemotron")


def test_folder_is_a_nemotron_h_hybrid_with_non_gated_experts(nemotron_path):
    config = json.loads((nemotron_path / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"] and config["model_type"] == "nemotron_h"
    assert config["layers_block_type"] == [
        "linear_attention", "moe", "linear_attention", "moe", "full_attention", "moe"]  # MEME*E
    assert config["mlp_hidden_act"] == "relu2" and config["n_routed_experts"] == 8
    assert config["num_experts_per_tok"] == 2 and config["n_shared_experts"] == 1
    spec = PRESETS["tiny-nemotron"]
    assert (spec.layers, spec.hidden_size, spec.experts, spec.experts_per_token, spec.shared_experts) == (
        len(config["layers_block_type"]), config["hidden_size"], 8, 2, 1)
    assert resolve_model(nemotron_path).architecture == "NemotronHForCausalLM"
    assert resolve_model(str(nemotron_path)).total_params == spec.total_params  # folder -> its preset
    assert ensure_model("tiny-nemotron") == nemotron_path  # cached, not re-created


def test_shares_the_tiny_moe_tokenizer_and_template(nemotron_path):
    tiny_moe = ensure_model("tiny-moe")
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (nemotron_path / name).read_bytes() == (tiny_moe / name).read_bytes(), name


def test_creation_is_deterministic(nemotron_path, tmp_path):
    from agentrl.created_models import create_local_model

    again = create_local_model("tiny-nemotron", tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (nemotron_path / name).read_bytes(), name
    other = create_local_model("tiny-nemotron", tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (nemotron_path / "model.safetensors").read_bytes()


def test_runs_in_transformers_with_seeded_router_biases(nemotron_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(nemotron_path, dtype=torch.float32).eval()
    spec = PRESETS["tiny-nemotron"]
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert total == spec.total_params
    assert total - routed + routed * spec.experts_per_token // spec.experts == spec.active_params
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert len(biases) == 3 and all(bias.abs().min() > 0 for bias in biases)  # not transformers' zeros
    with torch.no_grad():
        logits = model(torch.tensor([[3, 20, 21, 22]])).logits
    assert logits.shape == (1, 4, 128) and torch.isfinite(logits).all()


def test_cpu_server_gets_the_plugin_fixes_and_no_prefix_caching(nemotron_path, monkeypatch):
    from agentrl.inference.server import VLLMServer

    monkeypatch.delenv("AGENTRL_CPU_FIXES", raising=False)
    server = VLLMServer("tiny-nemotron", device="cpu", port=18002)
    assert "--no-enable-prefix-caching" in server.command()  # Mamba prefix caching needs chunked prefill
    assert server.environment()["AGENTRL_CPU_FIXES"] == "1"  # the non-gated experts need the plugin
    assert VLLMServer("tiny-nemotron", device="cpu", env={"AGENTRL_CPU_FIXES": "0"}).environment()[
        "AGENTRL_CPU_FIXES"] == "0"
    gated = VLLMServer("tiny-moe", device="cpu", port=18003)
    assert "--no-enable-prefix-caching" not in gated.command()
    assert "AGENTRL_CPU_FIXES" not in gated.environment()
