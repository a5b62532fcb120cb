"""Nemotron-3 (NemotronH) in the trainer: the Mamba-2 mixer, parity with transformers, the HF adapter, R3.

Tolerance: float32 on the CPU, logits within 1e-4 absolute of transformers' own
`NemotronHForCausalLM` (same weights, its torch fallbacks for the conv and the chunked scan).
Packed rows are compared with transformers run on each document alone: the trainer's conv
and SSM state must restart at every document boundary.
"""

from __future__ import annotations

import json

import pytest
import torch
from trainer_helpers import make_hf_folder, perturbed_mamba_mixer, tiny_nemotron_config

from agentrl.errors import AgentrlError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import build_segments
from agentrl.trainer.models.build import build_model
from agentrl.trainer.models.mamba2 import MambaSequences, ssd_scan
from agentrl.trainer.models.state_dict import hf_to_native, load_hf_weights, read_hf_state, save_hf_weights

ATOL = 1e-4
LENGTHS = (5, 19, 1, 11)  # across Mamba chunks of 8 tokens, with a one-token document


def _load(path):
    model = build_model(MoEModelArgs.from_hf_dir(path))
    load_hf_weights(model, path)
    return model.eval()


def _packed(lengths=LENGTHS, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 128, (n,), generator=generator) for n in lengths]
    return docs, torch.cat(docs), torch.cat([torch.arange(n) for n in lengths])


@pytest.mark.parametrize("latent", [None, 24], ids=["nano-like", "latent-moe"])
def test_packed_logits_match_transformers_document_by_document(tmp_path, latent):
    hf = make_hf_folder(tmp_path, tiny_nemotron_config(moe_latent_size=latent))
    model = _load(tmp_path)
    assert model.args.layer_types == ["mamba", "moe", "attention", "mlp", "mamba", "moe"]
    assert model.args.moe_latent_size == latent and not model.args.expert_gated
    docs, ids, positions = _packed()
    with torch.no_grad():
        reference = torch.cat([hf(doc[None]).logits[0] for doc in docs])
        packed = model(ids, positions, build_segments(positions))
        whole = model(ids, torch.arange(ids.numel()), build_segments(torch.arange(ids.numel())))
    assert reference.std() > 0.1
    torch.testing.assert_close(packed, reference, atol=ATOL, rtol=0)
    # the same tokens as one document give other logits after the first boundary: the restart matters
    assert (whole[LENGTHS[0]:] - reference[LENGTHS[0]:]).abs().max() > 1e-2


def _sequential_scan(x, dt, A, B, C, D, doc):
    """The SSM recurrence token by token: h = exp(dt A) h + dt B x, y = C h + D x, h = 0 at a document start."""
    tokens, heads, head_dim = x.shape
    per_group = heads // B.shape[1]
    state = torch.zeros(heads, head_dim, B.shape[2], dtype=torch.float64)
    out = []
    for t in range(tokens):
        if t == 0 or doc[t] != doc[t - 1]:
            state = torch.zeros_like(state)
        b = B[t].repeat_interleave(per_group, 0).double()
        c = C[t].repeat_interleave(per_group, 0).double()
        decay = torch.exp(dt[t].double() * A.double())
        state = decay[:, None, None] * state + (dt[t].double()[:, None] * x[t].double())[:, :, None] * b[:, None, :]
        out.append(torch.einsum("hpn,hn->hp", state, c) + D.double()[:, None] * x[t].double())
    return torch.stack(out).float()


def test_chunked_scan_equals_the_recurrence_across_chunks_and_documents():
    generator = torch.Generator().manual_seed(0)
    lengths = (3, 9, 12, 1, 6)  # boundaries inside chunks, on a chunk edge (24), and a padded last chunk (31 tokens)
    tokens, heads, head_dim, groups, state = sum(lengths), 4, 3, 2, 5
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    x = torch.randn(tokens, heads, head_dim, generator=generator)
    dt = torch.rand(tokens, heads, generator=generator) * 0.5
    A = -torch.rand(heads, generator=generator) * 2
    B, C = (torch.randn(tokens, groups, state, generator=generator) for _ in range(2))
    D = torch.randn(heads, generator=generator)
    torch.testing.assert_close(ssd_scan(x, dt, A, B, C, D, doc, chunk=4), _sequential_scan(x, dt, A, B, C, D, doc),
                               atol=1e-5, rtol=0)


def test_mamba_mixer_on_packed_documents_equals_each_alone_with_gradients(tiny_nemotron_dir):
    args, mixer = perturbed_mamba_mixer(tiny_nemotron_dir)
    x = torch.randn(sum(LENGTHS), args.hidden_size, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    packed = mixer(x, MambaSequences.for_row(positions))
    weights = torch.arange(packed.numel()).reshape(packed.shape).sin()
    (packed * weights).sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in mixer.parameters()]
    x.grad = None
    mixer.zero_grad()
    pieces, start = [], 0
    for n in LENGTHS:
        pieces.append(mixer(x[start:start + n], MambaSequences.for_row(torch.arange(n))))
        start += n
    alone = torch.cat(pieces)
    (alone * weights).sum().backward()
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    for got, want in zip(grads, [x.grad] + [p.grad for p in mixer.parameters()]):
        # A parameter's gradient sums every token's terms, in another order packed than alone (and in
        # threads): float32 rounding then scales with the tensor's largest gradients (some are ~30), so
        # a small element that is a sum of large terms may differ by 2e-5. A leak between documents
        # would differ by far more.
        torch.testing.assert_close(got, want, atol=1e-5 + 2e-6 * want.abs().max().item(), rtol=1e-5)


