"""The trainer's packed CUDA IPC buffer: made and shared once, filled chunk by chunk at every weight update.

`IpcWeightPublisher` (packed, the default) copies the wire tensors of an update into one buffer per
chunk and sends the server that buffer's CUDA IPC handle with each tensor's size (vLLM's
`packed_ipc_consumer` reads it on the other side and clones the tensors out). vLLM's own
`packed_ipc_producer` allocates and shares a new buffer at every update; the server's process
never releases a buffer it opened, so torch keeps each one allocated in the trainer (its
cross-process reference count never drops) and every update left `buffer_bytes` behind: on the
H200 the trainer's peak grew by 1.0 GiB a step, 82.4 -> 93.4 GiB over steps 1-12, and ran out of
memory at step 13 (2026-12-03, `cookbook/gpu-1xh200`; the unpacked path, a handle per tensor,
leaks every tensor's copy). `PackedIpcBuffer` allocates one buffer and takes its handle once, and
every update reuses both: the trainer holds exactly one buffer, and the server reopens nothing.

`fill` is device-agnostic (the tests run it on the CPU); only `handle` needs CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["PackedChunk", "PackedIpcBuffer"]


class PackedChunk:
    """One buffer-full: the tensors' names, shapes, dtype names and byte sizes, in buffer order."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.shapes: list[list[int]] = []
        self.dtype_names: list[str] = []
        self.tensor_sizes: list[int] = []

    @property
    def nbytes(self) -> int:
        return sum(self.tensor_sizes)


class PackedIpcBuffer:
    """A byte buffer kept for the publisher's lifetime; grown (a new one) only when an update needs more."""

    def __init__(self, *, device: Any = "cuda") -> None:
        self.device = device
        self.buffer: Any = None
        self._handle: tuple | None = None
        self.allocations = 0
        """How many buffers were made (1 unless a larger tensor came)."""

    def reserve(self, size: int) -> Any:
        """The buffer, made (again) only when it is smaller than `size` bytes."""
        import torch

        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._handle = None
            self.allocations += 1
        return self.buffer

    def handle(self) -> tuple:
        """The buffer's CUDA IPC handle (torch's `reduce_tensor` arguments), taken once per buffer."""
        from torch.multiprocessing.reductions import reduce_tensor

        if self._handle is None:
            self._handle = reduce_tensor(self.buffer)[1]
        return self._handle

    def fill(self, tensors: Iterable[tuple[str, Any]], *, size: int) -> Iterator[PackedChunk]:
        """Copy `tensors` (name, contiguous tensor on the buffer's device) into the buffer in order, yielding a
        `PackedChunk` each time it is full and after the last; the caller hands each chunk to the server before
        asking for the next (the next chunk overwrites the buffer). A tensor larger than `size` is an error."""
        buffer = self.reserve(size)
        chunk, used = PackedChunk(), 0
        for name, tensor in tensors:
            flat = tensor.contiguous().view(-1).view(buffer.dtype)
            if flat.numel() > size:
                raise ValueError(f"{name}: {flat.numel()} bytes do not fit the {size}-byte IPC buffer")
            if used and used + flat.numel() > size:
                self._synchronize()
                yield chunk
                chunk, used = PackedChunk(), 0
            buffer[used:used + flat.numel()].copy_(flat)
            chunk.names.append(name)
            chunk.shapes.append(list(tensor.shape))
            chunk.dtype_names.append(str(tensor.dtype).removeprefix("torch."))
            chunk.tensor_sizes.append(flat.numel())
            used += flat.numel()
        if used:
            self._synchronize()
            yield chunk

    def _synchronize(self) -> None:
        """The copies are complete before the server reads the buffer."""
        if getattr(self.buffer, "is_cuda", False):
            import torch

            torch.cuda.current_stream(self.buffer.device).synchronize()
