"""agentrl: environment hub and asynchronous RL training SDK for agent tasks.

The public SDK. Importing `agentrl` stays light (no torch, vllm or ray); heavy parts load
inside the functions that need them. Names are resolved lazily so that `import agentrl`
costs only what the caller uses.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "AgentrlError": "agentrl.errors",
    "ConfigError": "agentrl.errors",
    "BaseConfig": "agentrl.config",
    "load_config": "agentrl.config",
    "Message": "agentrl.types",
    "Task": "agentrl.types",
    "Completion": "agentrl.types",
    "Turn": "agentrl.types",
    "Rollout": "agentrl.types",
    "ToolCall": "agentrl.types",
    "Environment": "agentrl.environment",
    "SingleTurnEnv": "agentrl.environment",
    "MultiTurnEnv": "agentrl.environment",
    "ToolEnv": "agentrl.tool_env",
    "Rubric": "agentrl.rubric",
    "XMLParser": "agentrl.parsers",
    "ThinkParser": "agentrl.parsers",
    "load_environment": "agentrl.hub.loader",
    "list_environments": "agentrl.hub.loader",
    "NotFoundError": "agentrl.errors",
    "SamplingConfig": "agentrl.sampling",
    "RubricGroup": "agentrl.rubric",
    "Parser": "agentrl.parsers",
    "Tool": "agentrl.tools",
    "ScriptedPolicy": "agentrl.policies",
    "evaluate": "agentrl.evaluation.engine",
}

__all__ = sorted(_EXPORTS) + ["__version__"]  # noqa: PLE0605 - the names come from _EXPORTS, the one list


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
