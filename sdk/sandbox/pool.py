"""A warm pool of pre-started sandboxes for one sandbox config (one image).

A rollout takes a started sandbox from the pool instead of waiting for a container start;
the pool refills itself in the background. A sandbox is never handed to a second task:
`release` destroys it (the only "reset" there is), and the pool starts a fresh one.

    async with SandboxPool(config, size=8) as pool:
        async with pool.sandbox() as sb:
            await sb.exec("pytest -q")
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from agentrl.sandbox.base import Sandbox, SandboxConfig, SandboxError
from agentrl.sandbox.factory import create_sandbox

__all__ = ["SandboxPool"]


class SandboxPool:
    """Keeps `size` started sandboxes of one config ready; `acquire` hands one out."""

    def __init__(self, config: SandboxConfig, *, size: int = 4, max_parallel_starts: int = 4) -> None:
        if size < 0:
            raise SandboxError(f"SandboxPool size={size}: must be >= 0")
        if max_parallel_starts < 1:
            raise SandboxError(f"SandboxPool max_parallel_starts={max_parallel_starts}: must be >= 1")
        self.config = config
        self.size = size
        self._ready: asyncio.Queue[Sandbox] = asyncio.Queue()
        self._starting = 0
        self._start_slots = asyncio.Semaphore(max_parallel_starts)
        self._tasks: set[asyncio.Task] = set()
        self._handed_out: set[Sandbox] = set()
        self._closed = False
        self.start_failures = 0
        self.last_error: BaseException | None = None

    async def __aenter__(self) -> SandboxPool:
        await self.fill()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    @property
    def ready(self) -> int:
        """Started sandboxes waiting to be handed out."""
        return self._ready.qsize()

    async def _new_sandbox(self) -> Sandbox:
        async with self._start_slots:
            return await create_sandbox(self.config).start()

    async def _start_one(self) -> None:
        try:
            sandbox = await self._new_sandbox()
        except Exception as error:  # keep serving; acquire() starts one itself and surfaces errors
            self.start_failures += 1
            self.last_error = error
            return
        finally:
            self._starting -= 1
        if self._closed:
            await sandbox.close()
        else:
            self._ready.put_nowait(sandbox)

    def _refill(self) -> None:
        if self._closed:
            return
        while self._ready.qsize() + self._starting < self.size:
            self._starting += 1
            task = asyncio.create_task(self._start_one())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def fill(self) -> None:
        """Start sandboxes until `size` are ready (waits for them); raises if none can start."""
        self._refill()
        while self._tasks:
            await asyncio.gather(*list(self._tasks))
        if self.size and self._ready.qsize() == 0 and self.last_error is not None:
            raise self.last_error

    async def acquire(self) -> Sandbox:
        """A started sandbox for one task: a warm one when ready, else one started now."""
        if self._closed:
            raise SandboxError("SandboxPool is closed")
        try:
            sandbox = self._ready.get_nowait()
        except asyncio.QueueEmpty:
            sandbox = await self._new_sandbox()
        self._refill()
        self._handed_out.add(sandbox)
        return sandbox

    async def release(self, sandbox: Sandbox) -> None:
        """Destroy a sandbox handed out by `acquire` (sandboxes are never reused across tasks)."""
        self._handed_out.discard(sandbox)
        await sandbox.close()

    @contextlib.asynccontextmanager
    async def sandbox(self) -> AsyncIterator[Sandbox]:
        """`async with pool.sandbox() as sb:` acquire, then always destroy."""
        sandbox = await self.acquire()
        try:
            yield sandbox
        finally:
            await self.release(sandbox)

    async def close(self) -> None:
        """Destroy every sandbox the pool holds or handed out, and stop refilling."""
        self._closed = True
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        doomed: list[Sandbox] = list(self._handed_out)
        self._handed_out.clear()
        while not self._ready.empty():
            doomed.append(self._ready.get_nowait())
        await asyncio.gather(*(sandbox.close() for sandbox in doomed), return_exceptions=True)
