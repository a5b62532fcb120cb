"""Multi-head Latent Attention (DeepSeek-V3 / Kimi-K2): parity with transformers' DeepseekV3ForCausalLM.

Float32 on the CPU, logits within 1e-4 absolute of transformers' own model with the same
weights, on packed rows (several documents back to back, each compared with transformers
run on that document alone), past YaRN's original context so the frequency ramp and the
softmax mscale both matter. Also: R3 replay, the last-layer query tail and the one-line
errors of unsupported DeepSeek configs. The bit-exact HF round trip is
`test_trainer_model.test_hf_to_trainer_to_hf_is_lossless[deepseek_v3]`.
"""

from __future__ import annotations

import json

import pytest
import torch
from trainer_helpers import make_hf_folder, tiny_deepseek_config

from agentrl.errors import AgentrlError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import build_segments
from agentrl.trainer.models.build import build_model
from agentrl.trainer.models.state_dict import load_hf_weights

ATOL = 1e-4
LENGTHS = (70, 93, 37)  # 200 tokens; positions run past the YaRN original context (64)


def _load(path):
    model = build_model(MoEModelArgs.from_hf_dir(path))
    load_hf_weights(model, path)
    return model.eval()


def _packed(seed: int):
    generator = torch.Generator().manual_seed(seed)
    documents = [torch.randint(0, 128, (n,), generator=generator) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return documents, torch.cat(documents), positions


@pytest.mark.parametrize("variant", ["yarn", "no q lora", "halves rope", "plain rope, bias", "kimi"])
def test_packed_logits_match_transformers_deepseek_v3(tmp_path, variant):
    overrides = {
        "yarn": {},
        "no q lora": {"q_lora_rank": None},
        "halves rope": {"rope_interleave": False},
        "plain rope, bias": {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, "attention_bias": True},
        "kimi": {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "num_experts_per_tok": 3},
    }[variant]
    hf = make_hf_folder(tmp_path, tiny_deepseek_config(**overrides))
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    if variant == "kimi":  # Kimi-K2 publishes model_type kimi_k2 with the DeepseekV3ForCausalLM architecture
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    model = _load(tmp_path)
    assert model.args.is_mla
    documents, ids, positions = _packed(seed=1)
    with torch.no_grad():
        packed = model(ids, positions, build_segments(positions))
        reference = torch.cat([hf(doc[None]).logits[0] for doc in documents])
    assert reference.std() > 0.1  # not a comparison of near-constant outputs
    torch.testing.assert_close(packed, reference, atol=ATOL, rtol=0)


def test_yarn_changes_frequencies_and_softmax_scale(tiny_deepseek_dir):
    """The parity above runs with YaRN in effect: its frequencies and mscale differ from plain RoPE's."""
    from agentrl.trainer.models.mla import mla_inv_freq
    from agentrl.trainer.models.mla_config import mla_softmax_scale

    args = MoEModelArgs.from_hf_dir(tiny_deepseek_dir)
    plain = MoEModelArgs(**{**args.to_dict(), "rope_scaling": None})
    yarn_freq, attention_factor = mla_inv_freq(args)
    plain_freq, _ = mla_inv_freq(plain)
    assert attention_factor == 1.0  # mscale == mscale_all_dim: cos/sin unscaled, as DeepSeek-V3
    assert torch.equal(yarn_freq[0], plain_freq[0]) and yarn_freq[-1] == pytest.approx(plain_freq[-1] / 4)
    assert mla_softmax_scale(args) == pytest.approx(32 ** -0.5 * (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    assert mla_softmax_scale(plain) == pytest.approx(32 ** -0.5)


def test_router_replay_and_query_tail(tiny_deepseek_dir):
    """R3 replays the given experts; the last layer from the first needed token on is exact (gradients too)."""
    model = _load(tiny_deepseek_dir).train()
    _, ids, positions = _packed(seed=2)
    targets = torch.roll(ids, -1)
    generator = torch.Generator().manual_seed(3)
    replay = torch.stack([torch.stack([torch.randperm(8, generator=generator)[:2] for _ in model.moe_blocks()])
                          for _ in range(ids.numel())])
    mask = torch.ones(ids.numel(), dtype=torch.bool)
    for block in model.moe_blocks():
        block.record_routing = True
    with torch.no_grad():
        free = model(ids, positions, build_segments(positions), targets_T=targets)
        replayed = model(ids, positions, build_segments(positions), targets_T=targets, replay_experts_TLK=replay,
                         replay_mask_T=mask)
    for index, block in enumerate(model.moe_blocks()):
        assert torch.equal(block.last_expert_ids, replay[:, index])
    assert not torch.allclose(free, replayed)  # the replayed experts are not the router's own
    needed = torch.zeros(ids.numel(), dtype=torch.bool)
    needed[[50, 60, 69, 150, 199]] = True
    weights = torch.randn(ids.numel(), generator=generator)

    def run(**extra):
        model.zero_grad()
        out = model(ids, positions, build_segments(positions), targets_T=targets, replay_experts_TLK=replay,
                    replay_mask_T=mask, **extra)
        (out * weights * needed).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, full_grads = run()
    tail, tail_grads = run(needed_T=needed)
    torch.testing.assert_close(tail[needed], full[needed], atol=1e-5, rtol=0)
    assert full_grads.keys() == tail_grads.keys()
    assert any(".q_a_proj." in name for name in full_grads) and any(".kv_b_proj." in name for name in full_grads)
    for name, grad in full_grads.items():
        torch.testing.assert_close(tail_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_param_counts_match_the_built_model(tiny_deepseek_dir):
    args = MoEModelArgs.from_hf_dir(tiny_deepseek_dir)
    model = build_model(args)
    assert args.param_counts()["total"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_scaling type 'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4}}, "original_max_position_embeddings"),
    ({"kv_lora_rank": None}, "kv_lora_rank is missing"),
])
def test_unsupported_deepseek_configs_are_one_line_errors(tiny_deepseek_dir, change, message):
    config = {**json.loads((tiny_deepseek_dir / "config.json").read_text()), **change}
    with pytest.raises(AgentrlError, match=message):
        MoEModelArgs.from_hf_config(config)


def test_published_rope_scaling_layout_is_read():
    """DeepSeek-V3's and Kimi-K2's hub configs: rope_scaling with `type`, rope_theta beside it."""
    config = tiny_deepseek_config().to_dict()
    config.pop("rope_parameters")
    config.update(model_type="kimi_k2", rope_theta=50000.0, rope_scaling={
        "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    args = MoEModelArgs.from_hf_config(config)
    assert args.is_mla and args.rope_theta == 50000.0
    assert args.rope_scaling["factor"] == 32.0 and args.rope_scaling["beta_fast"] == 1.0
