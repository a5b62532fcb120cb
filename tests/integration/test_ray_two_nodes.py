"""A short default train on a 2-node Ray cluster on this machine, actors placed on both nodes.

Node A (`ray start --head`, resource `nodeA`) and node B (`ray start --address`, resource
`nodeB`, its own ports) run as two `ray start --block` processes in their own sessions, so
this test stops exactly the cluster it started (never `ray stop`, which would kill every
Ray process of the machine). `agentrl train --ray-address` joins it; custom resources
pin inference + rollouts to node A and the trainer to node B, and the run records where
each actor ran in placement.json.
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

import pytest

from agentrl.rl.report import read_metrics

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


def _ray_start(*args: str, log: Path) -> subprocess.Popen:
    handle = open(log, "wb")
    return subprocess.Popen(["ray", "start", "--block", "--disable-usage-stats", *args], env=ENV,
                            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _wait_nodes(address: str, count: int, timeout_s: float = 180) -> None:
    code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run([sys.executable, "-c", code, address], env=ENV, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip().isdigit() and int(out.stdout.strip()) >= count:
            return
        time.sleep(2)
    raise AssertionError(f"the Ray cluster at {address} did not reach {count} nodes")


@pytest.mark.integration
@pytest.mark.e2e
def test_train_on_two_ray_nodes(tmp_path):
    head_port, a_nm, a_om, b_nm, b_om, a_client = _free_ports(6)
    temp_dir = Path(tempfile.mkdtemp(prefix="ray2n-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    head = _ray_start("--head", "--port", str(head_port), "--num-cpus", "1", "--resources", '{"nodeA": 1}',
                      "--node-ip-address", "127.0.0.1", "--node-manager-port", str(a_nm),
                      "--object-manager-port", str(a_om), "--ray-client-server-port", str(a_client),
                      "--min-worker-port", "21000", "--max-worker-port", "21199", "--include-dashboard", "false",
                      "--temp-dir", str(temp_dir), log=tmp_path / "head.log")
    worker = None
    try:
        address = f"127.0.0.1:{head_port}"
        _wait_nodes(address, 1)
        worker = _ray_start("--address", address, "--num-cpus", "1", "--resources", '{"nodeB": 1}',
                            "--node-ip-address", "127.0.0.1", "--node-manager-port", str(b_nm),
                            "--object-manager-port", str(b_om), "--min-worker-port", "21200",
                            "--max-worker-port", "21399", log=tmp_path / "worker.log")
        _wait_nodes(address, 2)
        run_dir = tmp_path / "run"
        result = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "train", "--config", str(CI_CONFIG), "-o", str(run_dir),
             "--ray-address", address, "--set", "orchestrator.max_steps=2",
             "--set", "launch.inference_resources={nodeA=0.1}", "--set", "launch.rollout_resources={nodeA=0.1}",
             "--set", "launch.trainer_resources={nodeB=0.1}"],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900,
        )
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        placement = json.loads((run_dir / "placement.json").read_text())["actors"]
        assert "nodeA" in placement["inference-0"]["resources"]
        assert "nodeA" in placement["rollout-0"]["resources"]
        assert "nodeB" in placement["trainer-0"]["resources"]
        assert placement["inference-0"]["node_id"] != placement["trainer-0"]["node_id"]
        assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]
    finally:
        if worker is not None:
            _stop(worker)
        _stop(head)
