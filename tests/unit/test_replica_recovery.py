"""A replica killed during a weight load: the load waits for the restart and goes through.

`ServerSupervisor.went_down` tells a caller whose call just failed whether the server died,
also in the second before the supervisor's next poll has seen it; `InferenceActor.load_weights`
uses it, so a `kill -9` that lands mid-load is a restart to wait out, not the run's failure.
The server is a stand-in: a sleeping process (what the supervisor polls) and a small HTTP
server answering /health and /weight_info; the weight publisher is a stand-in too.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentrl.inference.supervisor import ServerSupervisor
from agentrl.inference.weights import WeightUpdateError
from agentrl.rl.inference_actor import InferenceActor


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if not self.server.owner.is_running():
            self.send_error(503)  # a dead server answers nothing useful
            return
        body = json.dumps({"weight_version": self.server.version}).encode() if self.path == "/weight_info" else b"{}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class FakeServer:
    """What the supervisor uses of a `VLLMServer`: a process to poll, a URL, start and stop."""

    def __init__(self) -> None:
        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.http.version = "0"  # what /weight_info reports (a restart's restore keeps it, as the real one does)
        self.http.owner = self
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.port = self.http.server_address[1]
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> FakeServer:
        self.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.starts += 1
        return self

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def close(self) -> None:
        self.stop()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


def _supervisor(server: FakeServer, interval: float = 0.5) -> ServerSupervisor:
    return ServerSupervisor(server, health_interval_s=interval, failure_threshold=3, max_restarts=2)


def test_went_down_waits_for_the_watch_to_see_a_kill(server):
    supervisor = _supervisor(server).start()
    try:
        # up and healthy: a failure would be the call's own
        assert supervisor.went_down(since=time.monotonic(), timeout_s=0.3) is False
        started = time.monotonic()
        server.kill()
        assert supervisor.healthy  # the watch has not polled since the kill
        assert supervisor.went_down(since=started) is True
        assert time.monotonic() - started < 2 * supervisor.health_interval_s + 0.5
        assert supervisor.wait_healthy(10) and server.starts == 2  # restarted (the fake restarts at once)
        assert supervisor.went_down(since=started) is True  # the death is remembered after the restart
        assert supervisor.went_down(since=time.monotonic(), timeout_s=0.3) is False  # but not for later calls
    finally:
        supervisor.stop()


class _Publisher:
    """Stand-in for the actor's `FilesystemWeightPublisher`.

    `kill`: "during" (the first publish kills the server and fails), "after" (the first
    publish goes through, then the server is killed) or "never" (every publish fails on a
    live server: bad weights).
    """

    def __init__(self, server: FakeServer, *, kill: str) -> None:
        self.server = server
        self.kill = kill
        self.calls: list[int] = []
        self.version: int | None = None

    def publish(self, path: str, version: int):
        self.calls.append(version)
        if self.kill == "never":
            raise WeightUpdateError(f"reload_weights on {self.server.url} failed (HTTP 500): bad weights")
        if self.kill == "during" and len(self.calls) == 1:
            self.server.kill()  # the kill lands during the load: pause/reload fail at once
            raise WeightUpdateError(f"pause on {self.server.url}: ConnectError: connection refused")
        self.version = version
        self.server.http.version = str(version)
        if self.kill == "after" and len(self.calls) == 1:
            self.server.kill()  # loaded, then killed before the actor asks what it serves
        return type("Result", (), {"update_s": 0.01, "checks": {}, "memory": {}})()


def _actor(server: FakeServer, supervisor: ServerSupervisor, publisher: _Publisher, folder: Path) -> InferenceActor:
    actor = object.__new__(InferenceActor)  # no Ray, no vLLM: only what load_weights uses
    actor.index, actor.run_id, actor.folder = 1, "run", folder
    actor.server, actor.supervisor, actor.publisher = server, supervisor, publisher
    actor.startup_timeout_s = 30.0
    actor._lock = threading.Lock()
    actor._events = []
    return actor


def test_a_kill_during_a_weight_load_is_waited_out_and_the_load_retried(server, tmp_path):
    supervisor = _supervisor(server).start()
    publisher = _Publisher(server, kill="during")
    try:
        result = _actor(server, supervisor, publisher, tmp_path).load_weights(4, path=str(tmp_path))
        assert publisher.calls == [4, 4]
        assert result["version"] == 4 and result["served_version"] == "4"
        assert [event.kind for event in supervisor.events] == ["started", "died", "restarted"]
    finally:
        supervisor.stop()


def test_a_kill_right_after_a_weight_load_reports_the_restarted_servers_version(server, tmp_path):
    supervisor = _supervisor(server).start()
    publisher = _Publisher(server, kill="after")
    try:
        result = _actor(server, supervisor, publisher, tmp_path).load_weights(4, path=str(tmp_path))
        assert publisher.calls == [4]  # the load went through: not loaded twice
        assert result["served_version"] == "4"  # what the restarted server reports, not None
        assert [event.kind for event in supervisor.events] == ["started", "died", "restarted"]
    finally:
        supervisor.stop()


def test_a_load_failing_on_a_live_server_is_the_runs_failure(server, tmp_path):
    supervisor = _supervisor(server, interval=0.1).start()
    publisher = _Publisher(server, kill="never")
    try:
        with pytest.raises(WeightUpdateError, match="bad weights"):
            _actor(server, supervisor, publisher, tmp_path).load_weights(4, path=str(tmp_path))
        assert publisher.calls == [4]  # not retried: the server never went down
        assert [event.kind for event in supervisor.events] == ["started"]
    finally:
        supervisor.stop()


def test_the_runs_router_probes_a_restarted_replica_within_seconds():
    """vllm-router accepts the flags `InferenceGroup` adds: its circuit breaker retries a dead replica every 2 s."""
    pytest.importorskip("vllm_router")
    from agentrl.inference.router import router_command
    from agentrl.inference.validate import validate_router_args
    from agentrl.rl.groups import ROUTER_ARGS

    argv = router_command(["http://127.0.0.1:1", "http://127.0.0.1:2"], port=9, extra_args=ROUTER_ARGS)
    assert argv[1:3] == ["-m", "vllm_router.launch_router"]
    args = validate_router_args(argv[3:])
    assert args.cb_timeout_duration_secs == 2
