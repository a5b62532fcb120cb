"""The Mamba-2 scan through fla's Triton kernels against the float32 reference on CUDA (skips without CUDA or fla).

`ssd_fla.ssd_scan_gla` feeds fla's `chunk_simple_gla` bf16 ``q = C``, ``k = B``, ``v = x dt`` and a float32
log decay, with the row's documents as ``cu_seqlens``. At Nemotron-3-Nano's Mamba shapes (64 heads of 64,
state 128 in 8 groups), on a packed row of documents whose boundaries fall inside and on fla's 64-token
chunks, its output and the gradients of every input must equal `mamba2.ssd_scan` in float32 within bf16
rounding: relative Frobenius error below 2e-2 (inputs rounded to bf16 once; the reference sees the same
rounded values). The mixer on the fla path must also restart at every document (packed = each alone).
Where fla refuses its gated backward (Hopper with Triton < 3.7.1: the lent image's 3.6.0, seen on an H100
on 2026-12-05) the first test compares the forward only and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit" / "trainer"))

LENGTHS = (700, 64, 1, 1331, 2000)  # 4,096 tokens: a one-token document and one on a chunk edge


def _cuda_and_fla() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla", reason="fla-core (the train extra) runs the fused scan")


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.detach().double() - reference.double()).norm() / reference.double().norm())


def test_fla_scan_matches_the_float32_reference_with_gradients():
    _cuda_and_fla()
    from agentrl.trainer.models.mamba2 import ssd_scan
    from agentrl.trainer.models.ssd_fla import fla_import_error, ssd_scan_gla

    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens, heads, head_dim, groups, state = sum(LENGTHS), 64, 64, 8, 128
    doc = torch.cat([torch.full((n,), i, device="cuda") for i, n in enumerate(LENGTHS)])

    def bf16_rounded(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale + shift).bfloat16().float()

    leaves = [bf16_rounded(tokens, heads, head_dim),
              torch.nn.functional.softplus(bf16_rounded(tokens, heads, shift=-2.0)),
              -torch.exp(torch.rand(heads, device="cuda", generator=generator) * 2.5),
              bf16_rounded(tokens, groups, state, scale=0.3),
              bf16_rounded(tokens, groups, state, scale=0.3),
              torch.ones(heads, device="cuda")]
    weights = torch.randn(tokens, heads, head_dim, device="cuda", generator=generator)
    # fla refuses its gated backward on Hopper with Triton < 3.7.1 (the lent image has 3.6.0): then the forward only
    backward = fla_import_error() is None
    results = []
    for scan in (lambda *t: ssd_scan(*t, doc, chunk=128),
                 lambda *t: ssd_scan_gla(*t, doc, dtype=torch.bfloat16)):
        inputs = [t.clone().requires_grad_(backward) for t in leaves]
        out = scan(*inputs)
        if backward:
            (out * weights).sum().backward()
        results.append((out.detach(), [t.grad for t in inputs]))
    (want, want_grads), (got, got_grads) = results
    errors = {"y": _relative(got, want)}
    if backward:
        errors.update({f"d{name}": _relative(g, w)
                       for name, g, w in zip("x dt A B C D".split(), got_grads, want_grads)})
    print("relative errors:", {k: f"{v:.2e}" for k, v in errors.items()}, "" if backward else
          f"(forward only: {fla_import_error()})")
    assert all(v < 2e-2 for v in errors.values()), errors


def test_fla_mixer_restarts_at_each_document_under_autocast(tmp_path):
    _cuda_and_fla()
    from trainer_helpers import make_hf_folder, tiny_nemotron_config

    from agentrl.trainer.models.args import MoEModelArgs
    from agentrl.trainer.models.mamba2 import Mamba2Mixer, MambaSequences

    make_hf_folder(tmp_path, tiny_nemotron_config())
    args = MoEModelArgs.from_hf_dir(tmp_path)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(args).cuda()
    mixer.scan_kernel = "fla"
    lengths = (300, 1, 211)
    x = torch.randn(sum(lengths), args.hidden_size, device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = mixer(x, MambaSequences.for_row(positions)).float()
        pieces, start = [], 0
        for n in lengths:
            pieces.append(mixer(x[start:start + n], MambaSequences.for_row(torch.arange(n, device="cuda"))).float())
            start += n
        mixer.scan_kernel = "torch"
        reference = mixer(x, MambaSequences.for_row(positions)).float()
    alone = torch.cat(pieces)
    assert _relative(packed, alone) < 5e-3
    assert _relative(packed, reference) < 2e-2
