"""Block FP8's width rule (`inference.fp8_blocks`): which widths 128 does not divide, and a dense-MLP padding that
keeps the model's function (the logits of the padded copy equal the original's in float32)."""

from __future__ import annotations

import json

import pytest

from agentrl.created_models import GLM_AIR_32E_CONFIG, TINY_DEEPSEEK_CONFIG, TINY_MOE_CONFIG
from agentrl.inference.fp8_blocks import block_fp8_misfits, pad_dense_mlp


def test_the_widths_block_fp8_cannot_take_are_named():
    assert block_fp8_misfits(GLM_AIR_32E_CONFIG) == ["intermediate_size = 10944"]
    deepseek_v3 = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                   "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
                   "num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536}
    assert block_fp8_misfits(deepseek_v3) == []
    assert block_fp8_misfits({"text_config": deepseek_v3}) == []
    # tiny-moe: 64 wide everywhere but its dense MLP (128); no dense layer: its intermediate_size is not used
    assert block_fp8_misfits(TINY_MOE_CONFIG) == ["hidden_size = 64", "moe_intermediate_size = 64",
                                                  "shared experts' width = 64"]
    assert "intermediate_size = 128" not in block_fp8_misfits({**TINY_MOE_CONFIG, "first_k_dense_replace": 0})
    assert block_fp8_misfits(TINY_DEEPSEEK_CONFIG, block=32) == []


def test_the_padded_copy_computes_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from agentrl.models import ensure_model

    source = ensure_model("tiny-moe")
    padded = pad_dense_mlp(source, tmp_path / "padded", block=96)  # tiny-moe's dense MLP: 128 -> 192
    assert json.loads((padded / "config.json").read_text())["intermediate_size"] == 192
    assert (padded / "tokenizer.json").is_file()
    tokens = torch.tensor([[3, 20, 21, 22, 40, 41]])
    logits = []
    for path in (source, padded):
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert model.model.layers[0].mlp.down_proj.weight.shape[1] == 192
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-6)
