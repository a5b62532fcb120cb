"""The driver's handles on the run's actors: the trainer ranks as one trainer, the servers as one endpoint.

`TrainerGroup` starts one `TrainerRank` per rank in its placement slot, joins them into one
torch.distributed group (rank 0's node IP and a free port), and turns every collective
operation into one call on all ranks at once: a step's samples go into Ray's object store
once and every rank reads them; metrics come from rank 0, and the per-token logprobs of the
samples asked for (`logprobs_of`) are merged from every rank (each holds other rows, or with
CP other tokens of a row). Checkpoints come back from one
rank per node and are merged into the driver's run folder; a checkpoint to resume from is
shipped to every rank.

`InferenceGroup` starts the inference actors of the deployment plan (`InferenceActor` per
server for `single`/`replicas`, `InferenceNodeActor` per node for `wide_ep`/`pd`), puts
`vllm-router` in front of several servers (consistent hashing on the trajectory id, so a
trajectory stays on one replica), loads each weight version into every server and, at the
end, copies every server's log into the run folder. Every update is one line of the run's
`weight_updates.jsonl`, whatever the transport: a load (`load`: version, time, `load_s`, the
version each server reports) or a direct push or re-send (`set_version`: the same, with the
trainer-side timings the publisher measured, `update_s` pause..resume and `push_s` with the
gather, the transport, and `resent` for a re-send to restarted servers).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from agentrl.inference.transfer import WeightTransport
from agentrl.rl.inference_actor import InferenceActor, InferenceNodeActor
from agentrl.rl.shipping import Folder, mark_visible, read_folder, write_folder
from agentrl.rl.trainer_rank import TrainerRank
from agentrl.types import TrainingSample

__all__ = ["InferenceGroup", "TrainerGroup", "merge_token_logprobs"]

# A replica that dies is restarted on its port by its supervisor. Meanwhile vllm-router's circuit
# breaker takes it out of rotation after a few failed requests (its sessions go to the other
# replicas) and by default tries it again only 60 s later, so a restarted replica would sit idle
# for up to a minute; probe it every 2 s instead (a failed probe is retried on a healthy replica).
ROUTER_ARGS = ["--cb-timeout-duration-secs", "2"]


def _kill(actors: list[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone
            pass


def merge_token_logprobs(parts: list[dict[int, list[float | None]] | None]) -> dict[int, list[float | None]]:
    """One list per sample from the ranks' partial `token_logprobs` (each rank fills the tokens it computed)."""
    merged: dict[int, list[float | None]] = {}
    for part in parts:
        for index, values in (part or {}).items():
            known = merged.setdefault(int(index), [None] * len(values))
            for position, value in enumerate(values):
                if value is not None and position < len(known):
                    known[position] = value
    return merged


