"""The Mamba-2 scan through fla's simple GLA (`trainer.models.ssd_fla`) and `trainer.mamba_scan`.

fla's Triton kernels run on CUDA only (tests/gpu/test_mamba_scan_gpu.py checks them against the float32
reference, with gradients). Here the mapping of SSD onto simple GLA is checked with fla's own torch
reference of the same operation (`naive_chunk_simple_gla`, run per document), against `ssd_scan`: outputs
and every input's gradient on packed documents, with B/C groups shared by several heads.
"""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import perturbed_mamba_mixer

from agentrl.errors import ConfigError
from agentrl.trainer.models.args import MoEModelArgs
from agentrl.trainer.models.build import build_model
from agentrl.trainer.models.mamba2 import Mamba2Mixer, MambaSequences, ssd_scan
from agentrl.trainer.models.ssd_fla import document_bounds, ssd_scan_gla, use_mamba_scan


def _naive_gla_per_document(q, k, v, g, cu_seqlens):
    """fla's torch reference of simple GLA (scale 1), one document at a time: what `cu_seqlens` asks of the kernel."""
    from fla.ops.simple_gla.naive import naive_chunk_simple_gla

    bounds = cu_seqlens.tolist()
    pieces = [naive_chunk_simple_gla(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], scale=1.0, chunk_size=4)[0]
              for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces, dim=1)


def test_document_bounds_are_the_cumulative_document_lengths():
    doc = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 3])
    assert document_bounds(doc).tolist() == [0, 3, 4, 8, 9]
    assert document_bounds(doc).dtype == torch.int64


