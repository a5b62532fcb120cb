"""The weight transports: how the trainer's weights reach every inference server after a step, one class each.

`TRANSPORTS` is the one table (``inference.weight_transfer`` names a row) and `transport_for` the
one default rule (nccl with GPU inference, filesystem on the CPU). Each class carries the vLLM
arguments its servers need (`vllm_args`), how a version is pushed (`push`) and what runs between
pushes (`watch`); the direct ones also build the trainer-side publisher (`publisher`, in trainer
rank 0's process). `push` and `watch` work on the run's trainer and servers through `Delivery`
(`agentrl.rl.transport.WeightPush` holds them, the orchestrator's `WeightSync`):

- `Filesystem`: trainer rank 0 exports safetensors into the run folder's ``weights/vN``, and
  every server reloads from that path (``/collective_rpc reload_weights``). For one machine,
  or nodes that share a disk at the same path.
- `ObjectStore`: rank 0 exports into its node's own folder and hands the files back as a Ray
  object; each inference actor receives them, writes them into its node's folder and reloads
  from there. No shared filesystem; Ray moves the bytes node to node.
- `Nccl`: every rank gathers the full tensors and rank 0 broadcasts them into vLLM's NCCL
  weight-transfer engine on every server (`direct_weights.NcclWeightPublisher`; GPUs, trainer
  and servers on different GPUs).
- `Ipc`: CUDA IPC handles into vLLM's ``ipc`` engine, for a trainer sharing its GPU with the
  server (`direct_weights.IpcWeightPublisher`, GPUs).

With the folder transports the load runs in the inference actors while the trainer takes its
next step; the direct transports send from the trainer's memory, so `push` returns once sent.
Either way every server of the run holds the same version when the load completes.

A server restarted by its supervisor comes back with the run's starting weights. With the
folder transports its actor loads the latest version back before it serves. With `Nccl` /
`Ipc` there is no folder: the actor holds the server (paused, requests queued) and `watch`,
which the orchestrator runs beside the loop, has the trainer send the version it pushed last
again (``TrainerRank.resend_direct``), the restarted server's transfer engine set up anew; when
a step ran since that push, the next push (right after the step) reaches the held server
instead. A server that dies during a push fails it: the push waits for the restart (the server
comes back held) and pushes again (the trainer has not stepped). A re-send or push that fails
otherwise ends the run with one line naming the cause.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from agentrl.errors import ConfigError, WeightUpdateError

if TYPE_CHECKING:
    from agentrl.inference.weights import WeightPublisher

__all__ = ["TRANSPORTS", "TransportName", "WeightTransport", "Filesystem", "ObjectStore", "Nccl", "Ipc",
           "Delivery", "transport_for"]


class Delivery(Protocol):
    """What `push` and `watch` work on: the run's trainer ranks and servers (`agentrl.rl.groups`) and the
    state of the last update (`agentrl.rl.transport.WeightPush`)."""

    trainer: Any
    """`TrainerGroup`: ``export``, ``export_ref``, ``push_direct``, ``resend_direct`` on every rank."""
    inference: Any
    """`InferenceGroup`: ``urls``, ``load``, ``weight_states``, ``went_down``, ``set_version``."""
    staging_dir: Path
    """The run folder's ``weights/`` (`Filesystem`'s versions)."""
    verify: bool
    """Check every server's weights after each update (``inference.verify_weights``)."""
    watch_interval_s: float
    lock: asyncio.Lock
    """A direct push and a re-send never overlap."""
    restarts: list[int] | None
    """Each server's restart count at the last direct delivery (None before the first)."""

    def record(self, update: dict[str, Any]) -> None:
        """Keep one update's record (checks, memory) for the step's metrics."""


