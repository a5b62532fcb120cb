"""The packed IPC buffer (`inference/ipc_buffer.py`) on the CPU: what vLLM's consumer unpacks from it, and that
every update reuses the one buffer (a buffer per update, as vLLM's producer makes, stayed allocated in the
trainer for good: +1 GiB a step on the H200 until it ran out of memory)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentrl.inference.ipc_buffer import PackedIpcBuffer  # noqa: E402


def _state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(40, 8, generator=generator).to(torch.bfloat16),
            "a.bias": torch.randn(40, generator=generator),
            "b.weight": torch.randn(16, 8, generator=generator).to(torch.bfloat16),
            "c.weight": torch.randn(30, 8, generator=generator).to(torch.bfloat16)}


def _unpack(buffer: PackedIpcBuffer, chunk) -> dict:
    """What vLLM's `packed_ipc_consumer` does with a chunk (its own `unpack_tensor`, then clones)."""
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    packed = buffer.buffer[:chunk.nbytes]
    dtypes = [getattr(torch, name) for name in chunk.dtype_names]
    return {name: tensor.clone() for name, tensor in
            unpack_tensor(packed, chunk.names, chunk.shapes, dtypes, chunk.tensor_sizes)}


def test_chunks_unpack_to_the_tensors_in_order():
    pytest.importorskip("vllm")
    state = _state(0)
    buffer = PackedIpcBuffer(device="cpu")
    received = {}
    chunks = []
    for chunk in buffer.fill(state.items(), size=800):  # a.weight 640 + a.bias 160, then b + c (256 + 480)
        chunks.append(list(chunk.names))
        received.update(_unpack(buffer, chunk))  # read before the next chunk overwrites the buffer
    assert chunks == [["a.weight", "a.bias"], ["b.weight", "c.weight"]]
    assert received.keys() == state.keys()
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)


def test_every_update_reuses_the_one_buffer():
    buffer = PackedIpcBuffer(device="cpu")
    pointers = set()
    for seed in range(3):  # three updates
        for _ in buffer.fill(_state(seed).items(), size=800):
            pointers.add(buffer.buffer.data_ptr())
    assert buffer.allocations == 1 and len(pointers) == 1
    list(buffer.fill({"big": torch.zeros(1000, dtype=torch.uint8)}.items(), size=1000))  # grows once when needed
    assert buffer.allocations == 2


def test_a_tensor_larger_than_the_buffer_is_named():
    buffer = PackedIpcBuffer(device="cpu")
    with pytest.raises(ValueError, match="huge: 4000 bytes do not fit the 800-byte IPC buffer"):
        list(buffer.fill({"huge": torch.zeros(1000)}.items(), size=800))
