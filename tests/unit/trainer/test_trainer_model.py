"""Parity of the trainer's MoE decoder with transformers, and the lossless HF adapter.

Tolerance: float32 on the CPU, logits within 1e-4 absolute of transformers' own model
(same weights; the two differ only in summation order).
"""

from __future__ import annotations

import json

import pytest
import torch
from trainer_helpers import make_hf_folder, tiny_deepseek_config, tiny_glm_config

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import build_segments
from agentrl.trainer.models.build import build_model
from agentrl.trainer.models.state_dict import load_hf_weights, read_hf_state, save_hf_weights

ATOL = 1e-4


def _trainer_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.numel())
    with torch.no_grad():
        return model(ids, positions, build_segments(positions))


def _load(path):
    model = build_model(MoEModelArgs.from_hf_dir(path))
    load_hf_weights(model, path)
    return model.eval()


def test_glm_logits_match_transformers(tmp_path):
    hf = make_hf_folder(tmp_path, tiny_glm_config())
    model = _load(tmp_path)
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    assert reference.std() > 0.1  # the comparison is not between near-constant outputs
    torch.testing.assert_close(_trainer_logits(model, ids), reference, atol=ATOL, rtol=0)


def test_glm_qk_norm_variant_matches(tmp_path):
    hf = make_hf_folder(tmp_path, tiny_glm_config(use_qk_norm=True, first_k_dense_replace=0, n_group=1, topk_group=1))
    ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    torch.testing.assert_close(_trainer_logits(_load(tmp_path), ids), reference, atol=ATOL, rtol=0)


def test_qwen3_moe_logits_match_transformers(tmp_path):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False,
    )
    hf = make_hf_folder(tmp_path, config)
    model = _load(tmp_path)
    assert model.args.score_func == "softmax" and model.args.moe_layers == [1]
    ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    torch.testing.assert_close(_trainer_logits(model, ids), reference, atol=ATOL, rtol=0)


def test_packed_documents_do_not_attend_across(tiny_glm_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_glm_dir).eval()
    model = _load(tiny_glm_dir)
    generator = torch.Generator().manual_seed(4)
    first, second = torch.randint(0, 128, (9,), generator=generator), torch.randint(0, 128, (13,), generator=generator)
    ids = torch.cat([first, second])
    positions = torch.cat([torch.arange(9), torch.arange(13)])
    with torch.no_grad():
        packed = model(ids, positions, build_segments(positions))
        reference = torch.cat([hf(first[None]).logits[0], hf(second[None]).logits[0]])
    torch.testing.assert_close(packed, reference, atol=ATOL, rtol=0)


def test_targets_give_logprobs_of_logits(tiny_glm_dir):
    model = _load(tiny_glm_dir)
    model.logprob_chunk_tokens = 5  # several chunks
    ids = torch.randint(0, 128, (17,), generator=torch.Generator().manual_seed(5))
    targets = torch.roll(ids, -1)
    positions = torch.arange(17)
    with torch.no_grad():
        logprobs = model(ids, positions, build_segments(positions), targets_T=targets)
        expected = torch.log_softmax(model(ids, positions, build_segments(positions)), -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", [tiny_glm_config, tiny_deepseek_config], ids=["glm4_moe", "deepseek_v3"])
def test_hf_to_trainer_to_hf_is_lossless(tmp_path, config):
    source = tmp_path / "source"
    make_hf_folder(source, config(), max_shard_size="100KB")
    assert (source / "model.safetensors.index.json").is_file()  # sharded input
    model = _load(source)
    out = save_hf_weights(model.state_dict(), tmp_path / "export", args=model.args, source_dir=source,
                          max_shard_bytes=200_000)
    original, exported = read_hf_state(source), read_hf_state(out)
    assert set(original) == set(exported)
    for key in original:
        assert original[key].dtype == exported[key].dtype, key
        assert torch.equal(original[key], exported[key]), key
    assert json.loads((out / "config.json").read_text())["model_type"] == config().model_type
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (8,))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids[None]).logits[0], _trainer_logits(model, ids), atol=ATOL, rtol=0)


