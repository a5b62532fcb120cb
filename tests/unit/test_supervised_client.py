"""Which failed inference calls `SupervisedClient` retries: only those a server restart can fix.

The wrapped client and the supervisor are stand-ins (what a restart does is covered with real
servers in tests/integration/test_supervisor.py and tests/unit/test_replica_recovery.py): a
connection error and an HTTP 5xx are retried after the server is healthy again; an HTTP 4xx
refusal is raised at once, so a run whose every request is refused fails in seconds, not
after minutes of retries.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agentrl.clients.token_client import InferenceError
from agentrl.inference.supervisor import SupervisedClient


class Watch:
    url = "http://127.0.0.1:9"
    health_interval_s = 0.0
    failed = None

    def __init__(self) -> None:
        self.waited = 0

    def wait_healthy(self, timeout_s: float) -> bool:
        self.waited += 1
        return True


class Flaky:
    """Fails `failures` times with `error`, then answers."""

    def __init__(self, error: Exception, failures: int) -> None:
        self.error, self.failures, self.calls = error, failures, 0

    async def generate(self, prompt_ids, *, sampling):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "answer"


@pytest.mark.parametrize("error", [
    InferenceError("http://x/inference/v1/generate: ConnectError: refused"),
    InferenceError("http://x/inference/v1/generate answered 503: no healthy worker", status=503),
    httpx.ConnectError("refused"),
])
def test_failures_a_restart_fixes_are_retried(error):
    inner, watch = Flaky(error, failures=2), Watch()
    client = SupervisedClient(inner, watch, max_retries=5)
    assert asyncio.run(client.generate([1], sampling=None)) == "answer"
    assert (inner.calls, watch.waited, client.retried) == (3, 2, 2)


def test_a_refusal_is_raised_at_once():
    inner, watch = Flaky(InferenceError("answered 400: bad sampling params", status=400), failures=10), Watch()
    client = SupervisedClient(inner, watch, max_retries=50)
    with pytest.raises(InferenceError, match="answered 400"):
        asyncio.run(client.generate([1], sampling=None))
    assert (inner.calls, watch.waited) == (1, 0)
