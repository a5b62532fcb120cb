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
- `AdapterPublisher(urls, staging_dir=...)`: a `FilesystemWeightPublisher` whose `publish(folder,
  version)` takes a PEFT folder (`Trainer.export_adapter`, one folder per version: vLLM caches
  adapters by path) and has every server load it under `ADAPTER_NAME` (`POST
  /v1/load_lora_adapter` with `load_inplace`, inside the usual pause .. resume of an update).

A run serves adapters with `inference.lora_adapters = true` (`trainer.lora` set): the trainer's
rank 0 exports the adapter into the run's `weights/v<N>` after each step (megabytes, not the
merged weights), each server's actor loads it, and the rollouts name the adapter.
- `SharedAdapterPublisher(url, run=...)`: for a server several runs share (`inference.base_url`, a server
  `agentrl serve --lora` started): each version is loaded under a name of its own, `<run>-v<N>`, without
  pausing the server or setting its weight version (other runs' requests go on; the server's version is
  no run's), and the run's rollouts name the newest; the names older than the last `keep` are unloaded.

torch-free.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError, WeightUpdateError
from agentrl.inference.server_control import ServerControl
from agentrl.inference.weight_check import WeightCheck, WeightMismatchError
from agentrl.inference.weights import FilesystemWeightPublisher

__all__ = ["ADAPTER_NAME", "ADAPTER_TOLERANCE", "VLLM_LORA_RANKS", "AdapterPublisher", "SharedAdapterPublisher",
           "adapter_digest", "lora_server_options", "vllm_lora_modules"]

ADAPTER_NAME = "policy-lora"
"""The name the servers load the run's adapter under; requests name it as their `model`."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts."""

_MODULES = {"attention": ("qkv_proj", "o_proj"), "shared_experts": ("gate_up_proj", "down_proj"),
            "experts": ("experts",)}


def vllm_lora_modules(targets: list[str]) -> list[str]:
    """vLLM's `--lora-target-modules` names for agentrl's `trainer.lora.targets`."""
    return list(dict.fromkeys(name for target in targets for name in _MODULES[target]))


def lora_server_options(lora: object, *, device: str, max_loras: int = 1) -> tuple[list[str], dict[str, str]]:
    """Extra vLLM flags and environment of a server that serves `lora`'s adapters (a `LoraConfig`), `max_loras` of
    them in one batch."""
    targets = list(lora.targets)
    rank = int(lora.rank)
    if device == "cpu" and "experts" in targets:
        raise ConfigError("trainer.lora.targets: vLLM serves adapters on routed experts only on GPUs (its MoE LoRA"
                          " runs in Triton/CUDA kernels); on the CPU leave out \"experts\" or serve merged weights"
                          " (a LoRA run pushes merged weights by default)")
    slot = next((size for size in VLLM_LORA_RANKS if size >= rank), None)
    if slot is None:
        raise ConfigError(f"trainer.lora.rank {rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
    args = ["--enable-lora", "--max-lora-rank", str(slot), "--max-loras", str(max_loras),
            "--lora-target-modules", *vllm_lora_modules(targets)]
    return args, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


class AdapterPublisher(FilesystemWeightPublisher):
    """Loads each new version's PEFT folder into every server as the adapter `name`, in place.

    A publish runs as every update does (`WeightPublisher`: pause with the requests kept, load, weight
    version, resume), so the tokens a server generates after it come from the new adapter and carry the
    new version; `restore` loads the latest one into a restarted server. With `verify`, before the server
    resumes, the adapter it holds (vLLM's LoRA manager: `WorkerChecks.agentrl_lora_digest`) must equal the
    folder's as the server holds it (`adapter_digest` in the server's dtype): float64 sums of every A and every
    scaled B within `ADAPTER_TOLERANCE`, else `WeightMismatchError`; an adapter not loaded, or a stale one, differs
    far beyond it.
    """

    def __init__(self, urls: list[str], *, staging_dir: str | Path, name: str = ADAPTER_NAME, keep_last: int = 2,
                 timeout_s: float = 600.0, recompute_kv: bool = False, verify: bool = True) -> None:
        super().__init__(urls, staging_dir=staging_dir, keep_last=keep_last, timeout_s=timeout_s,
                         recompute_kv=recompute_kv, verify=verify)
        self.name = name
        self._last_folder: Path | None = None
        self._dtype = "float32"
        """The dtype the servers were last seen to hold adapters in (`_check`): the one digested beside the load."""

    def _prepare(self, weights: Any, version: int, served: dict | None) -> Path:
        folder = Path(weights).expanduser().resolve() if isinstance(weights, (str, Path)) else None
        if folder is None or not (folder / "adapter_config.json").is_file():
            raise WeightUpdateError(f"publish: {weights if folder is None else folder} is not a PEFT adapter folder"
                                    " (no adapter_config.json); pass what Trainer.export_adapter writes")
        self._last_folder = folder
        return folder

    def _expected_digest(self, weights: Any, prepared: Path) -> dict[str, list[float]]:
        """The PEFT folder `prepared`'s digest per server dtype (`adapter_digest`): the servers' last seen one now,
        another added by `_check` when a server holds adapters in it."""
        return {self._dtype: adapter_digest(prepared, dtype=self._dtype)}

    async def _check(self, control: ServerControl, expected: dict[str, list[float]], version: int) -> WeightCheck:
        dtype = self._dtype = await control.model_dtype()
        if dtype not in expected:
            expected[dtype] = await asyncio.to_thread(adapter_digest, self._last_folder, dtype=dtype)
        expected = expected[dtype]
        held = {}
        for result in await control.worker_call("agentrl_lora_digest"):
            held.update(result)
        errors = {lora_id: _relative_difference(sums, expected) for lora_id, sums in held.items()}
        best = min(errors, key=errors.get, default=None)
        if best is None or errors[best] >= 1.0:
            closest = f"; the closest holds sums {held[best][:4]}" if best is not None else ""
            raise WeightMismatchError(f"version {version} on {control.url}: no LoRA adapter the server holds equals"
                                      f" the one loaded from {self._last_folder} (sums {expected[:4]}){closest}")
        return WeightCheck(checked=int(held[best][4]), trainer_tensors=int(expected[4]), max_error=errors[best])

    async def _load(self, control: ServerControl, prepared: Path, *, version: int) -> None:
        # load_inplace replaces an adapter of that name and loads one the server does not hold yet (a first
        # load, a restarted server) alike; each version has its own folder, as vLLM caches adapters by path.
        await control._post("/v1/load_lora_adapter", what=f"load_lora_adapter {self.name} from {prepared}",
                            json={"lora_name": self.name, "lora_path": str(prepared), "load_inplace": True})


class SharedAdapterPublisher(AdapterPublisher):
    """An `AdapterPublisher` for a server other runs use too: every version under its own name, no pause.

    `publish(folder, version)` loads the folder as `name_for(version)` (`<run>-v<N>`), checks it as the
    in-place publisher does (the server may hold other runs' adapters: the one equal to the folder must be
    among them), then unloads this run's names older than the last `keep` versions. Requests in flight keep
    the adapter they named, so a request's tokens all come from one version.
    """

    def __init__(self, url: str, *, run: str, staging_dir: str | Path, keep: int = 3, timeout_s: float = 600.0,
                 verify: bool = True) -> None:
        super().__init__([url], staging_dir=staging_dir, name=run, keep_last=keep, timeout_s=timeout_s,
                         verify=verify)
        self.loaded: list[int] = []
        """This run's versions the server holds, oldest first."""

    def name_for(self, version: int) -> str:
        return f"{self.name}-v{version}"

    async def _load(self, control: ServerControl, prepared: Path, *, version: int) -> None:
        name = self.name_for(version)
        await control._post("/v1/load_lora_adapter", what=f"load_lora_adapter {name} from {prepared}",
                            json={"lora_name": name, "lora_path": str(prepared)})

    async def _update_one(self, control: ServerControl, prepared: Any, version: int, expected: Any, *,
                          gate: Any = None) -> Any:
        # No pause here, so the P/D pause order (`gate`: `WeightPublisher._update_all`) has no part.
        import time

        from agentrl.inference.weights import _Updated

        started = time.monotonic()
        updated = _Updated()
        await self._load(control, prepared, version=version)
        self.loaded.append(version)
        if expected is not None:
            digest = await expected if isinstance(expected, asyncio.Future) else expected
            updated.check = await self._check(control, digest, version)
        while len(self.loaded) > self.keep_last:
            await self.unload(control, self.loaded.pop(0))
        updated.seconds = time.monotonic() - started
        return updated

    async def unload(self, control: ServerControl, version: int) -> None:
        name = self.name_for(version)
        await control._post("/v1/unload_lora_adapter", what=f"unload_lora_adapter {name}", json={"lora_name": name})


ADAPTER_TOLERANCE = 1e-6
"""Relative, of the sums of an adapter's A and scaled B matrices: the expected values round as the server does
(`adapter_digest`), so what is left is the order of float64 summation; an adapter one training step older differs
by far more."""


def adapter_digest(folder: Path, *, dtype: str = "float32") -> list[float]:
    """[sum and sum of squares of every lora_A, the same of every lora_B times the adapter's scaling, tensors]
    of a PEFT adapter folder, in float64 (torch, safetensors), as a server computing in `dtype` holds it: vLLM
    casts A and B to its LoRA dtype (the model's) and then multiplies B by the scaling in that dtype
    (`LoRALayerWeights.optimize`), so a bfloat16 server's A and B are rounded to bfloat16 here too."""
    import json

    import torch
    from safetensors.torch import load_file

    from agentrl.weight_digest import float64_sums

    held = getattr(torch, dtype)
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    rank, alpha = float(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    sums = [0.0, 0.0, 0.0, 0.0]
    count = 0
    for name, tensor in load_file(str(Path(folder) / "adapter_model.safetensors")).items():
        is_b = "lora_B" in name
        value = tensor.to(held)
        total, squares, _ = float64_sums(value * scale if is_b and scale != 1 else value).tolist()
        sums[2 * is_b] += total
        sums[2 * is_b + 1] += squares
        count += not is_b
    return [*sums, float(count)]


def _relative_difference(held: list[float], expected: list[float]) -> float:
    """The largest difference of the four sums, each over ADAPTER_TOLERANCE of its scale (the sum's: the square
    root of its sum of squares times the count of values is unknown here, so the sum of squares bounds it)."""
    worst = 0.0
    for index in range(4):
        scale = max(abs(expected[index]), abs(held[index]), math.sqrt(max(expected[1 + 2 * (index // 2)], 0.0)),
                    1e-30)
        worst = max(worst, abs(held[index] - expected[index]) / (ADAPTER_TOLERANCE * scale))
    return worst
