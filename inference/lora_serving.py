"""LoRA adapters in running vLLM servers: the servers' flags, and the adapter replaced in place after a step.

A LoRA run (`trainer.lora`) trains adapters of a few megabytes on a frozen base. vLLM serves the
base with `--enable-lora` and the adapter by name: a request whose `model` is the adapter's name
(`ADAPTER_NAME`) runs base plus adapter, with routed experts returned as for the base.

- `lora_server_options(lora, device=...)`: the flags and environment (`--enable-lora`, the rank
  rounded up to one vLLM accepts, one adapter slot, the target modules vLLM names:
  `qkv_proj`/`o_proj` for attention, `gate_up_proj`/`down_proj` for the shared experts, `experts`
  for the routed ones; `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, which enables the load endpoint).
  Routed-expert adapters are refused for CPU servers in one line: vLLM runs MoE LoRA only in its
  Triton/CUDA kernels (`vllm_plugin.cpu_lora_moe` keeps the CPU experts kernel for the rest).
- `AdapterPublisher(urls, staging_dir=...)`: `publish(adapter_folder, version)` copies a PEFT
  folder (`Trainer.export_adapter`) to `staging_dir/v<version>` and has every server load it
  under `ADAPTER_NAME` (`POST /v1/load_lora_adapter`; after the first version with
  `load_inplace`, which replaces the weights of the adapter of that name: requests already
  running finish with the adapter they started with, new ones get the new one). Each version
  has its own folder, since vLLM caches adapters by path; the last `keep_last` are kept.

torch-free; the HTTP calls go through httpx.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx

from agentrl.errors import AgentrlError, ConfigError

__all__ = ["ADAPTER_NAME", "VLLM_LORA_RANKS", "AdapterPublisher", "AdapterUpdateError", "lora_server_options",
           "vllm_lora_modules"]

ADAPTER_NAME = "policy-lora"
"""The name the servers load the run's adapter under; requests name it as their `model`."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts."""

_MODULES = {"attention": ("qkv_proj", "o_proj"), "shared_experts": ("gate_up_proj", "down_proj"),
            "experts": ("experts",)}


class AdapterUpdateError(AgentrlError):
    """A server did not take the new adapter."""


def vllm_lora_modules(targets: list[str]) -> list[str]:
    """vLLM's `--lora-target-modules` names for agentrl's `trainer.lora.targets`."""
    unknown = [target for target in targets if target not in _MODULES]
    if unknown:
        raise ConfigError(f"trainer.lora.targets: {unknown[0]!r} is not one of {', '.join(_MODULES)}")
    return list(dict.fromkeys(name for target in targets for name in _MODULES[target]))


def lora_server_options(lora: object, *, device: str) -> tuple[list[str], dict[str, str]]:
    """Extra vLLM flags and environment of a server that serves `lora`'s adapters (a `LoraConfig`)."""
    targets = list(lora.targets)
    rank = int(lora.rank)
    if device == "cpu" and "experts" in targets:
        raise ConfigError("trainer.lora.targets: vLLM serves adapters on routed experts only on GPUs (its MoE LoRA"
                          " runs in Triton/CUDA kernels); on the CPU leave out \"experts\" or serve merged weights"
                          " (a LoRA run pushes merged weights by default)")
    slot = next((size for size in VLLM_LORA_RANKS if size >= rank), None)
    if slot is None:
        raise ConfigError(f"trainer.lora.rank {rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
    args = ["--enable-lora", "--max-lora-rank", str(slot), "--max-loras", "1",
            "--lora-target-modules", *vllm_lora_modules(targets)]
    return args, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


class AdapterPublisher:
    """Replaces the adapter `ADAPTER_NAME` in running servers with each new version's PEFT folder."""

    def __init__(self, urls: list[str], *, staging_dir: str | Path, keep_last: int = 2, timeout_s: float = 120.0,
                 name: str = ADAPTER_NAME) -> None:
        self.urls = list(urls)
        self.staging_dir = Path(staging_dir)
        self.keep_last = max(1, keep_last)
        self.timeout_s = timeout_s
        self.name = name
        self.version: int | None = None
        self._loaded: set[str] = set()  # servers that hold the adapter already (later loads replace it in place)

    def publish(self, adapter_dir: str | Path, version: int) -> float:
        """Stage `adapter_dir` as `version` and load it into every server; the seconds the loads took."""
        source = Path(adapter_dir)
        if not (source / "adapter_config.json").is_file():
            raise AdapterUpdateError(f"publish: {source} has no adapter_config.json; pass a PEFT adapter folder"
                                     " (Trainer.export_adapter)")
        if self.version is not None and version <= self.version:
            raise AdapterUpdateError(f"publish: version {version} is not newer than the served {self.version}")
        folder = self.staging_dir / f"v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(source, folder)
        started = time.monotonic()
        with httpx.Client(timeout=self.timeout_s) as client:
            for url in self.urls:
                self._load(client, url, folder)
        took = time.monotonic() - started
        self.version = version
        self._prune()
        return took

    def _load(self, client: httpx.Client, url: str, folder: Path) -> None:
        body = {"lora_name": self.name, "lora_path": str(folder)}
        if url in self._loaded:
            body["load_inplace"] = True
        try:
            response = client.post(f"{url}/v1/load_lora_adapter", json=body)
        except httpx.HTTPError as error:
            raise AdapterUpdateError(f"load_lora_adapter on {url}: {type(error).__name__}: {error}") from None
        if response.status_code != 200:
            detail = " ".join(response.text.split())[:300]
            raise AdapterUpdateError(f"load_lora_adapter on {url}: HTTP {response.status_code}: {detail}")
        self._loaded.add(url)

    def forget(self, url: str) -> None:
        """A restarted server holds no adapter: its next load is a first load, not a replacement."""
        self._loaded.discard(url)

    def _prune(self) -> None:
        versions = sorted((int(path.name[1:]), path) for path in self.staging_dir.glob("v*") if path.name[1:].isdigit())
        for _, path in versions[:-self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
