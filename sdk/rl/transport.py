"""How the trainer's weights reach every inference server after a step (`inference.weight_transfer`).

`WeightPush` is the orchestrator's `WeightSync`: `push(version)` returns once the trainer may
step again, with an awaitable that completes when every server serves `version`. Four
transports, one setting:

- `filesystem`: trainer rank 0 exports safetensors into the run folder's `weights/vN`, and
  every server reloads from that path (`/collective_rpc reload_weights`). For one machine,
  or nodes that share a disk at the same path.
- `object_store`: rank 0 exports into its node's own folder and hands the files back as a
  Ray object; each inference actor receives them, writes them into its node's folder and
  reloads from there. No shared filesystem; Ray moves the bytes node to node.
- `nccl`: every rank gathers the full tensors and rank 0 broadcasts them into vLLM's NCCL
  weight-transfer engine on every server (`NcclWeightPublisher`; GPUs, trainer and servers
  on different GPUs).
- `ipc`: CUDA IPC handles into vLLM's `ipc` engine, for a trainer sharing its GPU with the
  server (`IpcWeightPublisher`, GPUs).

With the first two the load runs in the inference actors while the trainer takes its next
step; the direct transports send from the trainer's memory, so `push` returns once sent.
Either way every server of the run holds the same version when the load completes.

A server restarted by its supervisor comes back with the run's starting weights. With the
folder transports its actor loads the latest version back before it serves. With `nccl` /
`ipc` there is no folder: the actor holds the server (paused, requests queued) and
`WeightPush.watch`, which the orchestrator runs beside the loop, has the trainer send the
version it pushed last again (`TrainerRank.resend_direct`), the restarted server's transfer
engine set up anew; when a step ran since that push, the next push (right after the step)
reaches the held server instead. A server that dies during a push fails it: the push waits
for the restart (the server comes back held) and pushes again (the trainer has not stepped).
A re-send or push that fails otherwise ends the run with one line naming the cause.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError
from agentrl.inference.weights import WeightUpdateError

__all__ = ["DIRECT_TRANSPORTS", "TRANSPORTS", "WeightPush", "direct_publisher", "update_metrics"]

TRANSPORTS = ("filesystem", "object_store", "nccl", "ipc")
DIRECT_TRANSPORTS = ("nccl", "ipc")


def direct_publisher(backend: str, urls: list[str], *, verify: bool = True):
    """The trainer-side publisher of a direct transport (built in trainer rank 0's process); `verify`: check each
    server's weights after every update (`inference.verify_weights`)."""
    from agentrl.inference import direct_weights

    if backend == "nccl":
        import ray

        from agentrl.inference.server import free_port

        address = ray.util.get_node_ip_address()
        publisher = direct_weights.NcclWeightPublisher(urls, master_address=address, master_port=free_port(address),
                                                workers_per_server=_world_size(urls[0]), verify=verify)
    elif backend == "ipc":
        publisher = direct_weights.IpcWeightPublisher(urls, verify=verify)
    else:
        raise ConfigError(f"inference.weight_transfer={backend!r} is not a direct transport; use nccl or ipc")
    publisher.connect()
    return publisher


def _world_size(url: str) -> int:
    """The number of workers behind one server (`/get_world_size`: the NCCL group's ranks after the trainer)."""
    import httpx

    response = httpx.get(f"{url.rstrip('/')}/get_world_size", params={"include_dp": "false"}, timeout=30.0)
    response.raise_for_status()
    return int(response.json()["world_size"])


def update_metrics(update: dict[str, Any]) -> dict[str, float]:
    """A step's metrics from one update's record (`checks` and `memory` per server, as `WeightPublisher` reports
    them): see `WeightPush.metrics`."""
    checks = update.get("checks") or {}
    metrics = {"weights/verified": float(bool(checks))}  # a publish checks every server it updates, or fails
    if checks:
        metrics["weights/check_error"] = max(float(check["max_error"]) for check in checks.values())
    used = [worker.get("process") or worker.get("reserved") for workers in (update.get("memory") or {}).values()
            for worker in workers if worker.get("device") == "cuda"]
    if any(value is not None for value in used):
        metrics["mem/inference_gib"] = max(value for value in used if value is not None) / 2**30
    return metrics


def _last_line(error: BaseException) -> str:
    """An error's last line (a Ray task error's is the cause: `module.Error: message`), at most 300 characters."""
    text = str(error).strip()
    return text.splitlines()[-1][:300] if text else type(error).__name__


class WeightPush:
    """`WeightSync` over a `TrainerGroup` and an `InferenceGroup` with one of the `TRANSPORTS`."""

    def __init__(self, trainer: Any, inference: Any, *, transport: str, staging_dir: Path,
                 watch_interval_s: float = 2.0, verify: bool = True) -> None:
        if transport not in TRANSPORTS:
            raise ConfigError(f"inference.weight_transfer={transport!r}: use one of {', '.join(TRANSPORTS)}")
        self.trainer = trainer
        self.inference = inference
        self.transport = transport
        self.staging_dir = staging_dir
        self.watch_interval_s = watch_interval_s
        self.verify = verify
        """Each server's weights are checked after every update (`inference.verify_weights`)."""
        self._report: dict[str, float] = {}  # the step metrics of the latest completed update
        self._lock = asyncio.Lock()  # a push and a re-send never overlap
        self._restarts: list[int] | None = None  # each server's restart count at the last direct delivery

    async def push(self, *, version: int) -> Any:
        if self.transport in DIRECT_TRANSPORTS:
            async with self._lock:
                await self._deliver(version)
            return None
        if self.transport == "filesystem":
            path = await self.trainer.export(version, dest=str(self.staging_dir / f"v{version}"), ship=False)
            return asyncio.ensure_future(self._load(version, path=path))
        files = await self.trainer.export_ref(version)  # an ObjectRef: the bytes never pass through the driver
        return asyncio.ensure_future(self._load(version, files=files))

    async def _load(self, version: int, **source: Any) -> None:
        self._report = update_metrics(await self.inference.load(version, **source) or {})

    def metrics(self) -> dict[str, float]:
        """Step metrics of the latest completed update: `weights/verified` (1 when every server's weights were
        checked equal to the trainer's, 0 when not checked), `weights/check_error` (the largest difference over
        its tolerance; below 1 passes), `mem/inference_gib` (the largest server's GPU memory after it, GPUs)."""
        return dict(self._report)

    def _restarted(self, states: list[dict[str, Any]], since: list[int] | None = None) -> list[str]:
        """The servers restarted since the last delivery, or since `since` (their transfer engine must be set up
        again); none before the first delivery, which connects every server."""
        before = self._restarts if self._restarts is not None else since
        if before is None:
            return []
        return [url for url, state, count in zip(self.inference.urls, states, before, strict=True)
                if state["restarts"] != count]

    async def _deliver(self, version: int, *, attempts: int = 3) -> None:
        """Push `version` to every server; a server that dies during the push is waited for and pushed to again.

        The trainer has not stepped since (the push is part of the step), so its weights are
        still `version`: the retry sends them once the restarted server is back (held), its
        transfer engine set up again. A push that fails otherwise ends the run in one line.
        """
        first: list[int] | None = None  # restart counts at the first attempt
        for attempt in range(attempts):
            states = await self.inference.weight_states()
            first = first or [state["restarts"] for state in states]
            started = time.monotonic()
            try:
                timings = await self.trainer.push_direct(version, urls=self.inference.urls, backend=self.transport,
                                                         reconnect=self._restarted(states, first), verify=self.verify)
                break
            except Exception as error:  # noqa: BLE001 - a restart is retried, anything else is one line
                if attempt == attempts - 1 or not await self.inference.went_down(time.monotonic() - started):
                    raise WeightUpdateError(f"pushing version {version} through {self.transport} failed: "
                                            f"{_last_line(error)}") from None
        self._restarts = [state["restarts"] for state in states]
        self._report = update_metrics(timings)
        await self.inference.set_version(version, push=timings, transport=self.transport,
                                         restarts=self._restarts)

    async def watch(self) -> None:
        """Between pushes, send the current version again to servers restarted after it (direct transports).

        A restarted server under `nccl` / `ipc` starts from the run's starting weights, with no
        folder to read the current ones from; its `InferenceActor` holds it (paused, requests
        queued) and this re-sends from the trainer. When a step ran since the last push the
        trainer no longer has that version and the next push (right after the step) reaches
        the held server instead. Runs until cancelled (the orchestrator runs it beside the loop);
        a re-send that fails ends the run with the reason.
        """
        if self.transport not in DIRECT_TRANSPORTS:
            return  # the inference actors restore the latest folder themselves
        while True:
            await asyncio.sleep(self.watch_interval_s)
            async with self._lock:
                states = await self.inference.weight_states()
                held = [url for url, state in zip(self.inference.urls, states, strict=True) if state["held"]]
                if not held or self._restarts is None:
                    continue
                try:
                    timings = await self.trainer.resend_direct(held)  # their engines are set up again
                except Exception as error:  # noqa: BLE001 - the run stops with this one line
                    raise WeightUpdateError(
                        f"inference server(s) {', '.join(held)} restarted and the trainer could not send "
                        f"them the current weights through {self.transport}: {_last_line(error)}") from None
                if timings is None:
                    continue  # a step ran since the last push: the next push delivers to the held servers
                self._restarts = [state["restarts"] for state in states]
                await self.inference.set_version(timings["version"], push=timings, transport=self.transport,
                                                 restarts=self._restarts, urls=held)