def test_relu_squared_experts_grouped_gemm_path_equals_the_loop():
    from torchtitan.models.common.moe import GroupedExperts

    from agentrl.trainer.models.moe_block import ReluSquaredExperts

    experts = ReluSquaredExperts(GroupedExperts.Config(dim=64, hidden_dim=32, num_experts=4))
    assert not hasattr(experts, "w3_EFD")  # non-gated: up (w1) and down (w2) only
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # bf16-exact weights and inputs: both paths then see the same numbers
        for param in experts.parameters():
            param.copy_((torch.randn(param.shape, generator=generator) * 0.2).bfloat16().float())
    x = torch.randn(10, 64, generator=generator).bfloat16().float()
    counts = torch.tensor([3, 0, 5, 2])
    loop = experts(x, counts)  # the CPU per-expert loop, float32
    grouped = experts.grouped_forward(x, counts)  # torch._grouped_mm in bf16, as on CUDA
    up = torch.cat([torch.square(torch.relu(rows @ experts.w1_EFD[e].t())) @ experts.w2_EDF[e].t()
                    for e, rows in enumerate(torch.split(x, counts.tolist()))])
    torch.testing.assert_close(loop, up, atol=1e-5, rtol=0)
    torch.testing.assert_close(grouped, loop, atol=0.05, rtol=0.02)  # one bf16 rounding of the hidden activation


def test_hf_to_trainer_to_hf_is_bit_exact(tmp_path):
    source = tmp_path / "source"
    hf = make_hf_folder(source, tiny_nemotron_config(moe_latent_size=24), max_shard_size="100KB")
    assert (source / "model.safetensors.index.json").is_file()  # sharded input, hub layout (backbone.*)
    model = _load(source)
    out = save_hf_weights(model.state_dict(), tmp_path / "export", args=model.args, source_dir=source,
                          max_shard_bytes=200_000)
    original, exported = read_hf_state(source), read_hf_state(out)
    assert set(original) == set(exported) and "backbone.layers.1.mixer.experts.7.up_proj.weight" in exported
    for key in original:
        assert original[key].dtype == exported[key].dtype, key
        assert torch.equal(original[key], exported[key]), key
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron_h"
    # transformers' in-memory layout (model.*, fused experts) maps to the same trainer tensors
    fused = hf_to_native(hf.state_dict(), model.args)
    assert set(fused) == set(model.state_dict())
    for key, tensor in model.state_dict().items():
        assert torch.equal(fused[key], tensor), key
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    _, ids, positions = _packed((13,))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids[None]).logits[0], model(ids, positions, build_segments(positions)),
                                   atol=ATOL, rtol=0)


def test_router_replay_routes_to_the_replayed_experts(tiny_nemotron_dir):
    model = _load(tiny_nemotron_dir)
    _, ids, positions = _packed()
    blocks = model.moe_blocks()
    assert len(blocks) == 2
    for block in blocks:
        block.record_routing = True
    segments = build_segments(positions)
    with torch.no_grad():
        live = model(ids, positions, segments)
        replay = torch.stack([(block.last_expert_ids + 3) % 8 for block in blocks], dim=1)  # (T, moe layers, k)
        replayed = model(ids, positions, segments, replay_experts_TLK=replay,
                         replay_mask_T=torch.ones(ids.numel(), dtype=torch.bool))
    for index, block in enumerate(blocks):
        assert torch.equal(block.last_expert_ids, replay[:, index])
    assert (replayed - live).abs().max() > 1e-3


def test_needed_tokens_give_the_full_pass_logprobs(tiny_nemotron_dir):
    model = _load(tiny_nemotron_dir)
    _, ids, positions = _packed()
    targets = torch.roll(ids, -1)
    needed = torch.zeros(ids.numel(), dtype=torch.bool)
    needed[[3, 4, 20, 30, 35]] = True
    segments = build_segments(positions)
    with torch.no_grad():
        full = model(ids, positions, segments, targets_T=targets)
        tail = model(ids, positions, segments, targets_T=targets, needed_T=needed)
        logits = model(ids, positions, segments)
    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=0)
    computed = torch.zeros_like(needed)
    computed[[3, 4, 20, 21, 22, 23, 24, 30, 31, 32, 33, 34, 35]] = True  # each document from its first needed token
    torch.testing.assert_close(tail[computed], full[computed], atol=1e-5, rtol=0)
    assert (tail[~computed] == 0).all()


def test_bad_nemotron_configs_give_one_line_errors(tmp_path, tiny_nemotron_dir):
    config = json.loads((tiny_nemotron_dir / "config.json").read_text())
    with pytest.raises(AgentrlError, match=r"unknown layer kinds \['X'\]"):
        MoEModelArgs.from_hf_config({**config, "layers_block_type": None, "hybrid_override_pattern": "MX*"})
    with pytest.raises(AgentrlError, match="mlp_hidden_act 'silu' is not supported"):
        MoEModelArgs.from_hf_config({**config, "mlp_hidden_act": "silu"})
    with pytest.raises(AgentrlError, match="needs hybrid_override_pattern or layers_block_type"):
        MoEModelArgs.from_hf_config({**config, "layers_block_type": None})
    from safetensors.torch import save_file

    state = read_hf_state(tiny_nemotron_dir)
    del state["backbone.layers.5.mixer.experts.2.down_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(state, str(broken / "model.safetensors"))
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(AgentrlError, match="layer 5 down_proj: found experts 7 of 8"):
        load_hf_weights(build_model(MoEModelArgs.from_hf_dir(broken)), broken)