class WeightTransport:
    """One way the weights travel (a row of `TRANSPORTS`); compares equal to another of its class."""

    name: ClassVar[str]
    """The ``inference.weight_transfer`` value."""
    direct: ClassVar[bool] = False
    """The trainer sends from its memory into vLLM's weight-transfer engine (no folder; a restarted server waits
    for the trainer to send again)."""
    trainer_buffer_gib: ClassVar[float] = 0.0
    """GPU memory the trainer holds for the transport beyond its step (a colocated run's plan counts it)."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    kernel_format = False
    """Send the served layout instead of checkpoint names (`inference.weight_format = "kernel"`; ipc only)."""

    def vllm_args(self, *, device: str) -> tuple[list[str], dict[str, str]]:
        """The server flags and environment this transport needs (none for the folder transports)."""
        return [], {}

    def publisher(self, urls: list[str], *, verify: bool = True) -> WeightPublisher:
        """The trainer-side publisher, connected to every server (direct transports only)."""
        raise ConfigError(f"inference.weight_transfer={self.name!r} is not a direct transport; use nccl or ipc")

    async def push(self, run: Delivery, version: int) -> Awaitable[None] | None:
        """Deliver `version` to every server; returns once the trainer may step again, with an awaitable that
        completes when every server serves `version` (None: already served)."""
        raise NotImplementedError

    async def watch(self, run: Delivery) -> None:
        """Runs beside the loop until cancelled; nothing for the folder transports (their actors restore the
        latest folder themselves)."""
        return None


class Filesystem(WeightTransport):
    """Rank 0 exports into the run folder's ``weights/vN``; every server reloads from that path."""

    name = "filesystem"

    async def push(self, run: Delivery, version: int) -> Awaitable[None] | None:
        path = await run.trainer.export(version, dest=str(run.staging_dir / f"v{version}"), ship=False)
        return asyncio.ensure_future(_load(run, version, path=path))


class ObjectStore(WeightTransport):
    """Rank 0 exports on its node and hands the files to Ray; each server's actor writes them on its node."""

    name = "object_store"

    async def push(self, run: Delivery, version: int) -> Awaitable[None] | None:
        files = await run.trainer.export_ref(version)  # an ObjectRef: the bytes never pass through the driver
        return asyncio.ensure_future(_load(run, version, files=files))


async def _load(run: Delivery, version: int, **source: Any) -> None:
    run.record(await run.inference.load(version, **source) or {})


class _Direct(WeightTransport):
    """What the direct transports share: the engine flag, the push with its retry, the re-send watch."""

    direct = True

    def vllm_args(self, *, device: str) -> tuple[list[str], dict[str, str]]:
        if device == "cpu":
            raise ConfigError(f"deployment.weight_transfer {self.name!r} needs GPUs; use 'filesystem' or "
                              "'object_store' on the CPU")
        return ["--weight-transfer-config", json.dumps({"backend": self.name})], {}

    async def push(self, run: Delivery, version: int) -> Awaitable[None] | None:
        async with run.lock:
            await self._deliver(run, version)
        return None

    def _restarted(self, run: Delivery, states: list[dict[str, Any]], since: list[int] | None = None) -> list[str]:
        """The servers restarted since the last delivery, or since `since` (their transfer engine must be set up
        again); none before the first delivery, which connects every server."""
        before = run.restarts if run.restarts is not None else since
        if before is None:
            return []
        return [url for url, state, count in zip(run.inference.urls, states, before, strict=True)
                if state["restarts"] != count]

    async def _deliver(self, run: Delivery, version: int, *, attempts: int = 3) -> None:
        """Push `version` to every server; a server that dies during the push is waited for and pushed to again.

        The trainer has not stepped since (the push is part of the step), so its weights are
        still `version`: the retry sends them once the restarted server is back (held), its
        transfer engine set up again. A push that fails otherwise ends the run in one line.
        """
        first: list[int] | None = None  # restart counts at the first attempt
        for attempt in range(attempts):
            states = await run.inference.weight_states()
            first = first or [state["restarts"] for state in states]
            started = time.monotonic()
            try:
                timings = await run.trainer.push_direct(version, urls=run.inference.urls, transport=self,
                                                        reconnect=self._restarted(run, states, first),
                                                        verify=run.verify)
                break
            except Exception as error:  # noqa: BLE001 - a restart is retried, anything else is one line
                if attempt == attempts - 1 or not await run.inference.went_down(time.monotonic() - started):
                    raise WeightUpdateError(f"pushing version {version} through {self.name} failed: "
                                            f"{_last_line(error)}") from None
        run.restarts = [state["restarts"] for state in states]
        run.record(timings)
        await run.inference.set_version(version, push=timings, transport=self.name, restarts=run.restarts)

    async def watch(self, run: Delivery) -> None:
        """Between pushes, send the current version again to servers restarted after it.

        A restarted server starts from the run's starting weights, with no folder to read the
        current ones from; its `InferenceActor` holds it (paused, requests queued) and this
        re-sends from the trainer. When a step ran since the last push the trainer no longer has
        that version and the next push (right after the step) reaches the held server instead.
        A re-send that fails ends the run with the reason.
        """
        while True:
            await asyncio.sleep(run.watch_interval_s)
            async with run.lock:
                states = await run.inference.weight_states()
                held = [url for url, state in zip(run.inference.urls, states, strict=True) if state["held"]]
                if not held or run.restarts is None:
                    continue
                try:
                    timings = await run.trainer.resend_direct(held)  # their engines are set up again
                except Exception as error:  # noqa: BLE001 - the run stops with this one line
                    raise WeightUpdateError(
                        f"inference server(s) {', '.join(held)} restarted and the trainer could not send "
                        f"them the current weights through {self.name}: {_last_line(error)}") from None
                if timings is None:
                    continue  # a step ran since the last push: the next push delivers to the held servers
                run.restarts = [state["restarts"] for state in states]
                await run.inference.set_version(timings["version"], push=timings, transport=self.name,
                                                restarts=run.restarts, urls=held)


