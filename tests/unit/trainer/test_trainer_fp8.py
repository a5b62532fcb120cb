"""FP8 training (`trainer.fp8`, torchao's row-wise Float8Linear) on the CPU: the projections are swapped and the
routers and output head are not, SFT in FP8 tracks bf16 step for step on the same batches (the loss curves stay
within a few percent and both fall), the export keeps the checkpoint's names, and the settings that cannot run are
refused in one line."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import make_samples

from agentrl.errors import ConfigError
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.trainer import Trainer

pytest.importorskip("torchao")


def _trainer(model_dir, fp8: str) -> Trainer:
    config = TrainerConfig(row_tokens=64, fp8=fp8, loss={"mode": "sft"}, optimizer={"lr": 3e-3},
                           parallel={"param_dtype": "bfloat16"}, round_like_vllm_cpu=False)
    return Trainer(config, model_dir=model_dir, device="cpu")


def test_fp8_sft_tracks_bf16_and_exports_the_same_names(tiny_glm_dir, tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    curves = {}
    for fp8 in ("off", "linears"):
        trainer = _trainer(tiny_glm_dir, fp8)
        swapped = {name for name, module in trainer.model.named_modules() if isinstance(module, Float8Linear)}
        if fp8 == "linears":
            assert any(name.endswith("self_attn.q_proj") for name in swapped)
            assert any(name.endswith("shared_experts.w1") for name in swapped)
            assert not any(name.endswith((".gate", "lm_head")) for name in swapped), swapped
        else:
            assert not swapped
        batch = trainer.pack(make_samples(count=12, with_experts=False))
        curves[fp8] = [trainer.step(batch)["nll"] for _ in range(12)]
        exported = trainer.export_hf(tmp_path / fp8)
        names = sorted(path.name for path in exported.glob("*.safetensors"))
        assert names, exported
    base, low = curves["off"], curves["linears"]
    assert low[-1] < low[0] - 0.2 and base[-1] < base[0] - 0.2, curves
    gaps = [abs(a - b) / b for a, b in zip(low, base, strict=True)]
    print(f"fp8 vs bf16 SFT nll: {low[0]:.4f} -> {low[-1]:.4f} against {base[0]:.4f} -> {base[-1]:.4f}, largest "
          f"relative gap {max(gaps):.4f}")
    assert max(gaps) < 0.05, gaps
    from safetensors.torch import load_file

    first = load_file(str(next((tmp_path / "off").glob("*.safetensors"))))
    second = load_file(str(next((tmp_path / "linears").glob("*.safetensors"))))
    assert set(first) == set(second)


def test_settings_fp8_cannot_run_are_refused_in_one_line(tiny_glm_dir):
    with pytest.raises(ConfigError, match=r"trainer.fp8='all': the routed experts' FP8 grouped GEMMs run on CUDA"
                                          r" only") as info:
        _trainer(tiny_glm_dir, "all")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"trainer.fp8='linears' with trainer.lora"):
        TrainerConfig(fp8="linears", lora={"rank": 4, "alpha": 8})
    assert torch.float8_e4m3fn  # the dtype the row-wise recipe casts to exists in this torch
