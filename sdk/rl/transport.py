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
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError

__all__ = ["TRANSPORTS", "WeightPush", "direct_publisher"]

TRANSPORTS = ("filesystem", "object_store", "nccl", "ipc")


def direct_publisher(backend: str, urls: list[str]):
    """The trainer-side publisher of a direct transport (built in trainer rank 0's process)."""
    from agentrl.inference import weights

    if backend == "nccl":
        import ray

        from agentrl.inference.server import free_port

        address = ray.util.get_node_ip_address()
        publisher = weights.NcclWeightPublisher(urls, master_address=address, master_port=free_port(address),
                                                workers_per_server=_world_size(urls[0]))
    elif backend == "ipc":
        publisher = weights.IpcWeightPublisher(urls)
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


class WeightPush:
    """`WeightSync` over a `TrainerGroup` and an `InferenceGroup` with one of the `TRANSPORTS`."""

    def __init__(self, trainer: Any, inference: Any, *, transport: str, staging_dir: Path) -> None:
        if transport not in TRANSPORTS:
            raise ConfigError(f"inference.weight_transfer={transport!r}: use one of {', '.join(TRANSPORTS)}")
        self.trainer = trainer
        self.inference = inference
        self.transport = transport
        self.staging_dir = staging_dir

    async def push(self, *, version: int) -> Any:
        if self.transport in ("nccl", "ipc"):
            await self.trainer.push_direct(version, urls=self.inference.urls, backend=self.transport)
            await self.inference.set_version(version)
            return None
        if self.transport == "filesystem":
            path = await self.trainer.export(version, dest=str(self.staging_dir / f"v{version}"), ship=False)
            return asyncio.ensure_future(self.inference.load(version, path=path))
        files = await self.trainer.export_ref(version)  # an ObjectRef: the bytes never pass through the driver
        return asyncio.ensure_future(self.inference.load(version, files=files))
