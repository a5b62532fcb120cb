"""A Ray cluster of several nodes on this machine, for tests: each node a `ray start --block` process.

Every node runs in its own session and is stopped by its process group (never `ray stop`,
which would kill every Ray process of the machine). `RayCluster(...).add_node(...)` takes the
node's CPUs, GPUs (Ray accepts GPUs that do not exist: a simulated GPU cluster), custom
resources, extra environment and an optional command prefix (e.g. `unshare --mount ...`).
"""

from __future__ import annotations

import json
import os
import random
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


def worker_port_range(width: int = 200) -> tuple[int, int]:
    """A free range of worker ports (not a fixed one: another test's cluster may hold it)."""
    for _ in range(50):
        low = random.randrange(20000, 30000 - width)
        try:
            for port in range(low, low + width, 17):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return low, low + width - 1
    raise AssertionError("no free worker port range")


def wait_nodes(address: str, count: int, timeout_s: float = 180) -> None:
    """Wait until the cluster at `address` has `count` live nodes."""
    code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run([sys.executable, "-c", code, address], env=ENV, capture_output=True, text=True,
                             check=False)
        if out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout.strip()) >= count:
            return
        time.sleep(2)
    raise AssertionError(f"the Ray cluster at {address} did not reach {count} nodes")


def stop_nodes(*processes: subprocess.Popen) -> None:
    """Stop each node in turn: SIGTERM to `ray start` (it drains the node through the GCS, so worker
    nodes go before the head), then SIGKILL to whatever is left of its process group."""
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


class RayCluster:
    """Nodes started one by one; `address` once the head is up; `stop()` stops what was started."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        self.address: str | None = None
        self.temp_dir = Path(tempfile.mkdtemp(prefix="raytest-", dir="/tmp"))  # short: socket path limits

    def add_node(self, *, cpus: int, gpus: int = 0, resources: dict[str, float] | None = None,
                 env: dict[str, str] | None = None, prefix: list[str] | None = None) -> None:
        node_manager, object_manager, client = free_ports(3)
        low, high = worker_port_range()
        args = ["--num-cpus", str(cpus), "--num-gpus", str(gpus), "--resources", json.dumps(resources or {}),
                "--node-ip-address", "127.0.0.1", "--node-manager-port", str(node_manager),
                "--object-manager-port", str(object_manager), "--min-worker-port", str(low),
                "--max-worker-port", str(high)]
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
        wait_nodes(self.address, count, timeout_s)

    def stop(self) -> None:
        stop_nodes(*reversed(self.processes))