class TrainerGroup:
    """All trainer ranks, driven as one trainer (the orchestrator's `PolicyTrainer`)."""

    def __init__(self, ranks: list[Any], *, nodes: list[str]) -> None:
        self.ranks = ranks
        self.nodes = nodes
        """The Ray node id of each rank."""
        # One rank per node ships that node's checkpoint files (the ranks of a node share its folder).
        self.shippers = {rank for rank, node in enumerate(nodes) if nodes.index(node) == rank}

    @classmethod
    def start(cls, reservation: Any, *, run_id: str, config: Any, model_dir: str, model_files: Any) -> TrainerGroup:
        import ray

        world = config.trainer_world()
        threads = config.launch.trainer_threads if not config.launch.trainer_gpus else None
        ranks = [ray.remote(TrainerRank).options(**reservation.options(slot), name=f"{run_id}-trainer-{rank}").remote(
                     run_id=run_id, rank=rank, world=world, threads=threads)
                 for rank, slot in enumerate(reservation.spec.trainer)]
        try:
            master = ray.get(ranks[0].rendezvous.remote())
            infos = ray.get([rank.setup.remote(master=master, trainer_config=config.trainer, model_dir=model_dir,
                                               model_files=model_files,
                                               export_adapters=config.inference.lora_adapters) for rank in ranks])
        except BaseException:
            _kill(ranks)
            raise
        return cls(ranks, nodes=[info["node"] for info in infos])

    async def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return await asyncio.gather(*(getattr(rank, method).remote(*args, **kwargs) for rank in self.ranks))

    async def train_step(self, samples: list[TrainingSample], *, step: int,
                         logprobs_of: list[int] = ()) -> dict[str, Any]:
        import ray

        shared = ray.put(samples)  # once, whatever the number of ranks
        results = await self._all("train_step", shared, step, list(logprobs_of))
        metrics = dict(results[0])
        if logprobs_of:
            metrics["token_logprobs"] = merge_token_logprobs([result.get("token_logprobs") for result in results])
        return metrics

    async def export(self, version: int, *, dest: str, ship: bool) -> Any:
        return (await self._all("export", version, dest=dest, ship=ship))[0]

    async def export_ref(self, version: int) -> Any:
        """The exported files as an ObjectRef held in rank 0's object store (for `object_store`)."""
        refs = [rank.export.remote(version, dest=None, ship=True) for rank in self.ranks]
        await asyncio.gather(*refs)
        return refs[0]

    async def push_direct(self, version: int, *, urls: list[str], transport: WeightTransport,
                          reconnect: list[str] = (), verify: bool = True) -> dict[str, Any]:
        """Every rank gathers, rank 0 sends `version` (nccl / ipc); rank 0's timings, checks and server memory."""
        timings = await self._all("push_direct", version, urls=urls, transport=transport,
                                  reconnect=list(reconnect), verify=verify)
        return timings[0]

    async def resend_direct(self, urls: list[str]) -> dict[str, Any] | None:
        """The pushed version again to the restarted servers `urls`; None when a step ran since that push."""
        return (await self._all("resend_direct", urls))[0]

    async def save_checkpoint(self, path: str, *, step: int, trainer_state: bool = True) -> None:
        """Every rank saves; ranks that see `path` (the driver's checkpoint folder) write into it, the
        other nodes' files come back from one rank each and are merged into it."""
        token = mark_visible(path)
        parts = await asyncio.gather(*(rank.save.remote(step, dest=path, token=token, ship=index in self.shippers,
                                                        trainer_state=trainer_state)
                                       for index, rank in enumerate(self.ranks)))
        files: Folder = {}
        for part in parts:
            files.update(part or {})
        if files:
            write_folder(files, path, merge=True)

    def load_checkpoint(self, path: Path, step: int) -> int:
        """Every rank restores `path`: read in place where the node sees it, else shipped to it."""
        import ray

        visible = ray.get([rank.sees_checkpoint.remote(str(path)) for rank in self.ranks])
        shared = ray.put(read_folder(path, max_bytes=1 << 62)) if not all(visible) else None
        return ray.get([rank.load.remote(step, path=str(path) if seen else None, files=None if seen else shared)
                        for rank, seen in zip(self.ranks, visible, strict=True)])[0]

    def stop(self) -> None:
        import ray

        try:
            ray.get([rank.stop.remote() for rank in self.ranks], timeout=60)
        except Exception:  # noqa: BLE001 - the ranks may be gone already
            pass


