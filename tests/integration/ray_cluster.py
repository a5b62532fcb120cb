"""A Ray cluster of several nodes on this machine, for tests: each node a `ray start --block` process.

Every node runs in its own session and is stopped by its process group (never `ray stop`,
which would kill every Ray process of the machine). `RayCluster(...).add_node(...)` takes the
node's CPUs, GPUs (Ray accepts GPUs that do not exist: a simulated GPU cluster), custom
resources, extra environment and an optional command prefix (e.g. `unshare --mount ...`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


class RayCluster:
    """Nodes started one by one; `address` once the head is up; `stop()` stops what was started."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        self.address: str | None = None
        self.temp_dir = Path(tempfile.mkdtemp(prefix="raytest-", dir="/tmp"))  # short: socket path limits
        self._next_worker_port = 21000 + (os.getpid() % 40) * 400

    def add_node(self, *, cpus: int, gpus: int = 0, resources: dict[str, float] | None = None,
                 env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        node_manager, object_manager, client = free_ports(3)
        low = self._next_worker_port
        self._next_worker_port += 200
        args = ["--num-cpus", str(cpus), "--num-gpus", str(gpus), "--resources", json.dumps(resources or {}),
                "--node-ip-address", "127.0.0.1", "--node-manager-port", str(node_manager),
                "--object-manager-port", str(object_manager), "--min-worker-port", str(low),
                "--max-worker-port", str(low + 199)]
        if self.address is None:
            head_port = free_ports(1)[0]
            args = ["--head", "--port", str(head_port), "--ray-client-server-port", str(client),
                    "--include-dashboard", "false", "--temp-dir", str(self.temp_dir), *args]
        else:
            args = ["--address", self.address, *args]
        log = open(self.log_dir / f"ray-node-{len(self.processes)}.log", "wb")  # noqa: SIM115 - the node keeps it
        command = [*(prefix or []), "ray", "start", "--block", "--disable-usage-stats", *args]
        self.processes.append(subprocess.Popen(command, env={**ENV, **(env or {})}, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))
        if self.address is None:
            self.address = f"127.0.0.1:{head_port}"
        self.wait_nodes(len(self.processes))

    def wait_nodes(self, count: int, timeout_s: float = 180) -> None:
        code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run([sys.executable, "-c", code, self.address], env=ENV, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout.strip()) >= count:
                return
            time.sleep(2)
        raise AssertionError(f"the Ray cluster at {self.address} did not reach {count} nodes")

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is not None:
                continue
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