def test_bad_inputs_give_one_line_errors(tmp_path, tiny_glm_dir):
    with pytest.raises(NotFoundError, match="config.json"):
        MoEModelArgs.from_hf_dir(tmp_path)
    with pytest.raises(AgentrlError, match="model_type 'llama' is not supported"):
        MoEModelArgs.from_hf_config({"model_type": "llama"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(AgentrlError, match="not valid JSON"):
        MoEModelArgs.from_hf_dir(tmp_path)
    # a checkpoint missing one expert names the layer and the count
    from safetensors.torch import save_file

    state = read_hf_state(tiny_glm_dir)
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(state, str(broken / "model.safetensors"))
    (broken / "config.json").write_text((tiny_glm_dir / "config.json").read_text())
    model = build_model(MoEModelArgs.from_hf_dir(broken))
    with pytest.raises(AgentrlError, match="layer 1 up_proj: found experts 7 of 8"):
        load_hf_weights(model, broken)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_zigzag_cp_segments_give_the_same_attention(cp_size):
    from agentrl.trainer.models.attention import _sdpa_attention, cp_chunks, cp_token_index

    total = 12 * cp_size
    positions = torch.cat([torch.arange(n) for n in (5, 2 * cp_size + 3, total - 2 * cp_size - 8)])
    assert positions.numel() == total
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, 4, 8, generator=generator) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA: 4 query heads, 2 KV heads
    reference = _sdpa_attention(q, k, v, build_segments(positions), 8**-0.5)
    indices = [cp_token_index(total, cp_rank=r, cp_size=cp_size) for r in range(cp_size)]
    assert sorted(torch.cat(indices).tolist()) == list(range(total))  # every token on exactly one rank
    gathered_k, gathered_v = torch.cat([k[i] for i in indices]), torch.cat([v[i] for i in indices])  # all-gather
    for rank, index in enumerate(indices):
        chunks = cp_chunks(total, cp_rank=rank, cp_size=cp_size)
        assert chunks[0][0] == rank * total // (2 * cp_size) and chunks[1][1] == total - rank * total // (2 * cp_size)
        segments = build_segments(positions, cp_rank=rank, cp_size=cp_size)
        out = _sdpa_attention(q[index], gathered_k[segments.kv_index], gathered_v[segments.kv_index], segments, 8**-0.5)
        torch.testing.assert_close(out, reference[index], atol=1e-5, rtol=0)


def test_packed_attention_and_its_gradients_equal_one_document_at_a_time():
    from agentrl.trainer.models.attention import _sdpa_attention, _split_sizes

    assert _split_sizes([(0, 3), (3, 5)], 7) == ([3, 2, 2], [0, 1])  # a trailing gap is a piece
    assert _split_sizes([(2, 4)], 4) == ([2, 2], [1])  # a leading gap too
    assert _split_sizes([(0, 4), (2, 6)], 6) is None  # overlapping keys (CP) fall back to slices
    lengths = (5, 9, 1, 7)
    positions = torch.cat([torch.arange(n) for n in lengths])
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(positions.numel(), 4, 8, generator=generator, requires_grad=True) for _ in range(3))
    packed = _sdpa_attention(q, k, v, build_segments(positions), 8**-0.5)
    (packed * torch.arange(packed.numel()).reshape(packed.shape).sin()).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    start = 0
    pieces = []
    for n in lengths:  # each document alone: plain causal attention
        qd, kd, vd = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        pieces.append(torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=8**-0.5)
                      .transpose(0, 1))
        start += n
    alone = torch.cat(pieces)
    (alone * torch.arange(alone.numel()).reshape(alone.shape).sin()).sum().backward()
    torch.testing.assert_close(packed, alone, atol=1e-6, rtol=0)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_query_tail_keeps_each_segments_needed_end():
    from agentrl.trainer.models.attention import query_tail

    positions = torch.cat([torch.arange(n) for n in (5, 4, 6)])
    needed = torch.zeros(15, dtype=torch.bool)
    needed[[2, 4, 12]] = True  # first segment from token 2, second segment nothing, third from 12
    tail, index = query_tail(build_segments(positions), needed)
    assert index.tolist() == [2, 3, 4, 8, 12, 13, 14]  # a segment with no needed token keeps its last
    assert tail.q_bounds == [(0, 3), (3, 4), (4, 7)]
    assert tail.k_bounds == [(0, 5), (5, 9), (9, 15)]
    assert tail.cu_seq_q.tolist() == [0, 3, 4, 7] and tail.max_q == 3


@pytest.mark.parametrize("replay", ["off", "masked", "no mask"])
def test_needed_tokens_give_the_full_passs_logprobs_and_gradients(tiny_glm_dir, replay):
    """The last layer computed only from each sample's first needed token is exact, gradients too."""
    model = _load(tiny_glm_dir).train()
    generator = torch.Generator().manual_seed(6)
    lengths = (11, 7, 9)
    ids = torch.randint(0, 128, (sum(lengths),), generator=generator)
    targets = torch.roll(ids, -1)
    positions = torch.cat([torch.arange(n) for n in lengths])
    needed = torch.zeros(ids.numel(), dtype=torch.bool)
    needed[[6, 7, 8, 10, 24, 26]] = True  # completions of samples 1 and 3 (with a gap); sample 2 has none
    kwargs = {}
    if replay != "off":
        moe_layers = len(model.moe_blocks())
        kwargs = {"replay_experts_TLK": torch.randint(0, 8, (ids.numel(), moe_layers, 2), generator=generator)}
        if replay == "masked":
            kwargs["replay_mask_T"] = torch.rand(ids.numel(), generator=generator) < 0.7
    assert list(model.layers.values())[-1].is_moe  # the pruned last layer routes (and replays) too
    weights = torch.randn(ids.numel(), generator=generator)

    def run(**extra):
        model.zero_grad()
        logprobs = model(ids, positions, build_segments(positions), targets_T=targets, **kwargs, **extra)
        (logprobs * weights * needed).sum().backward()
        return logprobs.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    full, full_grads = run()
    tail, tail_grads = run(needed_T=needed)
    computed = torch.zeros_like(needed)
    computed[[6, 7, 8, 9, 10, 17, 24, 25, 26]] = True  # from each sample's first needed token (or its last) on
    torch.testing.assert_close(tail[computed], full[computed], atol=1e-5, rtol=0)
    assert (tail[~computed] == 0).all()
    assert full_grads.keys() == tail_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(tail_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
