"""Keep vLLM servers alive, and never lose a request when one dies.

- `ServerSupervisor` watches one `VLLMServer`: a background thread polls the process and
  `/health`; when the process exits or `failure_threshold` health checks in a row fail,
  it restarts the server on the same port (at most `max_restarts` times; after that the
  supervisor is `failed` and says why), then runs `after_restart(url)` (pass a weight
  publisher's `restore`, so the restarted server serves the latest published weights and
  version, not the original checkpoint) before requests go through again. Every death and
  restart is recorded in `events`; `went_down()` tells a caller whose call just failed
  whether the server died (even before the next poll has seen it) or the call failed itself.
- `SupervisedClient` wraps a `ChatClient` (the token client): a call that fails because
  the server died or failed on its side (connection error, HTTP 5xx; a 4xx refusal is raised
  at once) waits for the supervisor to bring it back and retries (a completion is
  only ever returned whole, so a retry cannot duplicate tokens); when retries run out, or
  the supervisor gave up, it raises `InferenceError`, which environments record as a
  failed rollout (`Rollout.error`). A request is never silently dropped.
- `EndpointWatch` is the supervisor as seen from another process (a rollout worker on
  another Ray node): it polls the endpoint's `/health`, so `SupervisedClient` can wait out a
  restart that a supervisor elsewhere (or behind a router) is doing.
- `preflight(plan)` gives one-line errors before anything starts: vLLM not installed, or a
  plan that needs more GPUs on a node than this machine has.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from agentrl.errors import AgentrlError, MissingExtraError

__all__ = ["EndpointWatch", "InsufficientGpusError", "ServerSupervisor", "SupervisedClient", "SupervisorEvent",
           "preflight", "visible_gpus"]


class InsufficientGpusError(AgentrlError):
    """A plan needs more GPUs than this machine has."""


@dataclass
class SupervisorEvent:
    """One thing the supervisor saw or did."""

    time: float
    """`time.monotonic()` when it happened."""
    kind: str
    """'started', 'died', 'unhealthy', 'restarted', 'restart_failed' or 'gave_up'."""
    detail: str = ""
    """Exit status, error text, or how long the restart took."""


def module_installed(module: str) -> bool:
    """Whether `module` can be imported here (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def visible_gpus() -> int:
    """CUDA GPUs this process can use (0 without torch/CUDA)."""
    if not module_installed("torch"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def preflight(plan, *, node: int = 0) -> None:
    """Raise a one-line error when `node`'s processes of a `DeploymentPlan` cannot run here."""
    servers = [process for process in plan.servers if process.node == node]
    if servers and not module_installed("vllm"):
        raise MissingExtraError("vllm", "vllm" if any(process.gpus for process in servers) else "cpu")
    needed = max((max(process.gpus) + 1 for process in servers if process.gpus), default=0)
    if needed:
        have = visible_gpus()
        if have < needed:
            raise InsufficientGpusError(
                f"the {plan.kind} plan for {plan.model} needs {needed} GPUs on node {node}, this machine has {have};"
                " use a smaller plan (fewer gpus_per_node or tensor_parallel_size) or device='cpu'"
            )


class ServerSupervisor:
    """Restart a `VLLMServer` when it dies; `healthy` / `wait_healthy` tell clients when to retry."""

    def __init__(
        self,
        server,
        *,
        health_interval_s: float = 1.0,
        failure_threshold: int = 3,
        max_restarts: int = 3,
        on_event: Callable[[SupervisorEvent], None] | None = None,
        after_restart: Callable[[str], Any] | None = None,
    ) -> None:
        self.server = server
        self.after_restart = after_restart
        self.health_interval_s = health_interval_s
        self.failure_threshold = failure_threshold
        self.max_restarts = max_restarts
        self.on_event = on_event
        self.events: list[SupervisorEvent] = []
        self.restarts = 0
        self.failed: str | None = None
        self._healthy = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def healthy(self) -> bool:
        return self._healthy.is_set()

    def _record(self, kind: str, detail: str = "") -> None:
        event = SupervisorEvent(time.monotonic(), kind, detail)
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def start(self) -> ServerSupervisor:
        """Start the server (blocking until healthy) and the watch thread."""
        self.server.start()
        self._record("started", self.server.url)
        self._healthy.set()
        self._thread = threading.Thread(target=self._watch, name=f"supervisor-{self.server.port}", daemon=True)
        self._thread.start()
        return self

    def _check(self, client: httpx.Client) -> str | None:
        """None when healthy, else why not."""
        process = self.server.process
        if process is None or process.poll() is not None:
            return f"process exited with status {None if process is None else process.returncode}"
        try:
            response = client.get(f"{self.server.url}/health")
            return None if response.status_code == 200 else f"/health answered {response.status_code}"
        except httpx.HTTPError as error:
            return f"/health failed: {type(error).__name__}"

    def _watch(self) -> None:
        failures = 0
        with httpx.Client(timeout=max(2.0, self.health_interval_s)) as client:
            while not self._stopping.wait(self.health_interval_s):
                problem = self._check(client)
                if problem is None:
                    failures = 0
                    continue
                exited = problem.startswith("process exited")
                failures += 1
                if not exited and failures < self.failure_threshold:
                    continue
                self._healthy.clear()
                self._record("died" if exited else "unhealthy", problem)
                failures = 0
                if self._stopping.is_set():
                    return
                if self.restarts >= self.max_restarts:
                    self.failed = f"server {self.server.url} died {self.restarts + 1} times (last: {problem}); gave up"
                    self._record("gave_up", self.failed)
                    self.server.stop()
                    return
                self.restarts += 1
                started = time.monotonic()
                try:
                    self.server.stop()
                    self.server.start()
                except Exception as error:  # the next loop turn sees the dead process again
                    self._record("restart_failed", str(error).splitlines()[0][:300])
                    continue
                if self.after_restart is not None:
                    # e.g. `publisher.restore`: the latest weights go back in before any request does.
                    try:
                        self.after_restart(self.server.url)
                    except Exception as error:
                        self._record("restore_failed", str(error).splitlines()[0][:300])
                        self.server.stop()  # seen as dead on the next turn: restart again, no stale serving
                        continue
                self._record("restarted", f"in {time.monotonic() - started:.1f}s")
                self._healthy.set()

    def wait_healthy(self, timeout_s: float) -> bool:
        """Block until the server is healthy (True) or `timeout_s` passed / the supervisor gave up (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.failed:
                return False
            if self._healthy.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
                return True
        return self._healthy.is_set()

    def went_down(self, since: float, timeout_s: float | None = None) -> bool:
        """After a call to the server failed: did the server go down (True), or is the failure the call's own (False)?

        True when the watch saw the server die (or turn unhealthy) at or after `since` (a
        `time.monotonic()` value: when the failed call began), is restarting it now, or gave
        up. The watch polls every `health_interval_s`, so right after a `kill -9` it has not
        noticed yet: this waits up to `timeout_s` (default: long enough for the watch to mark a
        hung server unhealthy) before answering False.
        """
        wait = (self.failure_threshold + 1) * self.health_interval_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        while True:
            if self.failed or not self._healthy.is_set() or any(
                    event.time >= since and event.kind in ("died", "unhealthy") for event in list(self.events)):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def stop(self) -> None:
        """Stop watching, then stop the server."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._healthy.clear()
        self.server.stop()

    def __enter__(self) -> ServerSupervisor:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


class EndpointWatch:
    """What `SupervisedClient` needs of a supervisor, for an endpoint supervised in another process."""

    def __init__(self, url: str, *, health_interval_s: float = 2.0, also: list[str] = ()) -> None:
        self.url = url.rstrip("/")
        self.also = [other.rstrip("/") for other in also]
        """Servers every request also needs (a P/D pair's prefill server): healthy only when they all are."""
        self.health_interval_s = health_interval_s
        self.failed: str | None = None  # the remote supervisor says when it gives up; here only time runs out

    def wait_healthy(self, timeout_s: float) -> bool:
        """Poll `/health` of the endpoint (and of `also`) until all answer 200 (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                try:
                    if all(client.get(f"{url}/health").status_code == 200 for url in [self.url, *self.also]):
                        return True
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    return False
                time.sleep(min(self.health_interval_s, max(0.0, deadline - time.monotonic())))


class SupervisedClient:
    """A `ChatClient` that survives server restarts: retry after recovery, else a clear failure."""

    def __init__(
        self, client: Any, supervisor: ServerSupervisor, *, max_retries: int = 2, recovery_timeout_s: float = 300.0
    ) -> None:
        self.client = client
        self.supervisor = supervisor
        self.max_retries = max_retries
        self.recovery_timeout_s = recovery_timeout_s
        self.retried = 0
        self.failed = 0

    async def _call(self, name: str, *args: Any, **kwargs: Any):
        from agentrl.clients.token_client import InferenceError

        attempt = 0
        while True:
            try:
                return await getattr(self.client, name)(*args, **kwargs)
            except (InferenceError, httpx.HTTPError) as error:
                if isinstance(error, InferenceError) and not error.retryable:
                    raise  # the server refused the request (HTTP 4xx): a restart would not change that
                if self.supervisor.failed:
                    self.failed += 1
                    raise InferenceError(f"inference server lost: {self.supervisor.failed}") from error
                if attempt >= self.max_retries:
                    self.failed += 1
                    raise InferenceError(
                        f"inference request failed after {attempt + 1} attempts while {self.supervisor.url}"
                        f" was restarting: {str(error).splitlines()[0][:200]}"
                    ) from error
                attempt += 1
                self.retried += 1
                await asyncio.sleep(self.supervisor.health_interval_s)  # let the watcher notice the death
                recovered = await asyncio.to_thread(self.supervisor.wait_healthy, self.recovery_timeout_s)
                if not recovered:
                    self.failed += 1
                    reason = self.supervisor.failed or f"not healthy within {self.recovery_timeout_s:.0f}s"
                    raise InferenceError(f"inference server {self.supervisor.url} lost: {reason}") from error

    async def chat(self, messages, *, tools=None, sampling, previous=None):
        """`ChatClient.chat`, retried across server restarts."""
        return await self._call("chat", messages, tools=tools, sampling=sampling, previous=previous)

    async def generate(self, prompt_ids: list[int], *, sampling):
        """The token client's `generate`, retried across server restarts."""
        return await self._call("generate", prompt_ids, sampling=sampling)

    def __getattr__(self, name: str) -> Any:  # everything else of the wrapped client (renderer, model, ...)
        if name == "client":
            raise AttributeError(name)
        return getattr(self.client, name)
