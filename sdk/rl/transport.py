"""`WeightPush`, the orchestrator's `WeightSync`: the run's weight transport over its trainer and servers.

`push(version)` returns once the trainer may step again, with an awaitable that completes when
every server serves `version`; `watch()` runs beside the loop (re-sends to restarted servers
under the direct transports). How each transport does both is its class in
`agentrl.inference.transfer` (the one table of them); this holds what they work on (the
trainer and inference groups, the run folder's ``weights/``, the lock and restart counts of
the direct ones) and turns each update's record into the step's metrics (`update_metrics`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from agentrl.inference.transfer import WeightTransport

__all__ = ["WeightPush", "update_metrics"]


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


class WeightPush:
    """`WeightSync` over a `TrainerGroup` and an `InferenceGroup` with one `WeightTransport` (a `transfer.Delivery`)."""

    def __init__(self, trainer: Any, inference: Any, *, transport: WeightTransport, staging_dir: Path,
                 watch_interval_s: float = 2.0, verify: bool = True, push_at_start: bool = False) -> None:
        self.trainer = trainer
        self.inference = inference
        self.transport = transport
        self.staging_dir = staging_dir
        self.watch_interval_s = watch_interval_s
        self.verify = verify
        """Each server's weights are checked after every update (`inference.verify_weights`)."""
        self.push_at_start = push_at_start
        """The servers serve nothing of the policy before a push (a LoRA adapter loaded by name): the run pushes
        its starting version before the first step."""
        self.lock = asyncio.Lock()  # a push and a re-send never overlap
        self.restarts: list[int] | None = None  # each server's restart count at the last direct delivery
        self._report: dict[str, float] = {}  # the step metrics of the latest completed update

    async def push(self, *, version: int) -> Any:
        return await self.transport.push(self, version)

    async def watch(self) -> None:
        """Between pushes, what the transport does (direct transports: re-send to restarted servers)."""
        await self.transport.watch(self)

    def record(self, update: dict[str, Any]) -> None:
        self._report = update_metrics(update)

    def metrics(self) -> dict[str, float]:
        """Step metrics of the latest completed update: `weights/verified` (1 when every server's weights were
        checked equal to the trainer's, 0 when not checked), `weights/check_error` (the largest difference over
        its tolerance; below 1 passes), `mem/inference_gib` (the largest server's GPU memory after it, GPUs)."""
        return dict(self._report)
