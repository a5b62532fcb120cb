"""Router Replay (R3): replayed experts are used exactly; gate weights and gradients stay live."""

from __future__ import annotations

import torch

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.attention import build_segments
from agentrl.trainer.models.build import build_model
from agentrl.trainer.models.router import build_router
from agentrl.trainer.models.state_dict import load_hf_weights


def test_replayed_gate_weights_by_hand():
    router = build_router(hidden_size=2, num_experts=4, top_k=2, score_func="sigmoid", num_expert_groups=1,
                          num_limited_groups=1, route_norm=True, route_scale=2.0)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]))
    x = torch.tensor([[1.0, 2.0]])
    # live scores: sigmoid(1), sigmoid(2), sigmoid(3), sigmoid(-1); live top-2 = experts {2, 1}
    weights, ids = router(x)
    assert sorted(ids[0].tolist()) == [1, 2]
    replay = torch.tensor([[3, 0]])
    weights, ids = router(x, replay_expert_ids_TK=replay, replay_mask_T=torch.tensor([True]))
    assert ids.tolist() == [[3, 0]]
    s3, s0 = torch.sigmoid(torch.tensor(-1.0)), torch.sigmoid(torch.tensor(1.0))
    expected = torch.stack([s3, s0]) / (s3 + s0) * 2.0
    torch.testing.assert_close(weights[0], expected)
    (weights * torch.tensor([[1.0, 3.0]])).sum().backward()  # gate gets gradient only through the replayed experts' rows
    grad = router.gate.weight.grad
    assert grad[3].abs().sum() > 0 and grad[0].abs().sum() > 0
    assert grad[1].abs().sum() == 0 and grad[2].abs().sum() == 0


def test_correction_bias_and_group_limit_pick_experts():
    router = build_router(hidden_size=1, num_experts=4, top_k=1, score_func="sigmoid", num_expert_groups=2,
                          num_limited_groups=1, route_norm=False, route_scale=1.0)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0], [0.9], [1.2], [-5.0]]))
    x = torch.tensor([[1.0]])
    # groups {0,1} (top-2 sum ~1.44) and {2,3} (~0.77): group 0 wins, expert 0 is its best
    assert router(x)[1].tolist() == [[0]]
    # a bias of +0.1 on expert 1 changes the choice but not the gate weight (unbiased score)
    weights, ids = router(x, torch.tensor([0.0, 0.1, 0.0, 0.0]))
    assert ids.tolist() == [[1]]
    torch.testing.assert_close(weights[0, 0], torch.sigmoid(torch.tensor(0.9)))


def test_model_replay_reproduces_recorded_routing_and_router_learns(tiny_glm_dir):
    model = build_model(MoEModelArgs.from_hf_dir(tiny_glm_dir))
    load_hf_weights(model, tiny_glm_dir)
    blocks = model.moe_blocks()
    for block in blocks:
        block.record_routing = True
    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(20)
    segments = build_segments(positions)
    with torch.no_grad():
        live = model(ids, positions, segments)
    recorded = torch.stack([block.last_expert_ids for block in blocks], dim=1)  # (T, layers, K)

    # 1) replaying what was recorded gives the same routing and the same logits
    with torch.no_grad():
        replayed = model(ids, positions, segments, replay_experts_TLK=recorded, replay_mask_T=torch.ones(20, dtype=torch.bool))
    for layer, block in enumerate(blocks):
        assert torch.equal(block.last_expert_ids, recorded[:, layer])
    torch.testing.assert_close(replayed, live, atol=1e-6, rtol=0)

    # 2) replaying other experts (as a different inference routing would) is followed exactly,
    #    and the router's gate still receives gradients
    other = (recorded + 3) % model.args.num_experts
    model.zero_grad()
    logprobs = model(ids, positions, segments, targets_T=torch.roll(ids, -1), replay_experts_TLK=other,
                     replay_mask_T=torch.ones(20, dtype=torch.bool))
    for layer, block in enumerate(blocks):
        assert torch.equal(block.last_expert_ids, other[:, layer])
    logprobs.sum().backward()
    for block in blocks:
        assert block.router.gate.weight.grad is not None and block.router.gate.weight.grad.abs().sum() > 0

    # 3) tokens whose replay_mask is False keep their live routing
    mask = torch.zeros(20, dtype=torch.bool)
    mask[:5] = True
    with torch.no_grad():
        model(ids, positions, segments, replay_experts_TLK=other, replay_mask_T=mask)
    for layer, block in enumerate(blocks):
        assert torch.equal(block.last_expert_ids[:5], other[:5, layer])
        assert torch.equal(block.last_expert_ids[5:], recorded[5:, layer])


def test_router_logits_stay_float32_under_bf16_autocast():
    """Like vLLM's GLM-4.5 gate (float32 weights and input): autocast must not round the router's logits."""
    router = build_router(hidden_size=64, num_experts=8, top_k=2, score_func="sigmoid", num_expert_groups=1,
                          num_limited_groups=1, route_norm=True, route_scale=1.0)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    full_weights, full_ids = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights, ids = router(x)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, full_ids)
    torch.testing.assert_close(weights, full_weights, atol=1e-6, rtol=1e-6)  # bf16 logits would be ~1e-3 off


def test_replayed_gate_weights_are_used_forward_and_the_gate_keeps_the_live_gradient():
    router = build_router(hidden_size=2, num_experts=4, top_k=2, score_func="sigmoid", num_expert_groups=1,
                          num_limited_groups=1, route_norm=True, route_scale=2.0)
    with torch.no_grad():
        router.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]))
    x = torch.tensor([[1.0, 2.0], [0.5, -1.0]])
    ids = torch.tensor([[3, 0], [1, 2]])
    mask = torch.tensor([True, True])
    inference = torch.tensor([[0.25, 1.75], [float("nan"), float("nan")]])  # the second token's are unknown
    live, _ = router(x, replay_expert_ids_TK=ids, replay_mask_T=mask)
    router.gate.weight.grad = None
    (live * torch.tensor([[1.0, 3.0], [2.0, 1.0]])).sum().backward()
    live_grad = router.gate.weight.grad.clone()
    router.gate.weight.grad = None
    weights, chosen = router(x, replay_expert_ids_TK=ids, replay_mask_T=mask, replay_weights_TK=inference)
    assert chosen.tolist() == ids.tolist()
    torch.testing.assert_close(weights[0], inference[0])  # replayed where known
    torch.testing.assert_close(weights[1], live[1].detach())  # live where unknown
    (weights * torch.tensor([[1.0, 3.0], [2.0, 1.0]])).sum().backward()
    torch.testing.assert_close(router.gate.weight.grad, live_grad)  # straight-through: the live gradient
    # a token outside the replay mask keeps its own weights even when some were sent
    weights, _ = router(x, replay_expert_ids_TK=ids, replay_mask_T=torch.tensor([False, True]),
                        replay_weights_TK=inference)
    torch.testing.assert_close(weights[0], router(x)[0][0])
