"""Same-tick request coalescing: identical sampling calls become one request with `n` choices.

The rollouts of a group start together and send the same first prompt with the same
sampling parameters. vLLM samples `n` independent completions of one prompt in one request
(`sampling_params.n`): each choice is its own engine request, with its own tokens,
logprobs, routed experts and weight versions, so a group of eight costs the HTTP client, the
API server and its per-request work once instead of eight times.

`RequestCoalescer.submit(key, send, seed=...)` parks the call on a future; the first call for
a `key` schedules a flush with `loop.call_soon`, which runs after every call already queued
in this turn of the event loop. The flush calls `send(n, first_seed)` once for the `n` calls
that joined (at most `max_batch`), and hands choice `i` to call `i`. An error of that request
reaches every call that joined it; calls cancelled before the flush are left out of `n`.
Nothing waits for late joiners: a call that arrives after the flush starts a new request.

Seeded calls: vLLM gives choice `i` of a request seeded `s` the seed `s + i` (its
`ParentRequest` does, in 0.24 and 0.32), which is exactly the request seeded `s + i` alone.
So seeded calls of one key that joined a flush go out as one request per run of consecutive
seeds (`send(n, first_seed)`, choice `i` to the call seeded `first_seed + i`); a seed that is
not next in a run (a gap or a repeat) starts a run of its own. A group whose members are
seeded `seed + member`, as `agentrl.evaluate` and `Environment.run_group` seed them, costs
one request and gets the completions it would have got from one request each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestCoalescer"]


Send = Callable[[int, int | None], Awaitable[list[Any]]]
"""`send(n, first_seed)`: the `n` choices of one request (seeded `first_seed`, or unseeded when None)."""


@dataclass
class _Batch:
    send: Send
    waiters: list[tuple[asyncio.Future, int | None]] = field(default_factory=list)


class RequestCoalescer:
    """Merge concurrent identical calls into one `send(n)` (see the module docstring)."""

    def __init__(self, *, max_batch: int = 32) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch = max_batch
        self.calls = 0
        """Calls submitted so far."""
        self.requests = 0
        """Requests sent so far (`calls / requests` is the mean batch)."""
        self._open: dict[Hashable, _Batch] = {}
        self._in_flight: set[asyncio.Task] = set()

    async def submit(self, key: Hashable, send: Send, *, seed: int | None = None) -> Any:
        """This call's result: its element of the list `send(n, first_seed)` returns for the request it joined.

        The calls of one `key` are all seeded or all unseeded (the caller puts that in the key)."""
        loop = asyncio.get_running_loop()
        batch = self._open.get(key)
        if batch is None or len(batch.waiters) >= self.max_batch:
            batch = self._open[key] = _Batch(send)
            loop.call_soon(self._flush, key, batch)
        waiter = loop.create_future()
        batch.waiters.append((waiter, seed))
        self.calls += 1
        return await waiter

    def _flush(self, key: Hashable, batch: _Batch) -> None:
        if self._open.get(key) is batch:
            del self._open[key]
        joined = [(waiter, seed) for waiter, seed in batch.waiters if not waiter.done()]
        for run in _seed_runs(joined):
            self.requests += 1
            task = asyncio.get_running_loop().create_task(self._run(batch.send, run))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    @staticmethod
    async def _run(send: Send, run: list[tuple[asyncio.Future, int | None]]) -> None:
        waiters = [waiter for waiter, _ in run]
        try:
            results = await send(len(waiters), run[0][1])
            if len(results) != len(waiters):
                raise RuntimeError(f"asked for {len(waiters)} choices, the server answered {len(results)}")
        except BaseException as error:  # every caller of the batch sees the request's error
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            if isinstance(error, asyncio.CancelledError):
                raise
            return
        for waiter, result in zip(waiters, results):
            if not waiter.done():
                waiter.set_result(result)

    async def aclose(self) -> None:
        """Cancel requests still in flight (their callers get `CancelledError`)."""
        tasks = list(self._in_flight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _seed_runs(joined: list[tuple[asyncio.Future, int | None]]) -> list[list[tuple[asyncio.Future, int | None]]]:
    """The requests of one flush: all unseeded calls in one; seeded calls by runs of consecutive seeds."""
    if not joined:
        return []
    if joined[0][1] is None:
        return [joined]
    runs: list[list[tuple[asyncio.Future, int | None]]] = []
    for call in sorted(joined, key=lambda item: item[1]):
        if runs and call[1] == runs[-1][-1][1] + 1:
            runs[-1].append(call)
        else:
            runs.append([call])
    return runs
