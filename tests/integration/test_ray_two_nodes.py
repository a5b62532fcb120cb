"""Two Ray nodes that share no filesystem with the driver or each other; `kill -9` of the driver; resume.

Node A (`ray start --head`, resource `nodeA`) and node B (`ray start --address`, resource
`nodeB`, its own ports) run as two `ray start --block` processes in their own sessions, so
this test stops exactly the cluster it started (never `ray stop`, which would kill every
Ray process of the machine). Each node starts in a mount namespace of its own (`unshare
--mount`, root) with an empty tmpfs mounted over the driver's folder (the run folder and the
starting weights) and over the other node's folder, so no actor can read or write them: the
hiding is real. Each node works in its own `AGENTRL_NODE_DIR`.

`agentrl train --ray-address` pins inference + rollouts to node A and the trainer to node B
(custom resources), moves weights through Ray's object store (`inference.weight_transfer =
"object_store"`) and must ship the starting weights to both nodes. Once a checkpoint after
step 2 is complete the driver (the CLI's process group) gets SIGKILL; the killed run's vLLM
server must die with its actor; `agentrl train --resume` on the same cluster finishes the run:
every step once, the trainer's optimizer-step counter restored, the last checkpoint complete
(HF export + DCP files) and loadable, the actors on their nodes, and each node's folder
holding only its own role's files while nothing reached the driver's paths in either node's view.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ray_cluster import ENV as CLUSTER_ENV
from ray_cluster import free_ports, stop_nodes, wait_nodes, worker_port_range

from agentrl.cli.train import printed_steps
from agentrl.rl.report import read_metrics
from agentrl.rl.resume import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"
SFT_WEIGHTS = ROOT / "cookbook" / "cpu-default" / "tiny-moe-sft"
ENV = {key: value for key, value in CLUSTER_ENV.items() if key != "AGENTRL_NODE_DIR"}  # the driver has none; each node gets its own
STEPS = 6
KILL_AFTER = 3  # kill once checkpoints/step_K (K >= 3: steps 0, 1, 2 trained) is complete

_PROBE = r"""
import json, os, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
paths = json.loads(sys.argv[2])
def look():
    seen = {path: sorted(os.listdir(path)) if os.path.isdir(path) else None for path in paths}
    return {"node": ray.get_runtime_context().get_node_id(), "node_dir": os.environ.get("AGENTRL_NODE_DIR"),
            "seen": seen}
print(json.dumps({name: ray.get(ray.remote(num_cpus=0, resources={name: 0.001})(look).remote())
                  for name in ("nodeA", "nodeB")}))
"""


def _ray_start(*args: str, node_dir: Path, hidden: list[Path], log: Path) -> subprocess.Popen:
    """`ray start --block` in a mount namespace of its own where `hidden` are empty tmpfs mounts."""
    ray_command = [shutil.which("ray") or "ray", "start", "--block", "--disable-usage-stats", *args]
    script = "set -e; " + "; ".join(f"mount -t tmpfs -o size=16m,mode=0755 agentrl-hidden {shlex.quote(str(path))}"
                                    for path in hidden) + "; exec " + shlex.join(ray_command)
    handle = open(log, "wb")  # noqa: SIM115 - the node keeps it
    return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                            env={**ENV, "AGENTRL_NODE_DIR": str(node_dir)}, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _probe(address: str, paths: list[Path]) -> dict:
    """What a Ray task on node A and on node B sees at `paths` (a listing, or None: no such folder)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, address, json.dumps([str(p) for p in paths])], env=ENV,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _files(root: Path) -> list[str]:
    """Every file under `root`, relative (tolerant of files that come and go while a run writes)."""
    found = []
    for folder, _, names in os.walk(root):
        found.extend(os.path.relpath(os.path.join(folder, name), root) for name in names)
    return sorted(found)


