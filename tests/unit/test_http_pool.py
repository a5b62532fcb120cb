"""ShardedAsyncClient against a real HTTP server on 127.0.0.1: spreading, limits, hooks."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import pytest

from agentrl.clients.http_pool import KEEPALIVE_EXPIRY_S, ShardedAsyncClient
from tests.http_thread import serving


class _Recorder(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak_in_flight = 0
        self.client_ports: set[int] = set()
        self.session_headers: list[str | None] = []


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so connections are reused

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        server: _Recorder = self.server  # type: ignore[assignment]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.in_flight += 1
            server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
            server.client_ports.add(self.client_address[1])
            server.session_headers.append(self.headers.get("X-Session-ID"))
        time.sleep(0.1)
        with server.lock:
            server.in_flight -= 1
        payload = json.dumps({"echo": body["value"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def recorder():
    with serving(_Recorder()) as server:
        yield server


async def test_requests_spread_over_shards_within_the_connection_limit(recorder):
    client = ShardedAsyncClient(base_url=f"http://127.0.0.1:{recorder.server_port}", timeout=30,
                                max_connections=12, connections_per_shard=4)
    assert len(client.shards) == 3 and client.max_connections == 12
    try:
        answers = await asyncio.gather(*(client.post("/echo", json={"value": i}) for i in range(48)))
    finally:
        await client.aclose()
    assert [a.json()["echo"] for a in answers] == list(range(48))
    # More than one shard's pool carried requests at once, and never more than the limit.
    assert 4 < recorder.peak_in_flight <= 12
    assert 4 < len(recorder.client_ports) <= 12  # keep-alive connections were reused, not reopened


async def test_event_hooks_set_on_the_client_reach_every_shard(recorder):
    client = ShardedAsyncClient(base_url=f"http://127.0.0.1:{recorder.server_port}", timeout=30,
                                max_connections=6, connections_per_shard=2)

    async def tag(request) -> None:
        request.headers["X-Session-ID"] = "s1"

    client.event_hooks = {**client.event_hooks, "request": [tag]}
    try:
        await asyncio.gather(*(client.post("/echo", json={"value": i}) for i in range(12)))
    finally:
        await client.aclose()
    assert recorder.session_headers == ["s1"] * 12
    assert all(shard.event_hooks["request"] == [tag] for shard in client.shards)


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_connections"):
        ShardedAsyncClient(base_url="http://127.0.0.1:1", timeout=1, max_connections=0)


async def test_an_idle_connection_is_dropped_after_the_keepalive_expiry(recorder):
    """A connection idle past the expiry is not reused (a new client port), one idle less is."""
    client = ShardedAsyncClient(base_url=f"http://127.0.0.1:{recorder.server_port}", timeout=30,
                                max_connections=1, keepalive_expiry_s=0.3)
    try:
        await client.post("/echo", json={"value": 0})
        await client.post("/echo", json={"value": 1})  # at once: the same connection
        assert len(recorder.client_ports) == 1
        await asyncio.sleep(0.6)
        await client.post("/echo", json={"value": 2})
    finally:
        await client.aclose()
    assert len(recorder.client_ports) == 2


def test_the_default_keepalive_expiry_is_below_vllms_keep_alive():
    """vLLM's uvicorn closes idle connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default 5 s); the
    client must drop them first, or a request can race the server's close (ReadError)."""
    envs = pytest.importorskip("vllm.envs")
    import os

    saved = os.environ.pop("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", None)
    try:
        assert KEEPALIVE_EXPIRY_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    finally:
        if saved is not None:
            os.environ["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = saved
