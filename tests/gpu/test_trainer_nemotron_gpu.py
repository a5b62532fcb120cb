"""Nemotron-3 on CUDA: the non-gated experts' grouped GEMMs and the hybrid model in bf16 (skips without CUDA).

`ReluSquaredExperts` runs two bf16 grouped GEMMs (torch's `_grouped_mm`) on CUDA and an exact
per-expert loop elsewhere. On the same bf16-rounded weights and rows (some experts with no rows)
the CUDA path's output and gradients must equal the loop's float64 ones within bf16 rounding
(relative Frobenius error below 1e-2; the hidden activation is rounded to bf16 once).

The tiny NemotronH (Mamba-2, MoE, attention, MLP layers) on CUDA under bf16 autocast, as the
trainer computes on one GPU, against the CPU model in float32: the same comparison on the CPU
(bf16 autocast against float32, the loop or `_grouped_mm`) gave mean 4.9e-3, 98.5% of logits
within 5e-2 and 96% of argmaxes equal (a token whose experts flip between near-tied scores
differs more); the bounds below are about 3x looser. Backward must reach every expert weight.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit" / "trainer"))

LENGTHS = (70, 93, 37)


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.detach().double().cpu() - reference).norm() / reference.norm())


def test_nongated_experts_grouped_gemm_matches_the_loop():
    _cuda()
    from torchtitan.models.common.moe import GroupedExperts

    from agentrl.trainer.models.moe_block import ReluSquaredExperts

    experts_count, dim, hidden = 8, 256, 512
    counts = torch.tensor([37, 0, 128, 5, 64, 1, 0, 91])
    generator = torch.Generator().manual_seed(0)
    experts = ReluSquaredExperts(GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts_count))
    with torch.no_grad():
        for weight in experts.parameters():
            weight.copy_((torch.randn(weight.shape, generator=generator) * dim**-0.5).bfloat16().float())
    rows = torch.randn(int(counts.sum()), dim, generator=generator).bfloat16().float()

    reference = ReluSquaredExperts(
        GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts_count)
    )
    reference.load_state_dict(experts.state_dict())
    reference = reference.double()
    rows_ref = rows.double().requires_grad_()
    out_ref = reference(rows_ref, counts)  # the CPU loop
    out_ref.square().sum().backward()

    experts = experts.to("cuda:0")
    rows_gpu = rows.to("cuda:0").requires_grad_()
    out = experts(rows_gpu, counts.to("cuda:0"))  # the grouped GEMMs
    assert out.dtype == torch.float32 and out.shape == out_ref.shape
    out.square().sum().backward()
    assert _relative(out, out_ref.detach()) < 1e-2
    assert _relative(rows_gpu.grad, rows_ref.grad) < 2e-2
    for name in ("w1_EFD", "w2_EDF"):
        grad, grad_ref = getattr(experts, name).grad, getattr(reference, name).grad
        assert _relative(grad, grad_ref) < 2e-2, name
        assert float(grad[1].abs().max()) == 0.0 and float(grad[6].abs().max()) == 0.0  # experts without rows


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    from trainer_helpers import make_hf_folder, tiny_nemotron_config

    path = tmp_path_factory.mktemp("tiny-nemotron-gpu")
    make_hf_folder(path, tiny_nemotron_config())
    return path


def _model(model_dir, device: str):
    from agentrl.trainer.models.args import MoEModelArgs
    from agentrl.trainer.models.build import build_model
    from agentrl.trainer.models.state_dict import load_hf_weights

    model = build_model(MoEModelArgs.from_hf_dir(model_dir))
    load_hf_weights(model, model_dir)
    return model.to(device=device)


def _inputs(device: str):
    from agentrl.trainer.models.attention import build_segments

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (sum(LENGTHS),), generator=generator)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return ids.to(device), positions.to(device), build_segments(positions).to(torch.device(device))


def test_nemotron_on_cuda_in_bf16_tracks_the_cpu(nemotron_dir):
    _cuda()
    with torch.no_grad():
        reference = _model(nemotron_dir, "cpu").eval()(*_inputs("cpu")).float()
    model = _model(nemotron_dir, "cuda:0")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(*_inputs("cuda:0"))
    error = (logits.detach().float().cpu() - reference).abs()
    agree = float((logits.detach().float().cpu().argmax(-1) == reference.argmax(-1)).float().mean())
    assert float((error < 5e-2).float().mean()) >= 0.95 and float(error.mean()) < 1.5e-2, float(error.max())
    assert agree >= 0.9, agree
    logits.float().logsumexp(-1).mean().backward()
    moe_experts = [module for module in model.modules() if type(module).__name__ == "ReluSquaredExperts"]
    assert moe_experts
    for experts in moe_experts:
        for weight in (experts.w1_EFD, experts.w2_EDF):
            assert weight.grad is not None and bool(torch.isfinite(weight.grad).all())
            assert float(weight.grad.abs().sum()) > 0