def _in_view(process: subprocess.Popen, path: Path) -> list[str]:
    """The files at `path` as the node started by `process` sees it (its mount namespace, via /proc)."""
    return _files(Path(f"/proc/{process.pid}/root") / path.relative_to("/"))


def _server_session(model_dir: Path) -> int | None:
    """The session of the vLLM server serving `model_dir` (it leads its own session), if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if str(model_dir).encode() in argv and any(b"vllm" in part for part in argv):
                return os.getsid(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return None


def _in_session(session: int, title: str = "") -> list[int]:
    """The processes of session `session` (a node's, or a server's) whose command line starts with `title`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session and (entry / "cmdline").read_bytes().startswith(title.encode()):
                    found.append(int(entry.name))
            except (OSError, ProcessLookupError):
                continue
    return found


def _train(*args: str, log: Path) -> subprocess.Popen:
    handle = open(log, "w")  # noqa: SIM115 - the CLI keeps it
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", "train", *args], cwd=ROOT,
                            env={**ENV, "COLUMNS": "400"},  # rich: one line per message
                            stdout=handle, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _steps_printed(log: Path) -> list[int]:
    return printed_steps(log.read_text())


@pytest.mark.integration
@pytest.mark.e2e
@pytest.mark.timeout(720)
def test_two_nodes_no_shared_fs_kill_9_resume(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): each Ray node gets a mount namespace of its own")
    started = time.monotonic()
    driver_dir, dir_a, dir_b = tmp_path / "driver", tmp_path / "nodeA", tmp_path / "nodeB"
    for folder in (driver_dir, dir_a, dir_b):
        folder.mkdir()
    weights = driver_dir / "weights" / "tiny-moe-sft"
    shutil.copytree(SFT_WEIGHTS, weights)
    run_dir = driver_dir / "run"

    head_port, a_nm, a_om, b_nm, b_om, a_client = free_ports(6)
    a_low, a_high = worker_port_range()
    b_low, b_high = worker_port_range()
    while b_low <= a_high and a_low <= b_high:
        b_low, b_high = worker_port_range()
    temp_dir = Path(tempfile.mkdtemp(prefix="ray2n-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    head = _ray_start("--head", "--port", str(head_port), "--num-cpus", "1", "--resources", '{"nodeA": 1}',
                      "--node-ip-address", "127.0.0.1", "--node-manager-port", str(a_nm),
                      "--object-manager-port", str(a_om), "--ray-client-server-port", str(a_client),
                      "--min-worker-port", str(a_low), "--max-worker-port", str(a_high), "--include-dashboard",
                      "false", "--temp-dir", str(temp_dir),
                      node_dir=dir_a, hidden=[driver_dir, dir_b], log=tmp_path / "head.log")
    worker = None
    first = second = None
    passed = False
    try:
        address = f"127.0.0.1:{head_port}"
        wait_nodes(address, 1)
        worker = _ray_start("--address", address, "--num-cpus", "1", "--resources", '{"nodeB": 1}',
                            "--node-ip-address", "127.0.0.1", "--node-manager-port", str(b_nm),
                            "--object-manager-port", str(b_om), "--min-worker-port", str(b_low),
                            "--max-worker-port", str(b_high),
                            node_dir=dir_b, hidden=[driver_dir, dir_a], log=tmp_path / "worker.log")
        wait_nodes(address, 2)

        # The hiding is real: neither node sees the driver's folder (nor the weights in it), nor the other's.
        (dir_a / "owner").write_text("A")
        (dir_b / "owner").write_text("B")
        seen = _probe(address, [driver_dir, weights, dir_a, dir_b])
        node_a, node_b = seen["nodeA"], seen["nodeB"]
        assert node_a["node"] != node_b["node"]
        assert (node_a["node_dir"], node_b["node_dir"]) == (str(dir_a), str(dir_b))
        for view, own, other in ((node_a, dir_a, dir_b), (node_b, dir_b, dir_a)):
            assert view["seen"][str(driver_dir)] == [], view
            assert view["seen"][str(weights)] is None, view
            assert view["seen"][str(own)] == ["owner"], view
            assert view["seen"][str(other)] == [], view
        (dir_a / "owner").unlink()
        (dir_b / "owner").unlink()

        common = ["--set", "launch.inference_resources={nodeA=0.1}", "--set", "launch.rollout_resources={nodeA=0.1}",
                  "--set", "launch.trainer_resources={nodeB=0.1}", "--set", "inference.weight_transfer=object_store",
                  "--set", "launch.placement_timeout_s=240"]
        first_log = tmp_path / "first.log"
        first = _train("--config", str(CI_CONFIG), "-o", str(run_dir), "--ray-address", address,
                       "--set", f"model.init_checkpoint={weights}", "--set", f"orchestrator.max_steps={STEPS}",
                       "--set", "orchestrator.checkpoint_every=1", *common, log=first_log)
        deadline = time.monotonic() + 300
        while True:
            info = latest_checkpoint(run_dir / "checkpoints")  # COMPLETE + orchestrator.json in step_K (renamed whole)
            if info is not None and info.step >= KILL_AFTER:
                break
            assert first.poll() is None, f"the first run ended (rc {first.returncode}): {first_log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint step_{KILL_AFTER} in 5 minutes: {first_log.read_text()[-3000:]}"
            time.sleep(0.2)
        first_placement = json.loads((run_dir / "placement.json").read_text())
        first_id = first_placement["run_id"]
        at_kill = {"A": _files(dir_a), "B": _files(dir_b)}
        server = _server_session(dir_a / "models" / f"{first_id}-start")
        assert server is not None, "no vLLM server of the first run found on node A"

        def lingering() -> dict[str, list[int]]:
            """The first run's processes: its vLLM server's session, its actors' workers in each node's session."""
            found = {"vllm": _in_session(server), "inference": _in_session(head.pid, "ray::InferenceActor"),
                     "rollout": _in_session(head.pid, "ray::RolloutWorker"),
                     "trainer": _in_session(worker.pid, "ray::TrainerRank")}
            return {role: pids for role, pids in found.items() if pids}

        assert set(lingering()) == {"vllm", "inference", "rollout", "trainer"}, lingering()
        assert first.poll() is None, "the first run finished before it could be killed"
        os.killpg(first.pid, signal.SIGKILL)  # kill -9 of the driver (the CLI's process group)
        first.wait()
        first_steps = _steps_printed(first_log)
        resume_at = latest_checkpoint(run_dir / "checkpoints").step
        assert KILL_AFTER <= resume_at < STEPS, (resume_at, first_steps)
        assert len(read_metrics(run_dir / "metrics.jsonl")) < STEPS

        # While the killed run worked: its starting weights shipped to both nodes, its weight versions
        # reached node A through the object store; each node held only its own role's files.
        start_copy = f"models/{first_id}-start/config.json"
        assert start_copy in at_kill["A"] and start_copy in at_kill["B"], at_kill
        assert any(name.startswith(f"runs/{first_id}/inference-0/weights/v") for name in at_kill["A"]), at_kill["A"]
        assert not [name for name in at_kill["A"] if "/trainer/" in name], at_kill["A"]
        assert not [name for name in at_kill["B"] if "/inference-" in name], at_kill["B"]

        # Ray ends a dead driver's actors (their worker processes run in the node's session) and the
        # server's sentinel then ends the vLLM server (its own session): a bounded wait for both.
        killed_s = time.monotonic() - started
        deadline = time.monotonic() + 120
        while lingering() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not lingering(), f"the killed run's processes outlived the driver by 2 minutes: {lingering()}"
        gone_s = time.monotonic() - started - killed_s

        second_log = tmp_path / "second.log"
        second = _train("--resume", str(run_dir), "--ray-address", address, log=second_log)
        try:
            second.wait(timeout=300)
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
                second.wait()
        output = second_log.read_text()
        assert second.returncode == 0, output[-3000:]
        resume_s = time.monotonic() - started - killed_s - gone_s
        resumed_from = f"resuming from {run_dir / 'checkpoints' / f'step_{resume_at}'} (step {resume_at})"
        assert resumed_from in " ".join(output.split()), output[-3000:]
        assert _steps_printed(second_log) == list(range(resume_at, STEPS)), output[-3000:]

        rows = read_metrics(run_dir / "metrics.jsonl")
        assert [row["step"] for row in rows] == list(range(STEPS))
        assert [int(row["train/step"]) for row in rows] == [step + 1 for step in range(STEPS)]

        last = latest_checkpoint(run_dir / "checkpoints")
        assert last.step == STEPS and (last.path / "COMPLETE").read_text() == str(STEPS)
        dcp = _files(last.trainer_path)
        assert ".metadata" in dcp and "extra_rank0.pt" in dcp and any(n.endswith(".distcp") for n in dcp), dcp
        assert (last.path / "config.json").is_file() and (last.path / "model.safetensors").is_file()
        from agentrl.rl.config import load_run_config
        from agentrl.trainer.trainer import Trainer

        loaded = Trainer(load_run_config(run_dir / "config.toml").trainer, model_dir=last.path)
        assert loaded.load_checkpoint(last.trainer_path) == STEPS

        placement = json.loads((run_dir / "placement.json").read_text())
        assert placement["run_id"] != first_id
        for record in (first_placement, placement):
            actors = record["actors"]
            assert "nodeA" in actors["inference-0"]["resources"] and "nodeA" in actors["rollout-0"]["resources"]
            assert "nodeB" in actors["trainer-0"]["resources"]
            assert actors["inference-0"]["node_id"] == actors["rollout-0"]["node_id"] == node_a["node"]
            assert actors["trainer-0"]["node_id"] == node_b["node"]

        # The driver's run folder holds the run; nothing of it ever appeared in either node's view of it.
        assert (run_dir / "logs" / "vllm-0.log").stat().st_size > 0
        assert not (run_dir / "weights").exists()  # object_store: no staging in the run folder
        for process in (head, worker):
            assert _in_view(process, driver_dir) == []
        assert _in_view(head, dir_b) == [] and _in_view(worker, dir_a) == []
        # The nodes' folders: the resumed run cleaned up after itself; the killed one's leftovers
        # are its own role's on each node, never a file the driver keeps.
        after = {"A": _files(dir_a), "B": _files(dir_b)}
        resumed_id = placement["run_id"]
        for node, names in after.items():
            assert not [n for n in names if resumed_id in n], (node, names)
            assert not [n for n in names if Path(n).name in ("COMPLETE", "orchestrator.json", "metrics.jsonl")]
        assert not [n for n in after["A"] if "/trainer/" in n], after["A"]
        assert not [n for n in after["B"] if "/inference-" in n], after["B"]
        print(f"\ntwo nodes: killed after checkpoint step_{resume_at} (first run printed steps {first_steps}), "
              f"resumed at {resume_at}; killed at {killed_s:.0f}s, its actors and vLLM server gone {gone_s:.1f}s later, "
              f"resumed run {resume_s:.0f}s, whole test {time.monotonic() - started:.0f}s")
        print(f"node A at kill: {at_kill['A']}\nnode B at kill: {at_kill['B']}")
        print(f"node A after: {after['A']}\nnode B after: {after['B']}")
        print(f"run folder: {_files(run_dir)}")
        passed = True
    finally:
        for run in (first, second):
            if run is not None and run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
        stopping = time.monotonic()
        stop_nodes(*(node for node in (worker, head) if node is not None))
        print(f"nodes stopped in {time.monotonic() - stopping:.0f}s")
        if passed:  # kept when the test fails: the nodes' Ray logs
            shutil.rmtree(temp_dir, ignore_errors=True)
