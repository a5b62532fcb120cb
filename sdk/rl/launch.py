"""`agentrl train` on Ray: the plan's actors placed, the orchestrator driving them, the run folder kept.

`run_training(config, run_dir=...)` is the whole of `agentrl train`:

1. checks what the run needs (`agentrl.rl.plan.check_resources`), plans the inference
   deployment (`agentrl.inference.plans.build_plan`) and the placement
   (`agentrl.rl.placement`), joins the Ray cluster at `launch.ray_address` or starts a local
   one, and reserves the placement groups: one bundle per trainer GPU (STRICT_PACK per
   node) or CPU rank, per the inference plan, one per rollout worker;
2. starts the inference actors and the trainer ranks at once (`agentrl.rl.groups`): a
   supervised vLLM server per replica behind `vllm-router`, or a node's processes for wide
   EP and P/D; the trainer ranks joined into one torch.distributed group (gloo on the CPU,
   NCCL on GPUs); then the rollout workers, pointed at the inference endpoint;
3. runs the `Orchestrator` in the driver's event loop; after each step the new weights go
   to every server through `inference.weight_transfer` (`agentrl.rl.transport`);
4. keeps the run folder on the driver, the one source of truth: config, metrics, a sample of each
   step's rollouts (`agentrl.rl.rollout_log`), TensorBoard / W&B copies of the metrics
   (`agentrl.rl.loggers`, `run.loggers`), placement, checkpoints (each node's files shipped back
   and merged), server logs; actors write only into their node's own folder, so no shared
   filesystem is needed;
5. stops every actor, the router, the placement groups (and the local cluster it started),
   also on errors and on SIGTERM / Ctrl-C (`agentrl.rl.stopping`: then it raises
   `RunStoppedError`, one line saying how to resume).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, require
from agentrl.inference.lora_serving import ADAPTER_NAME
from agentrl.rl.config import RunConfig
from agentrl.rl.heldout import HeldOutEval
from agentrl.rl.loggers import make_loggers
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
from agentrl.rl.rollout_log import RolloutLog
from agentrl.rl.stopping import (
    RunStopped,
    actor_died_error,
    actor_error,
    ray_messages_to_log,
    run_stoppable,
    stop_on_signals,
    stopped_error,
)
from agentrl.types import Rollout, Task

__all__ = ["TrainingResult", "run_training"]


class TrainingResult:
    """What a finished run returns."""

    def __init__(self, run_dir: Path, history: list[dict[str, Any]], placement: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.history = history
        self.placement = placement


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


def _dead_actor(actors: list[Any], *, timeout_s: float = 10.0) -> BaseException | None:
    """The `ActorDiedError` of the first of `actors` that is dead, or None when each answers (or is busy)."""
    import ray

    for actor in actors:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.ActorDiedError as died:
            return died
        except Exception:  # noqa: BLE001 - busy or unreachable is not dead
            continue
    return None


def _close_workers(workers: list[Any], *, timeout_s: float = 60.0) -> None:
    """Let each rollout worker release its environment's held resources (warm sandboxes) before it is killed."""
    import ray

    try:
        ray.get([worker.close.remote() for worker in workers], timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a dead or stuck worker: its sandboxes are orphans for `agentrl sandbox gc`
        pass


def _init_ray(config: RunConfig) -> bool:
    """Connect to (or start) Ray; return True when this call started a local cluster."""
    ray = require("ray", "train")
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    worker_env = {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    if config.launch.ray_address:
        ray.init(address=config.launch.ray_address, runtime_env={"env_vars": worker_env}, log_to_driver=False,
                 logging_level="ERROR")
        return False
    # A local cluster's workers inherit this process's environment, so they get `worker_env` without a
    # runtime_env: an actor with one waits on Ray's runtime-env agent for a new worker process (2.5 s against
    # 0.8 s for one on 2 cores) instead of taking a started one.
    os.environ.update(worker_env)
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    return True


def _write_placement(path: Path, placement: dict[str, str], *, run_id: str, urls: list[str],
                     pids: list[int | None]) -> None:
    """Record which Ray node (id, address, custom resources) each actor landed on, the actors' names
    (`ray.get_actor(f"{run_id}-inference-0")`), and each inference server's URL and pid on its node."""
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
    servers = [{"url": url, "pid": pid} for url, pid in zip(urls, pids, strict=False)]
    path.write_text(json.dumps({"run_id": run_id, "inference_urls": urls, "servers": servers, "actors": described},
                               indent=2))


def _model_files(path: Path, reservation: Any) -> Any:
    """The starting weights in the object store when a placed node does not see `path` (None when every
    node sees it, or when it is too big to ship: that node's actor then says so)."""
    import ray

    from agentrl.rl.shipping import MAX_SHIPPED_BYTES, folder_bytes, nodes_missing, read_folder

    slots = [*reservation.spec.trainer, *reservation.spec.inference]
    if not nodes_missing(path, [reservation.node_of(slot) for slot in slots]) or folder_bytes(path) > MAX_SHIPPED_BYTES:
        return None
    return ray.put(read_folder(path))


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
    from agentrl.hub.loader import load_environment
    from agentrl.inference.plans import build_plan
    from agentrl.rl.actors import RolloutWorker
    from agentrl.rl.groups import InferenceGroup, TrainerGroup
    from agentrl.rl.placement import placement_spec, reserve
    from agentrl.rl.transport import WeightPush

    status = on_status or (lambda message: None)
    check_resources(config)
    folder = RunDir(run_dir)
    state = OrchestratorState()
    start_weights = config.starting_weights()
    if config.inference.base_url:
        from agentrl.rl.shared_server import check_shared_server

        check_shared_server(config.inference.base_url, dtype=config.inference_dtype(), model_dir=start_weights)
    checkpoint_root = folder.checkpoints
    info = None
    if resume:
        folder.require_existing()
        folder_lock = folder.lock()  # a second run into this folder is refused while this one runs
        remove_partials(checkpoint_root)
        info = latest_checkpoint(checkpoint_root)
        if info is not None:
            state = load_orchestrator_state(info)
            # Trainer and servers start from the run's starting weights (a checkpoint folder may be
            # pruned later); the trainer then loads the checkpoint and the orchestrator's first push
            # serves those weights as version `step`.
            status(f"resuming from {info.path} (step {info.step})")
        folder.truncate_metrics(before_step=state.step)
        if state.step >= config.orchestrator.max_steps:
            status(f"run already finished ({state.step} steps)")
            return TrainingResult(folder.path, folder.metrics(), {})
    else:
        from agentrl.config import dump_config

        folder_lock = folder.lock()
        folder.create(dump_config(config))

    deployment = build_plan(str(start_weights), config.inference)
    local_env = load_environment(config.env.name, **config.env.args)
    spec = placement_spec(config, deployment)
    run_id = f"{folder.path.name}-{uuid.uuid4().hex[:6]}"
    started_ray = _init_ray(config)
    reservation = None
    trainer: TrainerGroup | None = None
    inference: Any = None  # an InferenceGroup, or a SharedServer (inference.base_url)
    workers: list[Any] = []
    loggers: list[Any] = []
    signals = ExitStack()
    try:
        signals.enter_context(stop_on_signals())  # SIGTERM / Ctrl-C: RunStopped, then the clean-up below
        signals.enter_context(ray_messages_to_log(folder.path / "logs" / "ray.log"))  # until after ray.shutdown()
        loggers = make_loggers(config.run.loggers, run_dir=folder.path, run_name=folder.path.name,
                               project=config.run.wandb_project, config=config.model_dump(mode="json"),
                               resume_step=state.step if resume else None)
        status("waiting for the placement groups")
        reservation = reserve(spec, timeout_s=config.launch.placement_timeout_s, run_name=run_id)
        model_files = _model_files(start_weights, reservation)
        status("starting the vLLM server(s) and the trainer (their logs: the run folder's logs/)")
        if config.inference.base_url:  # a server other runs share: this run loads its adapter there by name
            from agentrl.rl.shared_server import SharedServer

            inference = SharedServer(config.inference.base_url, run=run_id, staging_dir=folder.path / "weights",
                                     keep=config.orchestrator.max_off_policy_steps + 2,
                                     verify=config.inference.verify_weights,
                                     updates_log=folder.path / "weight_updates.jsonl")
            trainer = TrainerGroup.start(reservation, run_id=run_id, config=config, model_dir=str(start_weights),
                                         model_files=model_files)
        elif config.launch.colocate:  # vLLM sizes its share of the GPU from what is free: it starts first
            inference = InferenceGroup.start(reservation, run_id=run_id, config=config, deployment=deployment,
                                             model_dir=str(start_weights), model_files=model_files,
                                             log_dir=folder.path / "logs")
            trainer = TrainerGroup.start(reservation, run_id=run_id, config=config, model_dir=str(start_weights),
                                         model_files=model_files)
        else:
            with ThreadPoolExecutor(max_workers=1) as pool:  # servers start (minutes) while the ranks build
                starting = pool.submit(InferenceGroup.start, reservation, run_id=run_id, config=config,
                                       deployment=deployment, model_dir=str(start_weights), model_files=model_files,
                                       log_dir=folder.path / "logs")
                try:
                    trainer = TrainerGroup.start(reservation, run_id=run_id, config=config,
                                                 model_dir=str(start_weights), model_files=model_files)
                finally:
                    inference = starting.result()  # its own error, if it failed too
        if info is not None and state.step > 0:
            if not (info.path / "trainer").is_dir():
                raise AgentrlError(f"{info.path}: no trainer state to resume from (the run had "
                                   "run.checkpoint_trainer_state = false); start a new run from its HF export with "
                                   f"--set model.init_checkpoint={info.path}")
            trainer.load_checkpoint(info.path, info.step)
        # Rollouts render prompts with the served weights' tokenizer, shipped (small) to nodes that don't see it.
        from agentrl.rl.shipping import WEIGHT_SUFFIXES, read_folder

        # By value, not `ray.put`: a restartable actor's constructor arguments held in the object store
        # make Ray warn at every start (small files are inlined into the creation task instead).
        tokenizer_files = read_folder(start_weights, skip=WEIGHT_SUFFIXES)
        # A dead worker (it holds no state) is restarted by Ray in its bundle; the groups it was running,
        # and those sent while it restarts, run (again, from the start) on the restarted worker.
        restarts = config.launch.rollout_worker_restarts
        workers = [ray.remote(RolloutWorker).options(**reservation.options(slot), max_restarts=restarts,
                                                     max_task_retries=-1 if restarts else 0).remote(
                       config.env.name, config.env.args, url=inference.endpoint, model=config.model.name,
                       prefill_url=getattr(inference, "prefill_url", None),
                       nice=config.generation_nice(), recovery_timeout_s=config.launch.startup_timeout_s,
                       tokenizer_dir=str(start_weights), tokenizer_files=tokenizer_files,
                       adapter=ADAPTER_NAME if config.inference.lora_adapters and not config.inference.base_url
                       else None)
                   for slot in spec.rollout]
        if config.inference.base_url:
            inference.workers = workers
        placement = {f"trainer-{rank}": node for rank, node in enumerate(trainer.nodes)}
        placement.update({f"inference-{index}": node for index, node in enumerate(inference.nodes)})
        placement.update({f"rollout-{index}": node for index, node in enumerate(ray.get(
            [worker.node.remote() for worker in workers]))})
        nodes = sorted(set(placement.values()))
        status(f"placed {len(placement)} actors on {len(nodes)} node(s): "
               + "; ".join(f"node {index}: {', '.join(name for name, node in placement.items() if node == node_id)}"
                           for index, node_id in enumerate(nodes)) + " (node ids in placement.json)")
        _write_placement(folder.path / "placement.json", placement, run_id=run_id, urls=inference.urls,
                         pids=inference.server_pids())

        async def checkpoint(step: int, current: OrchestratorState) -> None:
            partial = begin_checkpoint(checkpoint_root, step)
            await trainer.save_checkpoint(str(partial), step=step, trainer_state=config.run.checkpoint_trainer_state)
            commit_checkpoint(partial, OrchestratorState.from_dict(current.to_dict()))
            prune_checkpoints(checkpoint_root, keep=config.run.keep_checkpoints)

        rollout_log = RolloutLog(folder.path, samples_per_step=config.run.rollout_samples_per_step,
                                 max_bytes=int(config.run.rollouts_max_mb * 2**20))
        rollout_log.truncate(before_step=state.step)  # a resumed run redoes the steps after its checkpoint

        def record(metrics: dict[str, Any]) -> None:
            folder.append_metrics(metrics)
            for logger in loggers:
                logger.log(metrics, step=int(metrics["step"]))
            if on_step is not None:
                on_step(metrics)

        environment = _RemoteEnvironment(local_env, workers)
        heldout = HeldOutEval(config.eval, environment=environment, client=None, sampling=config.sampling,
                              train_split=config.orchestrator.task_split)
        orchestrator = Orchestrator(
            config=config.orchestrator, environment=environment, client=None,  # type: ignore[arg-type]
            trainer=trainer, weight_sync=WeightPush(trainer, inference, transport=config.weight_transfer(),
                                                    staging_dir=folder.path / "weights",
                                                    verify=config.inference.verify_weights,
                                                    push_at_start=config.inference.lora_adapters),
            sampling=config.sampling, state=state, on_step=record, checkpoint=checkpoint,
            on_groups=rollout_log, heldout=heldout if heldout.enabled else None,
            env_name=config.env.name,  # as the user named it (a folder, a hub name): hints repeat it
        )
        status("training")
        run_stoppable(orchestrator.run())
        history = folder.metrics()
        if config.run.plots:
            folder.finish(title=f"agentrl train: {config.env.name} on {config.model.name}")
        return TrainingResult(folder.path, history, placement)
    except RunStopped as stopped:
        last = latest_checkpoint(checkpoint_root)
        raise stopped_error(stopped, run_dir=folder.path, checkpoint_step=last.step if last else None) from None
    except ray.exceptions.RayError as error:
        cause = getattr(error, "cause", None)
        if isinstance(error, ray.exceptions.RayTaskError) and isinstance(cause, AgentrlError):
            # An actor's own one-line error (a trainer rank out of GPU memory), not Ray's traceback around it.
            last = latest_checkpoint(checkpoint_root)
            raise actor_error(cause, run_dir=folder.path, checkpoint_step=last.step if last else None) from None
        # A trainer rank or another actor killed mid-run: its own ActorDiedError, or a survivor's error (a
        # rank's collective losing its peer) that arrived first. Named as the dead actor when there is one.
        died = error if isinstance(error, ray.exceptions.ActorDiedError) else _dead_actor(
            [*(trainer.ranks if trainer else []), *(inference.actors if inference else []), *workers])
        if died is None:
            raise
        last = latest_checkpoint(checkpoint_root)
        raise actor_died_error(died, run_dir=folder.path, run_id=run_id,
                               checkpoint_step=last.step if last else None) from None
    finally:
        for logger in loggers:
            logger.close()
        if inference is not None:
            inference.save_logs(folder.path / "logs")
            inference.stop()
        if trainer is not None:
            trainer.stop()
        _close_workers(workers)
        for actor in [*workers, *(trainer.ranks if trainer else []), *(inference.actors if inference else [])]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if reservation is not None:
            reservation.remove()
        if started_ray:
            ray.shutdown()
        signals.close()
        folder_lock.close()
