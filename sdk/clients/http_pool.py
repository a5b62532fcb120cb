"""An httpx client for many concurrent requests to one server: several small connection pools.

httpcore's connection pool re-examines every connection each time a request starts or
ends (and, for each idle connection, counts the connections again), so its work per
request grows with the square of `max_connections`. At the concurrency of rollouts (64 to
hundreds of requests in flight to one vLLM server) that cost competes with the server for
the CPU on a small machine. `ShardedAsyncClient` keeps the same total connection limit
but spreads it over pools of at most `connections_per_shard`, sending each request
through the pool with the fewest requests in flight. The shards share one SSL context
(building one reads the CA bundle, about 25 ms) and one set of event hooks.

It offers the parts of `httpx.AsyncClient` the clients use: `request`, `get`, `post`,
`event_hooks` (settable, applied to every shard) and `aclose`.

Idle connections are dropped after `KEEPALIVE_EXPIRY_S`, below the 5 s after which vLLM's
uvicorn closes an idle keep-alive connection (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`): with httpx's
own default, also 5 s, a request can go out on a connection the server is closing at that
moment and fail with `ReadError`.
"""

from __future__ import annotations

import functools
import math
import ssl
from typing import Any

import httpx

__all__ = ["KEEPALIVE_EXPIRY_S", "ShardedAsyncClient", "shared_ssl_context", "vllm_limits"]

KEEPALIVE_EXPIRY_S = 3.0
"""Seconds an idle connection is kept: below vLLM's 5 s keep-alive (see the module docstring)."""


def vllm_limits(max_connections: int, *, keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S) -> httpx.Limits:
    """Connection limits for a client of a vLLM server: `max_connections`, all kept alive, each dropped when idle
    for `keepalive_expiry_s` (below the server's own 5 s; see the module docstring)."""
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                        keepalive_expiry=keepalive_expiry_s)


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    """One SSL context for every client of this process (building one reads the CA bundle, ~25 ms)."""
    return httpx.create_ssl_context()


class ShardedAsyncClient:
    """`httpx.AsyncClient`-like client over several connection pools to the same base URL."""

    def __init__(
        self,
        *,
        base_url: str,
        max_connections: int,
        timeout: httpx.Timeout | float,
        headers: dict[str, str] | None = None,
        connections_per_shard: int = 8,
        keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S,
    ) -> None:
        if max_connections < 1 or connections_per_shard < 1:
            raise ValueError("max_connections and connections_per_shard must be at least 1")
        shards = math.ceil(max_connections / connections_per_shard)
        per_shard = math.ceil(max_connections / shards)
        ssl_context = shared_ssl_context()
        self._shards = [
            httpx.AsyncClient(
                base_url=base_url, timeout=timeout, headers=headers, verify=ssl_context,
                limits=vllm_limits(per_shard, keepalive_expiry_s=keepalive_expiry_s),
            )
            for _ in range(shards)
        ]
        self._in_flight = [0] * shards
        self.max_connections = per_shard * shards

    @property
    def shards(self) -> list[httpx.AsyncClient]:
        """The underlying clients (one connection pool each)."""
        return list(self._shards)

    @property
    def event_hooks(self) -> dict[str, list[Any]]:
        return self._shards[0].event_hooks

    @event_hooks.setter
    def event_hooks(self, hooks: dict[str, list[Any]]) -> None:
        for shard in self._shards:
            shard.event_hooks = hooks

    async def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """Send through the least busy shard; the response body is read before returning."""
        index = min(range(len(self._shards)), key=self._in_flight.__getitem__)
        self._in_flight[index] += 1
        try:
            return await self._shards[index].request(method, url, **kwargs)
        finally:
            self._in_flight[index] -= 1

    async def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self.request("GET", url, **kwargs)

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self.request("POST", url, **kwargs)

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()
