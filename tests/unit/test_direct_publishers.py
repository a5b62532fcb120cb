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