class InferenceGroup:
    """The run's inference actors and the one URL rollout workers talk to."""

    def __init__(self, actors: list[Any], urls: list[str], *, router: Any = None, nodes: list[str],
                 updates_log: Path | None = None, prefill_url: str | None = None) -> None:
        self.actors = actors
        self.updates_log = updates_log
        """`weight_updates.jsonl` of the run: per update (load, direct push or re-send), its timing and the
        version each server reports afterwards."""
        self.urls = urls
        """Every server's URL (weights go to each one directly)."""
        self.router = router
        self.nodes = nodes
        self.prefill_url = prefill_url
        """A P/D pair's prefill server: rollouts send each request there first (`clients.prefill_decode`), then
        to `endpoint`, the decode server."""

    @property
    def endpoint(self) -> str:
        """Where rollouts send requests: the router in front of several servers, else the one server (a P/D pair's
        decode server, with `prefill_url`)."""
        if self.prefill_url is not None:
            return self.urls[-1]
        return self.router.url if self.router is not None else self.urls[0]

    @classmethod
    def start(cls, reservation: Any, *, run_id: str, config: Any, deployment: Any, model_dir: str,
              model_files: Any, log_dir: Path) -> InferenceGroup:
        spec = reservation.spec
        actors: list[Any] = []
        try:
            return cls._start(actors, reservation, spec, run_id=run_id, config=config, deployment=deployment,
                              model_dir=model_dir, model_files=model_files, log_dir=log_dir)
        except BaseException:
            _kill(actors)
            raise

    @classmethod
    def _start(cls, actors: list[Any], reservation: Any, spec: Any, *, run_id: str, config: Any, deployment: Any,
               model_dir: str, model_files: Any, log_dir: Path) -> InferenceGroup:
        import ray

        if config.inference.node_processes():
            for slot, node in zip(spec.inference, spec.inference_nodes, strict=True):
                processes = [process.model_dump() for process in deployment.servers if process.node == node]
                actors.append(ray.remote(InferenceNodeActor).options(**reservation.options(slot)).remote(
                    run_id=run_id, node=node, processes=processes, startup_timeout_s=config.launch.startup_timeout_s))
            urls = [url for found in ray.get([actor.start.remote() for actor in actors]) for url in found]
        else:
            # Routed experts only when the trainer replays them (the CPU plugin turns prefix caching off).
            replaying = config.inference.routed_experts and config.trainer.router_replay
            serving = config.inference.model_copy(update={
                "routed_experts": replaying,
                "routed_weights": replaying and (config.inference.routed_weights
                                                 or config.trainer.router_replay_weights),
                # a P/D pair's KV files: this run's own folder (files are named by prompt tokens, not by model)
                "kv_offload_dir": str(Path(config.inference.kv_offload_dir) / run_id) if config.inference.pd_pair()
                else config.inference.kv_offload_dir,
            })
            for index, slot in enumerate(spec.inference):
                actors.append(ray.remote(InferenceActor).options(
                    **reservation.options(slot), max_concurrency=4, name=f"{run_id}-inference-{index}").remote(
                    run_id=run_id, index=index, model_dir=model_dir, model_files=model_files,
                    served_name=config.model.name, deployment=serving,
                    startup_timeout_s=config.launch.startup_timeout_s, dtype=config.inference_dtype(),
                    nice=config.generation_nice(),
                    weights_from_trainer=config.weight_transfer().direct,
                    lora=config.trainer.lora if config.inference.lora_adapters else None,
                    role=deployment.servers[index].role if config.inference.pd_pair() else None))
            urls = ray.get([actor.start.remote() for actor in actors])
        router = None
        prefill_url = urls[0] if config.inference.pd_pair() else None  # the plan's servers: prefill, then decode
        if deployment.router is not None and len(urls) > 1 and prefill_url is None:
            from agentrl.inference.router import VLLMRouter

            log_dir.mkdir(parents=True, exist_ok=True)
            router = VLLMRouter(urls, host=config.inference.host, policy=config.inference.router_policy,
                                extra_args=ROUTER_ARGS, log_path=log_dir / "router.log").start()
        nodes = ray.get([actor.node.remote() for actor in actors])
        return cls(actors, urls, router=router, nodes=nodes, updates_log=log_dir.parent / "weight_updates.jsonl",
                   prefill_url=prefill_url)

    async def load(self, version: int, *, path: str | None = None, files: Any = None) -> dict[str, Any]:
        """Every server serves `version` once this returns (the loads run in parallel, one per server); the
        update's record (`weight_updates.jsonl`'s line: each server's weight check and memory too)."""
        started = time.time()
        results = await asyncio.gather(*(actor.load_weights.remote(version, path=path, files=files)
                                         for actor in self.actors))
        line = {"version": version, "time": started, "load_s": time.time() - started,
                "served": {url: result.get("served_version") for url, result in zip(self.urls, results, strict=True)}}
        for key in ("checks", "memory"):
            merged = {url: part for result in results for url, part in (result.get(key) or {}).items()}
            if merged:
                line[key] = merged
        self._log_update(line)
        return line

    def _supervised(self) -> bool:
        """One `InferenceActor` per URL (single / replicas), not a wide-EP / P/D plan's node processes."""
        return len(self.actors) == len(self.urls) and all(
            hasattr(actor, "weight_state") for actor in self.actors)

    async def weight_states(self) -> list[dict[str, Any]]:
        """Per server: {"held", "restarts", "version"} (unsupervised node processes: never held)."""
        if not self._supervised():
            return [{"held": False, "restarts": 0, "version": None} for _ in self.urls]
        return list(await asyncio.gather(*(actor.weight_state.remote() for actor in self.actors)))

    async def went_down(self, within_s: float) -> bool:
        """After a direct push failed: did a server go down in the last `within_s` seconds (and is it back)?"""
        if not self._supervised():
            return False
        return any(await asyncio.gather(*(actor.went_down.remote(within_s) for actor in self.actors)))

    async def set_version(self, version: int, *, push: dict[str, Any] | None = None,
                          transport: str | None = None, restarts: list[int] | None = None,
                          urls: list[str] | None = None) -> None:
        """A direct transport delivered `version` to `urls` (None: every server); logged like a load.

        `push`: the trainer's timings (`total_s` and `update_s` as the publisher measured them,
        `push_s` with the gather); `restarts`: each server's restart count when the push began
        (a server restarted since then stays held, `InferenceActor.weights_delivered`).
        """
        started = time.time()
        targets = [index for index, url in enumerate(self.urls) if urls is None or url in urls]
        served: dict[str, Any] = {self.urls[index]: None for index in targets}
        if self._supervised():
            results = await asyncio.gather(*(self.actors[index].weights_delivered.remote(
                version, restarts=None if restarts is None else restarts[index]) for index in targets))
            served = {self.urls[index]: result.get("served_version")
                      for index, result in zip(targets, results, strict=True)}
        push = push or {}
        line = {"version": version, "time": started - float(push.get("push_s") or 0.0),
                "load_s": push.get("total_s"), "update_s": push.get("update_s"), "push_s": push.get("push_s"),
                "transport": transport, "served": served,
                **{key: push[key] for key in ("checks", "memory") if push.get(key)}}
        if urls is not None:
            line["resent"] = True  # a restarted server got the current version again
        self._log_update(line)

    def _log_update(self, line: dict[str, Any]) -> None:
        if self.updates_log is not None:
            with open(self.updates_log, "a") as handle:
                handle.write(json.dumps(line) + "\n")

    def server_pids(self) -> list[int | None]:
        """Each server's API-server pid on its node (it leads its own session: its process group)."""
        import ray

        return [ray.get(actor.server_pid.remote()) if hasattr(actor, "server_pid") else None for actor in self.actors]

    def save_logs(self, log_dir: Path) -> None:
        """Copy each server's log into the run folder (`logs/vllm-<i>.log`)."""
        import ray

        log_dir.mkdir(parents=True, exist_ok=True)
        for index, actor in enumerate(self.actors):
            try:
                text = ray.get(actor.log_text.remote(), timeout=30) if hasattr(actor, "log_text") else ""
            except Exception:  # noqa: BLE001 - a dead actor has no log to give
                continue
            (log_dir / f"vllm-{index}.log").write_text(text)

    def stop(self) -> None:
        import ray

        if self.router is not None:
            self.router.stop()
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - best effort: the actor may be gone already
                pass
