"""Session affinity: every request of one trajectory carries its id, so a router keeps it on one replica.

vllm-router's ``consistent_hash`` policy (`agentrl.inference.router`) hashes the session key it
reads from the `SESSION_HEADER` header, so every turn of a trajectory lands on the same replica
and reuses its prefix cache. Clients send the trajectory id with `session_headers(trajectory_id)`,
or, without touching call sites, by attaching `attach_session_affinity` to the client's HTTP
client and running each rollout inside ``with trajectory_session(rollout_id):`` (a context
variable, so concurrent asyncio rollouts each send their own id); `current_trajectory` reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import httpx

__all__ = ["SESSION_HEADER", "attach_session_affinity", "current_trajectory", "session_headers",
           "trajectory_session"]

#: Header vllm-router's consistent_hash policy reads the session key from.
SESSION_HEADER = "X-Session-ID"


def session_headers(trajectory_id: str) -> dict[str, str]:
    """Headers that pin every request of one trajectory to one replica."""
    return {SESSION_HEADER: str(trajectory_id)}


_TRAJECTORY: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentrl_trajectory_id", default=None)


@contextlib.contextmanager
def trajectory_session(trajectory_id: str):
    """Inside this block (and the asyncio tasks it starts), requests carry `trajectory_id`."""
    token = _TRAJECTORY.set(str(trajectory_id))
    try:
        yield
    finally:
        _TRAJECTORY.reset(token)


def current_trajectory() -> str | None:
    """The id of the enclosing `trajectory_session`, or None outside one."""
    return _TRAJECTORY.get()


def attach_session_affinity(http: Any) -> Any:
    """Make `http` (an `httpx.AsyncClient`, or a client's `ShardedAsyncClient`) send the current
    `trajectory_session` id as `X-Session-ID` on every request."""

    async def add_session_header(request: httpx.Request) -> None:
        trajectory_id = _TRAJECTORY.get()
        if trajectory_id is not None and SESSION_HEADER not in request.headers:
            request.headers[SESSION_HEADER] = trajectory_id

    hooks = http.event_hooks
    http.event_hooks = {**hooks, "request": [*hooks.get("request", []), add_session_header]}
    return http
