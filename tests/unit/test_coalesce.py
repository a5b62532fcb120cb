"""`RequestCoalescer`: concurrent identical calls share one send(n); everything else keeps its own."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.clients.coalesce import RequestCoalescer


class Recorder:
    """A `send` that records each n (and first seed) and answers [f"{request}:{i}" for i in range(n)]."""

    def __init__(self, *, fail: Exception | None = None, delay_s: float = 0.0) -> None:
        self.sizes: list[int] = []
        self.seeds: list[int | None] = []
        self.fail = fail
        self.delay_s = delay_s

    async def __call__(self, n: int, first_seed: int | None) -> list[str]:
        self.sizes.append(n)
        self.seeds.append(first_seed)
        request = len(self.sizes)
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return [f"{request}:{index}" for index in range(n)]


async def test_concurrent_identical_calls_share_one_request_in_order():
    coalescer, send = RequestCoalescer(), Recorder()
    results = await asyncio.gather(*(coalescer.submit("prompt", send) for _ in range(8)))
    assert send.sizes == [8]
    assert results == [f"1:{index}" for index in range(8)]
    assert (coalescer.calls, coalescer.requests) == (8, 1)


async def test_different_keys_and_later_calls_get_requests_of_their_own():
    coalescer, send = RequestCoalescer(), Recorder()
    first = await asyncio.gather(coalescer.submit("a", send), coalescer.submit("b", send), coalescer.submit("a", send))
    later = await coalescer.submit("a", send)  # after the flush: a new request
    assert sorted(send.sizes) == [1, 1, 2] and later == "3:0"
    assert first[0] != first[2] and first[0].split(":")[0] == first[2].split(":")[0]


async def test_batches_are_capped_at_max_batch():
    coalescer, send = RequestCoalescer(max_batch=3), Recorder()
    results = await asyncio.gather(*(coalescer.submit("k", send) for _ in range(7)))
    assert send.sizes == [3, 3, 1] and len(set(results)) == 7


async def test_an_error_reaches_every_caller_of_the_request():
    coalescer, send = RequestCoalescer(), Recorder(fail=ConnectionError("server gone"))
    results = await asyncio.gather(*(coalescer.submit("k", send) for _ in range(4)), return_exceptions=True)
    assert send.sizes == [4]
    assert all(isinstance(result, ConnectionError) and str(result) == "server gone" for result in results)


async def test_a_short_answer_fails_the_callers():
    coalescer = RequestCoalescer()

    async def short(n: int, first_seed: int | None) -> list[str]:
        return ["only one"]

    results = await asyncio.gather(*(coalescer.submit("k", short) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(result, RuntimeError) and "asked for 3 choices" in str(result) for result in results)


async def test_a_call_cancelled_before_the_flush_is_left_out():
    coalescer, send = RequestCoalescer(), Recorder()
    kept = [asyncio.ensure_future(coalescer.submit("k", send)) for _ in range(3)]
    dropped = asyncio.ensure_future(coalescer.submit("k", send))
    await asyncio.sleep(0)  # every call joined; the flush is queued behind them
    dropped.cancel()
    assert await asyncio.gather(*kept) == ["1:0", "1:1", "1:2"]
    assert send.sizes == [3] and dropped.cancelled()


async def test_aclose_cancels_requests_in_flight():
    coalescer, send = RequestCoalescer(), Recorder(delay_s=30)
    calls = [asyncio.ensure_future(coalescer.submit("k", send)) for _ in range(2)]
    await asyncio.sleep(0.05)
    await asyncio.wait_for(coalescer.aclose(), timeout=5)
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(result, asyncio.CancelledError) for result in results)


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        RequestCoalescer(max_batch=0)


async def test_seeded_calls_share_a_request_per_run_of_consecutive_seeds():
    """vLLM seeds choice i of a request seeded s with s + i: each call gets the choice of its own seed."""
    coalescer = RequestCoalescer()

    async def send(n: int, first_seed: int | None) -> list[str]:
        return [f"seed {first_seed + index}" for index in range(n)]

    seeds = [12, 10, 11, 20, 21, 11, 30]  # 10-12 and 20-21 run on; the second 11 and 30 do not
    results = await asyncio.gather(*(coalescer.submit("k", send, seed=seed) for seed in seeds))
    assert results == [f"seed {seed}" for seed in seeds]
    assert (coalescer.calls, coalescer.requests) == (7, 4)


async def test_seeded_runs_are_sent_with_their_first_seed():
    coalescer, send = RequestCoalescer(), Recorder()
    await asyncio.gather(*(coalescer.submit("k", send, seed=100 + member) for member in range(4)))
    await asyncio.gather(coalescer.submit("k", send, seed=5), coalescer.submit("k", send, seed=5))
    assert list(zip(send.sizes, send.seeds)) == [(4, 100), (1, 5), (1, 5)]
    unseeded = Recorder()
    await asyncio.gather(*(coalescer.submit("u", unseeded) for _ in range(3)))
    assert list(zip(unseeded.sizes, unseeded.seeds)) == [(3, None)]
