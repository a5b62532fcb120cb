"""The direct publishers' CPU-checkable behaviour: both sides of an NCCL call, and a clear error without CUDA.

`_alongside` runs the trainer's end of NCCL calls in a thread while the server's HTTP call runs; a
side that fails must end the update at once, since its peer never arrives (the other side would wait
in NCCL or the rendezvous forever), and the stuck thread must not hold up the event loop's shutdown.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from agentrl.inference.direct_weights import IpcWeightPublisher, NcclWeightPublisher, _alongside
from agentrl.inference.server import free_port
from agentrl.inference.server_control import server_controls
from agentrl.inference.weights import WeightUpdateError

never = threading.Event()  # never set: a peer that never arrives


async def init_on_closed_port():
    async with server_controls([f"http://127.0.0.1:{free_port()}"], timeout_s=10) as (control,):
        return await _alongside(control._post("/init_weight_transfer_engine", what="init_weight_transfer_engine",
                                              json={"init_info": {}}), never.wait)


def test_a_failed_server_call_ends_the_update_without_waiting_for_the_trainer_side():
    started = time.monotonic()
    with pytest.raises(WeightUpdateError, match="init_weight_transfer_engine on http://127.0.0.1"):
        asyncio.run(init_on_closed_port())  # returns although the trainer's thread still waits
    assert time.monotonic() - started < 30


def test_a_failed_trainer_side_ends_the_update_without_waiting_for_the_server():
    def broadcast():
        raise RuntimeError("NCCL error: unhandled system error")

    with pytest.raises(RuntimeError, match="NCCL error"):
        asyncio.run(_alongside(asyncio.sleep(3600), broadcast))


def test_both_sides_done_gives_the_trainer_side_result():
    assert asyncio.run(_alongside(asyncio.sleep(0.05), lambda: "group")) == "group"


@pytest.mark.parametrize("make", [
    lambda: NcclWeightPublisher(["http://127.0.0.1:9"], master_address="127.0.0.1", master_port=29555,
                                workers_per_server=1),
    lambda: IpcWeightPublisher(["http://127.0.0.1:9"]),
])
def test_without_cuda_connect_says_so(make):
    torch = pytest.importorskip("torch", reason="torch (agentrl[cpu]) is not installed")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(WeightUpdateError, match="Publisher needs"):
        make().connect()


def test_an_unknown_wire_dtype_is_refused():
    with pytest.raises(WeightUpdateError, match="dtype='int8'"):
        IpcWeightPublisher(["http://127.0.0.1:9"], dtype="int8")


class _OneBufferPublisher(IpcWeightPublisher):
    """IPC's packed send with its one shared buffer modelled on the CPU (CUDA IPC cannot run here): filling a
    chunk overwrites `buffer`, and a server reads the buffer while it answers that chunk's `/update_weights`."""

    def __init__(self, urls):
        super().__init__(urls)
        self._server_versions = dict.fromkeys(urls, "0.24.0")  # no `/version` call
        self.buffer = None
        self.read: dict[str, list[tuple[str, str]]] = {url: [] for url in urls}

    def _packed_chunks(self, weights):
        for name in weights:
            self.buffer = name  # this chunk's tensors copied in
            yield {"names": [name]}

    async def _post_chunk(self, control, version, fields):
        await asyncio.sleep(0)  # the request is in flight: the other server's update runs meanwhile
        self.read[control.url].append((fields["names"][0], self.buffer))


def test_servers_sharing_the_packed_buffer_take_turns(monkeypatch):
    """A P/D pair on the trainer's GPU: both servers are updated at once and read the one packed buffer. Each
    must read its chunk before the next is copied in (on an H100, without turns, the second server of the
    pair loaded another chunk's bytes as `embed_tokens` and the weight check stopped the run at version 4)."""
    import contextlib
    from types import SimpleNamespace

    torch = pytest.importorskip("torch", reason="torch (agentrl[cpu]) is not installed")
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    publisher = _OneBufferPublisher(urls)
    weights = {f"model.layers.{i}.weight": None for i in range(4)}

    async def update_both():
        await asyncio.gather(*(publisher._send_tensors(SimpleNamespace(url=url), weights) for url in urls))

    for _ in range(2):  # a publish per event loop, as `_run_sync` runs them
        asyncio.run(update_both())
    for url in urls:
        assert publisher.read[url] == [(name, name) for name in weights] * 2, url
