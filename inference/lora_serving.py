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

torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError, WeightUpdateError
from agentrl.inference.weights import FilesystemWeightPublisher, ServerControl

__all__ = ["ADAPTER_NAME", "VLLM_LORA_RANKS", "AdapterPublisher", "lora_server_options", "vllm_lora_modules"]

ADAPTER_NAME = "policy-lora"
"""The name the servers load the run's adapter under; requests name it as their `model`."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts."""

_MODULES = {"attention": ("qkv_proj", "o_proj"), "shared_experts": ("gate_up_proj", "down_proj"),
            "experts": ("experts",)}


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


class AdapterPublisher(FilesystemWeightPublisher):
    """Loads each new version's PEFT folder into every server as the adapter `name`, in place.

    A publish runs as every update does (`WeightPublisher`: pause with the requests kept, load, weight
    version, resume), so the tokens a server generates after it come from the new adapter and carry the
    new version; `restore` loads the latest one into a restarted server. The adapter's weights are not
    digested (vLLM keeps them in its LoRA manager, not as the model's parameters): `PublishResult.checks`
    is empty, and the run's `weights/verified` says 0.
    """

    def __init__(self, urls: list[str], *, staging_dir: str | Path, name: str = ADAPTER_NAME, keep_last: int = 2,
                 timeout_s: float = 600.0, recompute_kv: bool = False) -> None:
        super().__init__(urls, staging_dir=staging_dir, keep_last=keep_last, timeout_s=timeout_s,
                         recompute_kv=recompute_kv, verify=False)
        self.name = name

    def _prepare(self, weights: Any, version: int, served: dict | None) -> Path:
        folder = Path(weights).expanduser().resolve() if isinstance(weights, (str, Path)) else None
        if folder is None or not (folder / "adapter_config.json").is_file():
            raise WeightUpdateError(f"publish: {weights if folder is None else folder} is not a PEFT adapter folder"
                                    " (no adapter_config.json); pass what Trainer.export_adapter writes")
        return folder

    def _expected_digest(self, weights: Any, prepared: Any) -> Any:
        return None

    async def _load(self, control: ServerControl, prepared: Path, *, version: int) -> None:
        # load_inplace replaces an adapter of that name and loads one the server does not hold yet (a first
        # load, a restarted server) alike; each version has its own folder, as vLLM caches adapters by path.
        await control._post("/v1/load_lora_adapter", what=f"load_lora_adapter {self.name} from {prepared}",
                            json={"lora_name": self.name, "lora_path": str(prepared), "load_inplace": True})