class Nccl(_Direct):
    """Trainer rank 0 broadcasts into vLLM's NCCL weight-transfer engine (trainer and servers on other GPUs)."""

    name = "nccl"

    def publisher(self, urls: list[str], *, verify: bool = True) -> WeightPublisher:
        import ray

        from agentrl.inference.direct_weights import NcclWeightPublisher  # httpx and vLLM's routes: rank 0 only
        from agentrl.inference.server import free_port

        address = ray.util.get_node_ip_address()
        publisher = NcclWeightPublisher(urls, master_address=address, master_port=free_port(address),
                                        workers_per_server=_world_size(urls[0]), verify=verify)
        publisher.connect()
        return publisher


class Ipc(_Direct):
    """CUDA IPC handles into vLLM's ``ipc`` engine (a trainer sharing the server's GPU)."""

    name = "ipc"
    trainer_buffer_gib = 1.0
    """The packed CUDA IPC buffer the trainer fills per chunk (`IpcWeightPublisher.chunk_bytes`)."""

    def vllm_args(self, *, device: str) -> tuple[list[str], dict[str, str]]:
        args, env = super().vllm_args(device=device)
        return args, {**env, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the engine unpickles CUDA IPC handles

    def publisher(self, urls: list[str], *, verify: bool = True) -> WeightPublisher:
        from agentrl.inference.direct_weights import IpcWeightPublisher  # httpx and vLLM's routes: rank 0 only

        publisher = IpcWeightPublisher(urls, verify=verify, kernel_format=self.kernel_format)
        publisher.connect()
        return publisher


TRANSPORTS: dict[str, type[WeightTransport]] = {kind.name: kind for kind in (Filesystem, ObjectStore, Nccl, Ipc)}
"""``inference.weight_transfer`` -> its transport: the one list of them."""

TransportName = Literal[tuple(TRANSPORTS)]  # type: ignore[valid-type]
"""The ``inference.weight_transfer`` values, for config fields."""


def transport_for(name: str | None, *, device: str) -> WeightTransport:
    """The transport ``name`` (None: nccl with GPU inference, filesystem on the CPU), or a one-line error."""
    name = name or ("nccl" if device == "gpu" else "filesystem")
    if name not in TRANSPORTS:
        raise ConfigError(f"inference.weight_transfer={name!r}: use one of {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]()


def _world_size(url: str) -> int:
    """The number of workers behind one server (``/get_world_size``: the NCCL group's ranks after the trainer)."""
    import httpx

    response = httpx.get(f"{url.rstrip('/')}/get_world_size", params={"include_dp": "false"}, timeout=30.0)
    response.raise_for_status()
    return int(response.json()["world_size"])


def _last_line(error: BaseException) -> str:
    """An error's last line (a Ray task error's is the cause: ``module.Error: message``), at most 300 characters."""
    text = str(error).strip()
    return text.splitlines()[-1][:300] if text else type(error).__name__