def test_scan_as_simple_gla_equals_the_reference_with_gradients():
    generator = torch.Generator().manual_seed(0)
    lengths = (3, 9, 12, 1, 6)  # boundaries inside and on chunk edges, a one-token document
    tokens, heads, head_dim, groups, state = sum(lengths), 4, 3, 2, 5
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    leaves = [torch.randn(tokens, heads, head_dim, generator=generator),
              torch.rand(tokens, heads, generator=generator) * 0.5 + 0.05,
              -torch.rand(heads, generator=generator) * 2 - 0.1,
              torch.randn(tokens, groups, state, generator=generator),
              torch.randn(tokens, groups, state, generator=generator),
              torch.randn(heads, generator=generator)]
    weights = torch.randn(tokens, heads, head_dim, generator=generator)
    results = []
    for scan in (lambda *t: ssd_scan(*t, doc, chunk=4),
                 lambda *t: ssd_scan_gla(*t, doc, dtype=torch.float32, gla=_naive_gla_per_document)):
        inputs = [t.clone().requires_grad_() for t in leaves]
        out = scan(*inputs)
        (out * weights).sum().backward()
        results.append((out.detach(), [t.grad for t in inputs]))
    (want, want_grads), (got, got_grads) = results
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, g_got, g_want in zip("x dt A B C D".split(), got_grads, want_grads):
        assert g_want.abs().max() > 0, name
        torch.testing.assert_close(g_got, g_want, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")


def test_a_mixer_on_the_gla_path_restarts_at_each_document(tiny_nemotron_dir, monkeypatch):
    import agentrl.trainer.models.ssd_fla as ssd_fla

    monkeypatch.setattr(ssd_fla, "fla_chunk_gla", _naive_gla_per_document)  # the CPU has no Triton kernels
    args, mixer = perturbed_mamba_mixer(tiny_nemotron_dir)
    lengths = (5, 19, 1, 11)
    x = torch.randn(sum(lengths), args.hidden_size)
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        reference = mixer(x, MambaSequences.for_row(positions))
        mixer.scan_kernel = "fla"
        through_gla = mixer(x, MambaSequences.for_row(positions))
        whole = mixer(x, MambaSequences.for_row(torch.arange(x.shape[0])))
    torch.testing.assert_close(through_gla, reference, atol=1e-5, rtol=1e-5)
    assert (whole[lengths[0]:] - reference[lengths[0]:]).abs().max() > 1e-3


def test_mamba_scan_setting_on_the_cpu(tiny_nemotron_dir):
    hybrid = build_model(MoEModelArgs.from_hf_dir(tiny_nemotron_dir))
    mixers = [m for m in hybrid.modules() if isinstance(m, Mamba2Mixer)]
    assert mixers and all(m.scan_kernel == "torch" for m in mixers)
    assert use_mamba_scan(hybrid, "auto", device_type="cpu") == "torch"
    assert use_mamba_scan(hybrid, "torch", device_type="cpu") == "torch"
    with pytest.raises(ConfigError, match=r"^trainer.mamba_scan='fla': .* CUDA only.*set trainer.mamba_scan='auto'"):
        use_mamba_scan(hybrid, "fla", device_type="cpu")


def test_mamba_scan_fla_without_fla_core_is_refused_in_one_line(tiny_nemotron_dir, monkeypatch):
    import agentrl.trainer.models.ssd_fla as ssd_fla

    monkeypatch.setattr(ssd_fla, "fla_installed", lambda: False)
    hybrid = build_model(MoEModelArgs.from_hf_dir(tiny_nemotron_dir))
    with pytest.raises(ConfigError, match=r"^trainer.mamba_scan='fla' needs fla-core; install the train extra"):
        use_mamba_scan(hybrid, "fla", device_type="cuda")
    assert use_mamba_scan(hybrid, "auto", device_type="cuda") == "torch"


def test_a_trainer_asked_for_fla_on_the_cpu_stops_before_loading(tiny_nemotron_dir):
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer

    with pytest.raises(ConfigError, match="trainer.mamba_scan='fla'"):
        Trainer(TrainerConfig(mamba_scan="fla"), model_dir=tiny_nemotron_dir, device="cpu")


def test_a_model_without_mamba_layers_is_left_alone(tiny_glm_dir):
    dense = build_model(MoEModelArgs.from_hf_dir(tiny_glm_dir))
    assert use_mamba_scan(dense, "auto", device_type="cpu") == ""


def test_fla_that_does_not_import_falls_back_under_auto_and_is_refused_when_asked(tiny_nemotron_dir, monkeypatch,
                                                                                   caplog):
    import agentrl.trainer.models.ssd_fla as ssd_fla

    monkeypatch.setattr(ssd_fla, "fla_import_error", lambda: "ImportError: triton too old")
    hybrid = build_model(MoEModelArgs.from_hf_dir(tiny_nemotron_dir))
    with caplog.at_level("WARNING"):
        assert use_mamba_scan(hybrid, "auto", device_type="cuda") == "torch"
    assert "triton too old" in caplog.text
    with pytest.raises(ConfigError, match=r"^trainer.mamba_scan='fla': fla's kernels cannot train here "
                                          r"\(ImportError: triton too old\); set trainer.mamba_scan='torch'$"):
        use_mamba_scan(hybrid, "fla", device_type="cuda")
    monkeypatch.setattr(ssd_fla, "fla_import_error", lambda: None)
    assert use_mamba_scan(hybrid, "auto", device_type="cuda") == "fla"
    assert all(m.scan_kernel == "fla" for m in hybrid.modules() if isinstance(m, Mamba2Mixer))


@pytest.mark.parametrize(("hopper", "triton_3_4", "triton_3_7_1", "refused"), [
    (True, True, False, True),  # the lent H100/H200 image: Triton 3.6.0
    (True, True, True, False),
    (True, False, False, False),
    (False, True, False, False),
])
def test_fla_on_hopper_with_a_triton_it_refuses_to_train_with_is_not_chosen(monkeypatch, hopper, triton_3_4,
                                                                              triton_3_7_1, refused):
    import fla.utils

    import agentrl.trainer.models.ssd_fla as ssd_fla

    monkeypatch.setattr(fla.utils, "IS_NVIDIA_HOPPER", hopper)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_4_0", triton_3_4)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", triton_3_7_1)
    reason = ssd_fla.fla_import_error()
    assert (reason is not None) == refused
    if refused:
        assert "Hopper" in reason and "bring Triton >= 3.7.1" in reason
