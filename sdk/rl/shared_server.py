"""`SharedServer`: a run's inference on a vLLM server other runs share (`inference.base_url`), in place of its own.

Several LoRA runs of one base model can share one server: `agentrl serve --lora` starts it, and each
`agentrl train --set inference.base_url=URL` run trains its own adapter and serves it there by name.
The run starts no inference actor; this object stands where `groups.InferenceGroup` stands for the
orchestrator and the weight transport (`endpoint`, `urls`, `load`, `save_logs`, `stop`):

- `load(version, path=...)` loads the adapter folder the trainer exported for `version` under a name
  of its own (`lora_serving.SharedAdapterPublisher`: `<run>-v<N>`, no pause, the server's weight version
  untouched), checks it, then has every rollout worker name it from then on (`RolloutWorker.use_adapter`):
  the tokens of a request are of the version its adapter was published as, so the staleness rule holds
  per run whatever the other runs publish;
- `stop` unloads this run's adapters; the server keeps running for the others.

`check_shared_server` gives the one-line errors before any slow start-up: nothing answers at the URL, the server
has no agentrl worker methods, or it computes in another dtype than the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError

__all__ = ["SharedServer", "check_shared_server"]


def check_shared_server(url: str, *, dtype: str, model_dir: Path, timeout_s: float = 10.0) -> None:
    """One-line errors unless a server started for sharing answers at `url`, serves the run's starting weights
    `model_dir` as its base (the adapters are trained on them) and computes in `dtype` (the run's inference
    dtype: a trainer in float32 against a server in bfloat16 would fail every adapter check)."""
    import httpx

    base = url.rstrip("/")
    try:
        response = httpx.get(f"{base}/health", timeout=timeout_s)
        said = None if response.status_code == 200 else f"answered {response.status_code}"
    except httpx.HTTPError as error:
        said = f"{type(error).__name__}"
    if said is not None:
        raise AgentrlError(f"inference.base_url: no server answers at {url} ({said}); start one with "
                           "`agentrl serve --model MODEL --lora RANK` and pass the URL it prints")
    try:
        roots = [entry.get("root") for entry in httpx.get(f"{base}/v1/models", timeout=timeout_s).json()["data"]
                 if not entry.get("parent")]  # the base model; adapters name it as their parent
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        roots = []
    wanted = Path(model_dir).resolve()
    if not any(root and Path(root).resolve() == wanted for root in roots):
        raise AgentrlError(f"inference.base_url: the server at {url} serves {roots[0] if roots else 'an unknown model'}"
                           f", this run starts from {wanted}; start it with `agentrl serve --model {wanted} --lora "
                           "RANK` (every run sharing it starts from the same weights)")
    try:
        response = httpx.post(f"{base}/collective_rpc", json={"method": "agentrl_model_dtype"}, timeout=timeout_s)
        served = response.json()["results"][0] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        served = None
    if served is None:
        raise AgentrlError(f"inference.base_url: the server at {url} has no agentrl worker methods (it checks each "
                           "adapter it loads); start it with `agentrl serve --model MODEL --lora RANK`")
    if served != dtype:
        raise AgentrlError(f"inference.base_url: the server at {url} computes in {served}, this run in {dtype}; "
                           f"start it with `agentrl serve ... --lora RANK --dtype {dtype}` or set inference.dtype")


class SharedServer:
    """The run's side of a shared server: adapters loaded per version, workers told which to name."""

    def __init__(self, url: str, *, run: str, staging_dir: Path, keep: int, verify: bool,
                 updates_log: Path | None = None) -> None:
        from agentrl.inference.lora_serving import SharedAdapterPublisher

        self.url = url.rstrip("/")
        self.urls = [self.url]
        self.nodes: list[str] = []
        self.actors: list[Any] = []
        self.router = None
        self.workers: list[Any] = []
        """The run's rollout workers (set once they exist): told the adapter of each new version."""
        self.publisher = SharedAdapterPublisher(self.url, run=run, staging_dir=staging_dir, keep=keep, verify=verify)
        self.updates_log = updates_log

    @property
    def endpoint(self) -> str:
        return self.url

    async def load(self, version: int, *, path: str | None = None, files: Any = None) -> dict[str, Any]:
        """The server holds `version`'s adapter and every worker names it once this returns; the update's record."""
        if path is None:
            raise AgentrlError("inference.base_url: a shared server loads adapters from a folder it can read; "
                               "set inference.weight_transfer = \"filesystem\"")
        started = time.time()
        result = await self.publisher.apublish(path, version)
        name = self.publisher.name_for(version)
        await asyncio.gather(*(worker.use_adapter.remote(name, version) for worker in self.workers))
        line = {"version": version, "time": started, "load_s": time.time() - started, "adapter": name,
                "served": {self.url: name}}
        if result.checks:
            line["checks"] = {url: check.model_dump() for url, check in result.checks.items()}
        if self.updates_log is not None:
            with open(self.updates_log, "a") as handle:
                handle.write(json.dumps(line) + "\n")
        return line

    def server_pids(self) -> list[int | None]:
        return [None]  # not this run's process

    def save_logs(self, log_dir: Path) -> None:
        """Nothing to copy: the shared server's log belongs to whoever started it."""

    def stop(self) -> None:
        """Unload this run's adapters (best effort: the server may be gone)."""
        from agentrl.inference.server_control import server_controls

        async def unload() -> None:
            async with server_controls([self.url], timeout_s=30.0) as (control,):
                for version in list(self.publisher.loaded):
                    await self.publisher.unload(control, version)
                    self.publisher.loaded.remove(version)

        try:
            asyncio.run(unload())
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
