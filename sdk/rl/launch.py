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
   through `agentrl.rl.resume` and logging through `agentrl.rl.report`;
5. stops every actor and the placement group (and the local cluster it started), also on errors.

What the run needs is checked first (`agentrl.rl.plan.check_resources`); the actors are in
`agentrl.rl.actors`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Callable

from agentrl.errors import require
from agentrl.rl.actors import InferenceActor, RolloutWorker, TrainerActor
from agentrl.rl.config import RunConfig
from agentrl.rl.orchestrator import Orchestrator, OrchestratorState
from agentrl.rl.plan import check_resources
from agentrl.rl.report import RunDir
from agentrl.rl.resume import (
    begin_checkpoint,
    commit_checkpoint,
    latest_checkpoint,
    load_orchestrator_state,
    prune_checkpoints,
    remove_partials,
)
from agentrl.types import Rollout, Task, TrainingSample

__all__ = ["TrainingResult", "run_training"]


class TrainingResult:
    """What a finished run returns."""

    def __init__(self, run_dir: Path, history: list[dict[str, Any]], placement: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.history = history
        self.placement = placement


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
    from agentrl.loader import load_environment
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

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
