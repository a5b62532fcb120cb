"""The RL control endpoints of a running vLLM server, one client per update.

`ServerControl` wraps what agentrl asks a server between generations: pause and resume
(`VLLM_SERVER_DEV_MODE=1`), the weight version, reloads from a checkpoint folder, and the
calls into agentrl's worker extension (`vllm_worker_ext`: weight digests, memory, dtype).
`server_controls(urls)` opens them over one HTTP client; the publishers in `weights` and
`direct_weights`, LoRA serving and the inference actor use them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from agentrl.clients.http_pool import shared_ssl_context
from agentrl.errors import WeightUpdateError
from agentrl.inference.vllm_worker_ext import EXTENSION
from agentrl.inference.weight_check import merge_worker_digests

__all__ = ["ServerControl", "server_controls"]


class ServerControl:
    """The RL control endpoints of one vLLM server (`VLLM_SERVER_DEV_MODE=1`)."""

    def __init__(self, url: str, *, client: httpx.AsyncClient, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._client = client
        self.timeout_s = timeout_s

    async def _post(self, path: str, *, what: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._client.post(f"{self.url}{path}", timeout=self.timeout_s, **kwargs)
        except httpx.HTTPError as error:
            raise WeightUpdateError(f"{what} on {self.url}: {type(error).__name__}: {error}") from None
        if response.status_code == 404:
            raise WeightUpdateError(
                f"{what} on {self.url}: {path} not found; start the server with VLLM_SERVER_DEV_MODE=1"
            )
        if response.status_code >= 400:
            detail = " ".join(response.text.split())[:300]
            raise WeightUpdateError(f"{what} on {self.url} failed (HTTP {response.status_code}): {detail}")
        return response

    async def pause(self, *, mode: str = "keep", clear_cache: bool = False) -> None:
        """Pause generation; 'keep' freezes requests in flight until resume.

        ``clear_cache`` drops the KV and prefix caches, so running requests are recomputed on resume.
        """
        await self._post("/pause", what="pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    async def resume(self) -> None:
        await self._post("/resume", what="resume")

    async def is_paused(self) -> bool:
        response = await self._client.get(f"{self.url}/is_paused", timeout=self.timeout_s)
        return bool(response.json()["is_paused"])

    async def kv_role(self) -> str | None:
        """The role of the server's KV connector (`kv_producer`, `kv_consumer`, `kv_both`; `/server_info`, a
        development-mode route), None without a connector or when the server does not say."""
        try:
            response = await self._client.get(f"{self.url}/server_info", params={"config_format": "json"},
                                              timeout=self.timeout_s)
            if response.status_code != 200:
                return None
            transfer = response.json()["vllm_config"].get("kv_transfer_config")
            return str(transfer["kv_role"]) if isinstance(transfer, dict) and transfer.get("kv_role") else None
        except (httpx.HTTPError, ValueError, KeyError, AttributeError, TypeError):
            return None

    async def vllm_version(self) -> str | None:
        """The server's vLLM version (`/version`), None when it does not say."""
        try:
            response = await self._client.get(f"{self.url}/version", timeout=self.timeout_s)
            return str(response.json().get("version")) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    async def weight_version(self) -> str:
        """The version the server reports for newly generated tokens."""
        try:
            response = await self._client.get(f"{self.url}/weight_info", timeout=self.timeout_s)
            response.raise_for_status()
        except httpx.HTTPError as error:
            raise WeightUpdateError(f"weight_info on {self.url}: {error}") from None
        return str(response.json()["weight_version"])

    async def model_root(self) -> str | None:
        """The model path the server was started with (`/v1/models` root), if it answers."""
        try:
            response = await self._client.get(f"{self.url}/v1/models", timeout=self.timeout_s)
            response.raise_for_status()
            data = response.json().get("data") or []
        except (httpx.HTTPError, ValueError):
            return None
        return (data[0].get("root") or data[0].get("id")) if data else None

    async def set_weight_version(self, version: int | str) -> None:
        await self._post("/update_weight_version", what="update_weight_version", json={"new_version": str(version)})

    async def worker_call(self, method: str, **kwargs: str) -> list[Any]:
        """Call agentrl's worker extension method `method` on every worker (`/collective_rpc`); one result each.

        The server must run with `--worker-extension-cls` `vllm_worker_ext.EXTENSION` (agentrl's plans set it).
        """
        response = await self._post("/collective_rpc", what=method, json={"method": method, "kwargs": kwargs})
        try:
            results = response.json()["results"]
        except (ValueError, KeyError, TypeError):
            results = None
        if not isinstance(results, list) or not all(isinstance(result, dict) for result in results):
            raise WeightUpdateError(f"{method} on {self.url}: the server answered {response.text[:200]!r}; start it"
                                    f" with --worker-extension-cls {EXTENSION}, or set inference.verify_weights ="
                                    " false")
        return results

    async def model_dtype(self) -> str:
        """The dtype the server computes in, and holds LoRA adapters in ("bfloat16", "float32", ...)."""
        response = await self._post("/collective_rpc", what="agentrl_model_dtype",
                                    json={"method": "agentrl_model_dtype", "kwargs": {}})
        try:
            return str(response.json()["results"][0])
        except (ValueError, KeyError, IndexError, TypeError):
            raise WeightUpdateError(f"agentrl_model_dtype on {self.url}: the server answered {response.text[:200]!r};"
                                    f" start it with --worker-extension-cls {EXTENSION}") from None

    async def weight_digest(self) -> dict[str, list[Any]]:
        """The served parameters' digest (`vllm_worker_ext`), the workers' shards merged."""
        return merge_worker_digests(await self.worker_call("agentrl_weight_digest"))

    async def memory(self, *, release: bool = False) -> list[dict[str, Any]]:
        """Each worker's GPU memory (`vllm_worker_ext.WorkerChecks.agentrl_memory`); `release` empties its
        allocator's cache first."""
        return await self.worker_call("agentrl_memory", release=str(release).lower())

    async def reload_from_path(self, path: str | Path) -> None:
        """Load an HF safetensors checkpoint folder into the running model, in place."""
        await self._post(
            "/collective_rpc",
            what=f"reload_weights from {path}",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
        )


@contextlib.asynccontextmanager
async def server_controls(urls: list[str], *, timeout_s: float) -> AsyncIterator[list[ServerControl]]:
    """`ServerControl`s of `urls` over one HTTP client, closed on exit (the one way they are opened)."""
    async with httpx.AsyncClient(verify=shared_ssl_context()) as client:
        yield [ServerControl(url, client=client, timeout_s=timeout_s) for url in urls]
