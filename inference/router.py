"""Run `vllm-router` (the Rust router in the `vllm-router` wheel) in front of vLLM replicas.

The router balances requests over replicas (or prefill and decode instances in P/D
mode). agentrl runs it with `--policy consistent_hash`: the router hashes the request's
session key, read from the `X-Session-ID` header (it also accepts `session_params.session_id`
or `user` in the body), so every turn of a trajectory lands on the same replica and
reuses that replica's prefix cache; clients send the trajectory id as `agentrl.clients.session`
says. The router binds 127.0.0.1 unless told otherwise,
runs in its own process group and is stopped by process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.errors import AgentrlError

__all__ = ["VLLMRouter", "RouterError", "router_command"]

class RouterError(AgentrlError):
    """vllm-router failed to start or answer."""


def router_kv_connector(name: str) -> str:
    """vllm-router's `--kv-connector` for `inference.kv_connector` `name`: the router knows nixl, mooncake and
    moriio; its nixl flow suits vLLM's ExampleConnector ('example'), which finds the KV by the prompt's tokens and
    ignores the hand-off parameters the router passes on."""
    return "nixl" if name == "example" else name


def router_command(
    worker_urls: list[str],
    *,
    host: str = "127.0.0.1",
    port: int,
    policy: str = "consistent_hash",
    prefill_urls: list[str] | None = None,
    decode_urls: list[str] | None = None,
    kv_connector: str | None = None,
    metrics_port: int | None = None,
    program: list[str] | None = None,
    workers_healthy: bool = True,
    extra_args: list[str] | None = None,
) -> list[str]:
    """The `vllm-router` command line, the one way agentrl builds it. `metrics_port`: its Prometheus exporter's
    port, on `host` (vllm-router's default, 29000, is one port for every router of the machine: a second router
    there fails to start). `program`: what runs the router (default: this interpreter's `vllm_router` package; a
    deployment plan names the `vllm-router` script of the node that runs it). `workers_healthy`: the workers answer
    before the router starts, so it checks them every second for at most 120 s; a plan's router starts beside its
    servers and keeps vllm-router's own start-up wait."""
    argv = [*(program or [sys.executable, "-m", "vllm_router.launch_router"]),
            "--host", host, "--port", str(port), "--policy", policy]
    if metrics_port is not None:
        argv += ["--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    if prefill_urls or decode_urls:
        if not (prefill_urls and decode_urls):
            raise RouterError("router: P/D mode needs at least one prefill URL and one decode URL")
        argv += ["--vllm-pd-disaggregation"]
        if kv_connector:
            argv += ["--kv-connector", router_kv_connector(kv_connector)]
        for url in prefill_urls:
            argv += ["--prefill", url]
        for url in decode_urls:
            argv += ["--decode", url]
    else:
        if not worker_urls:
            raise RouterError("router: no worker URLs; pass the replicas' URLs")
        argv += ["--worker-urls", *worker_urls]
    if workers_healthy:  # check them quickly rather than every 30 s
        argv += ["--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "120"]
    return argv + list(extra_args or [])


class VLLMRouter:
    """A vllm-router process; context manager or start/stop."""

    def __init__(
        self,
        worker_urls: list[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = "consistent_hash",
        prefill_urls: list[str] | None = None,
        decode_urls: list[str] | None = None,
        kv_connector: str | None = None,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = 150.0,
    ) -> None:
        from agentrl.inference.server import free_port

        self.worker_urls = [url.rstrip("/") for url in worker_urls]
        self.host = host
        self.port = port or free_port(host)
        self.metrics_port = free_port(host)
        while self.metrics_port == self.port:  # both were free a moment ago: they must differ
            self.metrics_port = free_port(host)
        self.policy = policy
        self.command = router_command(
            self.worker_urls, host=host, port=self.port, policy=policy, prefill_urls=prefill_urls,
            decode_urls=decode_urls, kv_connector=kv_connector, metrics_port=self.metrics_port, extra_args=extra_args,
        )
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._log_handle = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> VLLMRouter:
        """Start the router and wait until it answers `/health` with its workers registered."""
        if self.process is not None:
            return self
        import importlib.util

        if importlib.util.find_spec("vllm_router") is None:
            raise RouterError("vllm-router is not installed; pip install vllm-router")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-router-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log_handle = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command, stdout=self._log_handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        from agentrl.inference.server import log_tail, wait_for_health

        deadline = time.monotonic() + self.startup_timeout_s
        state = wait_for_health(self.process, f"{self.url}/health", deadline=deadline, poll_s=0.3)
        if state == "exited":
            raise RouterError(
                f"vllm-router exited with status {self.process.poll()}; last lines of {self.log_path}: "
                f"{log_tail(self.log_path, lines=5)}"
            )
        if state == "timeout":
            raise RouterError(
                f"vllm-router not ready after {self.startup_timeout_s:.0f}s; last lines of {self.log_path}:"
                f" {log_tail(self.log_path, lines=5)}"
            )

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Terminate the router's process group."""
        process = self.process
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=timeout_s)
            except (ProcessLookupError, PermissionError):
                pass
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(timeout=5)
            self.process = None
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> VLLMRouter:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
