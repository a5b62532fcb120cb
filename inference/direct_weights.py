"""The direct weight transports: the trainer's GPU tensors into vLLM's weight-transfer engine.

`NcclWeightPublisher` (trainer and servers on different GPUs: vLLM's `nccl` engine, the trainer
broadcasting as rank 0) and `IpcWeightPublisher` (a trainer sharing the server's GPU: CUDA IPC
handles into vLLM's `ipc` engine). Both are `weights.WeightPublisher`s (pause, load, version,
resume, every server at once) and share `_DirectWeightPublisher`: engine init per server, the
start / update / finish calls of one update, the tensors' wire dtypes, and `resend` instead of
`restore` for a restarted server (the weights live in the trainer). What differs between vLLM
0.24 and 0.32 on these routes is in `vllm_compat`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from agentrl.errors import require
from agentrl.inference.ipc_buffer import PackedIpcBuffer
from agentrl.inference.server import free_port
from agentrl.inference.server_control import ServerControl, server_controls
from agentrl.inference.vllm_compat import (
    ipc_init_info,
    ipc_update_info,
    nccl_init_info,
    nccl_trainer_group,
    nccl_update_info,
)
from agentrl.inference.weight_staging import check_weights_match
from agentrl.inference.weights import WeightPublisher, WeightUpdateError, _run_sync
from agentrl.weight_digest import tensor_digests

__all__ = ["NcclWeightPublisher", "IpcWeightPublisher", "wire_bytes"]


class _DirectWeightPublisher(WeightPublisher):
    """What the direct transports (GPU memory to vLLM's weight-transfer engine) share.

    `connect()` initialises every server's engine (`/init_weight_transfer_engine`, `_init_engine`);
    one update of a paused server is `/start_weight_update` (HF names, `is_checkpoint_format`), the
    transport's `/update_weights` (`_send_tensors`), `/finish_weight_update` (the version; 0.24
    ignores the body). Tensors go out as `_wire_tensor` makes them: matrices in the served `dtype`,
    vectors (norms, biases, GLM's expert-score correction bias, which vLLM keeps in float32) in
    float32; vLLM casts on copy, and vectors are a sliver of the bytes. The weights live in the
    trainer, so a restarted server gets them through `resend`, not `restore`.
    """

    _needs_cuda = "needs a CUDA GPU in the trainer's process"

    def __init__(self, urls: list[str], *, dtype: str, timeout_s: float, recompute_kv: bool,
                 verify: bool = True, kernel_format: bool = False) -> None:
        super().__init__(urls, timeout_s=timeout_s, recompute_kv=recompute_kv, verify=verify)
        if dtype not in _ITEM_BYTES:
            raise WeightUpdateError(f"{type(self).__name__}: dtype={dtype!r}; use one of {', '.join(_ITEM_BYTES)}")
        self.dtype = dtype
        self.kernel_format = kernel_format
        """Send the served layout (`kernel_format.KernelLayout`), which vLLM copies in, not checkpoint names."""
        self._layouts: dict[str, Any] = {}  # url -> its KernelLayout, made at its first kernel-format update
        self._connected = False
        self._device: int | None = None  # the trainer's CUDA device, fixed when the engines are connected

    def connect(self) -> None:
        """Initialise the transfer engine of every server (once)."""
        torch = require("torch", "vllm")
        if not torch.cuda.is_available():
            raise WeightUpdateError(f"{type(self).__name__} {self._needs_cuda}")
        if self._device is None:
            self._device = torch.cuda.current_device()
        _run_sync(self._init_engines(self.urls))
        self._connected = True

    async def _init_engines(self, urls: list[str]) -> None:
        async with server_controls(urls, timeout_s=self.timeout_s) as controls:
            for control in controls:
                await self._init_engine(control)

    def _reconnect(self, url: str) -> None:
        """A restarted server has a fresh, uninitialised engine: initialise it again."""
        if self._connected:  # not connected yet: the first publish connects every server
            _run_sync(self._init_engines([url]))

    def _prepare(self, weights: Mapping[str, Any] | str | Path, version: int, served: dict | None) -> Mapping[str, Any]:
        if isinstance(weights, (str, Path)):
            raise WeightUpdateError(
                f"{type(self).__name__} sends tensors from GPU memory; pass the HF-named state dict"
            )
        if not weights:
            raise WeightUpdateError("publish: the state dict is empty; pass the model's HF-named tensors")
        if served:
            check_weights_match({name: tuple(t.shape) for name, t in weights.items()}, served, source="the state dict")
        if not self._connected:
            first = next(iter(weights.values()))
            if getattr(first, "is_cuda", False):  # connected from a worker thread: the tensors' device
                self._device = first.device.index
            self.connect()
        return weights

    def _expected_digest(self, weights: Mapping[str, Any], prepared: Any) -> Any:
        """The digest of the tensors as sent (`_wire_dtype`), as a server holding each in its dtype would."""
        return tensor_digests(weights, wire=self._wire_dtype, served=tuple(dict.fromkeys((self.dtype, "float32"))))

    def _wire_dtype(self, tensor: Any):
        import torch

        return getattr(torch, self.dtype) if tensor.dim() > 1 else torch.float32

    def _wire_tensor(self, tensor: Any):
        """`tensor` as it goes to the server: on this GPU, in its wire dtype, contiguous."""
        return tensor.detach().to(device="cuda", dtype=self._wire_dtype(tensor)).contiguous()

    async def _load(self, control: ServerControl, prepared: Mapping[str, Any], *, version: int) -> None:
        if self.kernel_format:
            sent = (await self._kernel_layout(control, prepared)).tensors(prepared, wire_dtype=self._wire_dtype)
        else:
            sent = prepared
        await control._post("/start_weight_update", what="start_weight_update",
                            json={"is_checkpoint_format": not self.kernel_format})
        await self._send_tensors(control, sent)
        await control._post("/finish_weight_update", what="finish_weight_update",
                            json={"weight_version": str(version)})

    async def _kernel_layout(self, control: ServerControl, weights: Mapping[str, Any]) -> Any:
        """The server's kernel layout for these tensor names (made once per server from its parameters)."""
        from agentrl.inference.kernel_format import kernel_layout

        if control.url not in self._layouts:
            workers = await control.worker_call("agentrl_weight_digest")
            if len(workers) != 1:
                raise WeightUpdateError(f"kernel-format weights: {control.url} runs {len(workers)} workers, whose "
                                        "parameters are shards; use the checkpoint format (inference.weight_format)")
            self._layouts[control.url] = kernel_layout(list(weights), workers[0])
        return self._layouts[control.url]

    async def arestore(self, url: str) -> bool:
        if self.version is None:
            return False
        raise WeightUpdateError(
            f"restore {url}: the weights live in the trainer's GPU memory; the trainer re-sends them (`resend`)"
        )

    @abstractmethod
    async def _init_engine(self, control: ServerControl) -> None:
        """Initialise one server's transfer engine."""

    @abstractmethod
    async def _send_tensors(self, control: ServerControl, weights: Mapping[str, Any]) -> None:
        """The `/update_weights` calls of one update (between start and finish)."""


_ITEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def wire_bytes(tensor: Any, *, dtype: str) -> int:
    """The bytes `tensor` takes on the wire of a direct transport serving `dtype` (`_wire_tensor`: matrices
    in `dtype`, vectors in float32)."""
    return _wire_bytes(tensor.numel(), tensor.dim(), dtype=dtype)


def _wire_bytes(numel: int, dims: int, *, dtype: str) -> int:
    return numel * _ITEM_BYTES[dtype if dims > 1 else "float32"]


def _in_thread(function: Callable[[], Any]) -> asyncio.Future:
    """Run `function` in a daemon thread; a future of its result on the running loop.

    Not the loop's executor: a thread stuck in an NCCL call whose peer never came must not hold
    up the loop's shutdown (`asyncio.run` joins its executor).
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def target() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (function(), None)
        except BaseException as error:  # handed to the awaiting loop
            outcome = (None, error)
        with contextlib.suppress(RuntimeError):  # the loop closed after the caller gave up
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=target, name="agentrl-nccl", daemon=True).start()
    return future


async def _alongside(request: Awaitable[Any], blocking: Callable[[], Any]) -> Any:
    """`blocking()` (the trainer's end of NCCL calls) in a thread while `request` (the server's end) runs.

    Both sides meet inside the same NCCL calls, so neither completes alone. Returns `blocking`'s
    result once both completed; whichever fails first raises at once (its peer never arrives, so
    waiting for the other side would hang).
    """
    call = asyncio.ensure_future(request)
    work = _in_thread(blocking)
    pending = {call, work}
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task.exception() is not None:
                call.cancel()
                raise task.exception()
    return work.result()


class NcclWeightPublisher(_DirectWeightPublisher):
    """GPU transport: vLLM's NCCL weight-transfer engine, the trainer broadcasting as rank 0 to the workers.

    The servers run with `--weight-transfer-config '{"backend": "nccl"}'` (the GPU plans set it).
    `connect()` forms one NCCL group per server: `/init_weight_transfer_engine` (master address
    and port, workers from rank 1 of `1 + workers_per_server`) while the trainer's end joins
    (`vllm_compat.nccl_trainer_group`). Each update's `/update_weights` carries the tensors'
    names, wire dtypes and shapes, in the order the trainer then broadcasts them, packed into
    `buffer_bytes` buffers (`packed`, vLLM's packed producer) or one by one. The server's
    vLLM version picks where the packing settings go (`vllm_compat.nccl_init_info`,
    `nccl_update_info`: 0.24 per update, 0.32 at init); the same calls otherwise.
    A restarted server joins a new group on a fresh port (`_reconnect`).
    """

    def __init__(self, urls: list[str], *, master_address: str, master_port: int, workers_per_server: int,
                 dtype: str = "bfloat16", packed: bool = True, buffer_bytes: int = 1 << 30, num_buffers: int = 2,
                 timeout_s: float = 600.0, recompute_kv: bool = False, verify: bool = True) -> None:
        super().__init__(urls, dtype=dtype, timeout_s=timeout_s, recompute_kv=recompute_kv, verify=verify)
        self.master_address = master_address
        self.master_port = master_port
        self.workers_per_server = workers_per_server
        self.packed = packed
        self.buffer_bytes = buffer_bytes
        self.num_buffers = num_buffers
        self._groups: dict[str, Any] = {}  # url -> the trainer's PyNcclCommunicator with that server

    @property
    def _packing(self) -> dict[str, Any]:
        return {"packed": self.packed, "buffer_bytes": self.buffer_bytes, "num_buffers": self.num_buffers}

    async def _init_engine(self, control: ServerControl) -> None:
        # The first group of a server uses its own port; a restarted server's, a fresh one (the old died with it).
        fresh = control.url in self._groups
        port = free_port(self.master_address) if fresh else self.master_port + self.urls.index(control.url)
        world_size = 1 + self.workers_per_server
        info = self.init_info(await self._server_version(control), port=port)

        def join():
            import torch

            with torch.cuda.device(self._device):
                return nccl_trainer_group(master_address=self.master_address, master_port=port,
                                          world_size=world_size)

        self._groups.pop(control.url, None)
        self._groups[control.url] = await _alongside(
            control._post("/init_weight_transfer_engine", what="init_weight_transfer_engine",
                          json={"init_info": info}), join)

    def init_info(self, server_version: str | None, *, port: int) -> dict[str, Any]:
        """The `init_info` a server of `server_version` gets for a group on `port`."""
        return nccl_init_info(server_version, master_address=self.master_address, master_port=port,
                              world_size=1 + self.workers_per_server, **self._packing)

    def update_info(self, server_version: str | None, weights: Mapping[str, Any]) -> dict[str, Any]:
        """The `update_info` of one update of `weights` (names, wire dtypes, shapes, in broadcast order)."""
        return nccl_update_info(
            server_version, names=list(weights),
            dtype_names=[str(self._wire_dtype(tensor)).split(".")[-1] for tensor in weights.values()],
            shapes=[list(tensor.shape) for tensor in weights.values()], **self._packing)

    async def _send_tensors(self, control: ServerControl, weights: Mapping[str, Any]) -> None:
        import torch

        info = self.update_info(await self._server_version(control), weights)
        group = self._groups[control.url]
        torch.cuda.synchronize(self._device)  # the trainer's step wrote the tensors on its own stream
        await _alongside(control._post("/update_weights", what="update_weights", json={"update_info": info}),
                         lambda: self._broadcast(group, weights))

    def _broadcast(self, group: Any, weights: Mapping[str, Any]) -> None:
        """Broadcast `weights` in order from rank 0 (the worker reads them in the `update_info`'s order)."""
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        with torch.cuda.device(self._device):
            pairs = ((name, self._wire_tensor(tensor)) for name, tensor in weights.items())
            if self.packed:
                packed_nccl_broadcast_producer(iterator=pairs, group=group, src=0, post_iter_func=lambda item: item[1],
                                               buffer_size_bytes=self.buffer_bytes, num_buffers=self.num_buffers)
            else:
                stream = torch.cuda.current_stream()
                for _name, tensor in pairs:
                    group.broadcast(tensor, src=0, stream=stream)
            torch.cuda.synchronize()  # every broadcast landed before the server is resumed


class IpcWeightPublisher(_DirectWeightPublisher):
    """GPU transport for a trainer on the same GPU as the server: CUDA IPC into vLLM's `ipc` engine.

    The server runs with `--weight-transfer-config '{"backend": "ipc"}'` and
    `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (the plans set both). An update sends the state dict in
    chunks of at most `chunk_bytes` of wire tensors (`_wire_tensor`), one `/update_weights` each,
    with the CUDA IPC handles pickled (torch's `reduce_tensor`, keyed by the GPU's UUID); the
    server copies the tensors into its own weights before it answers, so the next chunk may reuse
    the memory. `packed` (the default) copies a chunk's tensors into one buffer (made and shared once
    for all updates, `ipc_buffer.PackedIpcBuffer`, at least as large as the largest tensor) and sends
    that one handle and each tensor's size; unpacked sends one handle per tensor, and both ends then
    pay for an IPC handle, event and ref-counter per tensor (and the server's process keeps every
    shared copy allocated in the trainer: unpacked is for measurements, not for long runs). On the
    H200 that is about 40 us a tensor:
    glm-air-deep's 17,925 tensors update in 6.1 s packed against 6.8 s unpacked, the rest being
    vLLM's loading of checkpoint-format (per-expert) names (`bench/gpu_loop.py`). The server's
    version picks where `packed` goes (`vllm_compat.ipc_init_info` / `ipc_update_info`: 0.24 per
    update, 0.32 at init). Packed, the trainer holds one chunk of extra GPU memory for the run.
    """

    _needs_cuda = ("needs the server's GPU in this process; use FilesystemWeightPublisher when trainer and"
                   " server do not share a GPU")

    def __init__(self, urls: list[str], *, dtype: str = "bfloat16", packed: bool = True,
                 chunk_bytes: int = 1 << 30, timeout_s: float = 600.0, recompute_kv: bool = False,
                 verify: bool = True, kernel_format: bool = False) -> None:
        super().__init__(urls, dtype=dtype, timeout_s=timeout_s, recompute_kv=recompute_kv, verify=verify,
                         kernel_format=kernel_format)
        self.packed = packed
        self.chunk_bytes = chunk_bytes
        self._buffer = None  # the packed IPC buffer (`ipc_buffer.PackedIpcBuffer`), made at the first update
        # One buffer for every server: a server's chunks go through it only while no other server's do
        # (two servers on the trainer's GPU, e.g. a P/D pair, are updated concurrently by `_update_all`).
        self._buffer_turns: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    async def _init_engine(self, control: ServerControl) -> None:
        info = self.init_info(await self._server_version(control))
        await control._post("/init_weight_transfer_engine", what="init_weight_transfer_engine",
                            json={"init_info": info})

    def init_info(self, server_version: str | None) -> dict[str, Any]:
        """The `init_info` a server of `server_version` gets (0.32: whether updates come packed; 0.24: {})."""
        return ipc_init_info(server_version, packed=self.packed)

    def update_info(self, server_version: str | None, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The `update_info` of one chunk: `fields` has its names, dtype names, shapes and handles (a
        packed buffer's one handle with `tensor_sizes`, or a list of one per tensor), pickled for HTTP."""
        import base64
        import pickle

        return ipc_update_info(server_version, names=list(fields["names"]),
                               dtype_names=list(fields["dtype_names"]),
                               shapes=[list(shape) for shape in fields["shapes"]],
                               handles_pickled=base64.b64encode(pickle.dumps(fields["handles"])).decode(),
                               tensor_sizes=fields.get("tensor_sizes"))

    def buffer_bytes(self, weights: Mapping[str, Any]) -> int:
        """The packed buffer's size: `chunk_bytes`, or the largest wire tensor's bytes when that is larger."""
        from agentrl.inference.kernel_format import PackedTensors

        if isinstance(weights, PackedTensors):  # sized without packing every tensor first
            return max([self.chunk_bytes, *(_wire_bytes(numel, dims, dtype=self.dtype)
                                            for numel, dims in weights.numel_and_dims())])
        return max([self.chunk_bytes, *(wire_bytes(tensor, dtype=self.dtype) for tensor in weights.values())])

    def _chunks(self, weights: Mapping[str, Any]):
        """Unpacked: the state dict in lists of (name, tensor) of at most `chunk_bytes` (or one tensor)."""
        chunk: list[tuple[str, Any]] = []
        size = 0
        for name, tensor in weights.items():
            nbytes = wire_bytes(tensor, dtype=self.dtype)
            if chunk and size + nbytes > self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append((name, tensor))
            size += nbytes
        if chunk:
            yield chunk

    def _payload(self, chunk: list[tuple[str, Any]]) -> tuple[dict[str, Any], list[Any]]:
        """Unpacked: one chunk's update fields (a handle per tensor) and the wire copies to keep alive."""
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        names, dtype_names, shapes, handles, keep = [], [], [], [], []
        for name, tensor in chunk:
            copy = self._wire_tensor(tensor)
            keep.append(copy)  # reduce_tensor's handle does not keep the storage alive
            uuid = str(torch.cuda.get_device_properties(copy.device).uuid)
            names.append(name)
            dtype_names.append(str(copy.dtype).split(".")[-1])
            shapes.append(list(copy.shape))
            handles.append({uuid: reduce_tensor(copy)[1]})
        return {"names": names, "dtype_names": dtype_names, "shapes": shapes, "handles": handles}, keep

    def _packed_chunks(self, weights: Mapping[str, Any]):
        """Packed: the update fields of each buffer-full (one handle, the sizes).

        One buffer for the publisher's lifetime (`ipc_buffer.PackedIpcBuffer`: made and shared once; a new
        buffer per update, as vLLM's `packed_ipc_producer` makes, stays allocated in the trainer for good).
        The next chunk is copied in only when the caller asks for it, after the server answered."""
        import torch

        if self._buffer is None:
            self._buffer = PackedIpcBuffer(device=torch.device("cuda", self._device))
        uuid = str(torch.cuda.get_device_properties(self._device).uuid)
        wire = ((name, self._wire_tensor(tensor)) for name, tensor in weights.items())
        for chunk in self._buffer.fill(wire, size=self.buffer_bytes(weights)):
            yield {"names": chunk.names, "dtype_names": chunk.dtype_names, "shapes": chunk.shapes,
                   "handles": {uuid: self._buffer.handle()}, "tensor_sizes": chunk.tensor_sizes}

    def _packed_turn(self) -> asyncio.Lock:
        """The lock a server's packed send holds: the next chunk overwrites the buffer, so no other server may
        still be reading it (the servers of one update take turns). One per event loop: each publish may run
        in its own, and a lock waits only in the loop it was first used in."""
        loop = asyncio.get_running_loop()
        if self._buffer_turns is None or self._buffer_turns[0] is not loop:
            self._buffer_turns = (loop, asyncio.Lock())
        return self._buffer_turns[1]

    async def _post_chunk(self, control: ServerControl, version: str | None,
                          fields: Mapping[str, Any]) -> None:
        await control._post("/update_weights", what="update_weights",
                            json={"update_info": self.update_info(version, fields)})

    async def _send_tensors(self, control: ServerControl, weights: Mapping[str, Any]) -> None:
        import torch

        version = await self._server_version(control)
        with torch.cuda.device(self._device):
            if self.packed:
                torch.cuda.synchronize()  # the trainer's step wrote the tensors on its own stream
                async with self._packed_turn():
                    for fields in self._packed_chunks(weights):  # the producer synchronised before yielding
                        await self._post_chunk(control, version, fields)
            else:
                for chunk in self._chunks(weights):
                    fields, keep = self._payload(chunk)
                    torch.cuda.synchronize()  # the copies are complete before the server maps them
                    await self._post_chunk(control, version, fields)
                    del keep
            torch.cuda.ipc_collect()
