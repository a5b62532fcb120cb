"""Per-step figures of a step's rollouts: where their time went, and how their tool calls went.

`rollout_step_metrics(rollouts)` gives the orchestrator's step line:

- `rollout_s`, `rollout_generation_s`, `rollout_sandbox_s`: the mean wall time of a rollout, and
  of it the time waiting on the model (`state["generation_s"]`, `MultiTurnEnv`) and the time in
  sandbox work (`state["sandbox_s"]`: getting and preparing the sandbox, its tool calls, destroying
  it; `agentrl.sandbox_env.SandboxEnv`). Rollouts run concurrently, so these are seconds of one
  rollout, beside the step's own split (`wait_s`, `train_s`, `weight_*`);
- `tool_calls_per_rollout`, `rollouts_without_tool_calls`: tool calls the model made (parsed ones);
- `tool_call_parse_failures`: assistant messages holding a `<tool_call>` block that did not parse
  (`agentrl.chat.unparsed_tool_calls`: bad JSON, no name, cut by the token limit), over the step;
  `tool_call_parse_failure_rate` per assistant message;
- `metrics/<name>`: the mean of each of the rubric's reward functions and metrics over the step's
  rollouts (e.g. key-hunt's `metrics/solved`, the solve rate, beside a shaped reward).
"""

from __future__ import annotations

from typing import Any

from agentrl.chat import unparsed_tool_calls
from agentrl.types import Rollout

__all__ = ["rollout_step_metrics"]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rollout_step_metrics(rollouts: list[Rollout]) -> dict[str, Any]:
    """Timing and tool-call figures of one step's rollouts (errored ones included)."""
    if not rollouts:
        return {}
    metrics: dict[str, Any] = {"rollout_s": _mean([r.elapsed_s for r in rollouts])}
    for key in ("generation_s", "sandbox_s"):
        values = [float(r.state[key]) for r in rollouts if isinstance(r.state.get(key), (int, float))]
        if values:
            metrics[f"rollout_{key}"] = _mean(values)
    calls = [sum(len(m.tool_calls or []) for m in r.messages if m.role == "assistant") for r in rollouts]
    assistant = [m for r in rollouts for m in r.messages if m.role == "assistant"]
    failures = sum(unparsed_tool_calls(m.content) for m in assistant)
    names = sorted({name for r in rollouts for name in r.metrics})
    metrics.update({f"metrics/{name}": _mean([float(r.metrics.get(name, 0.0)) for r in rollouts]) for name in names})
    metrics.update({
        "tool_calls_per_rollout": _mean([float(count) for count in calls]),
        "rollouts_without_tool_calls": sum(1 for count in calls if count == 0),
        "tool_call_parse_failures": failures,
        "tool_call_parse_failure_rate": failures / len(assistant) if assistant else 0.0,
    })
    return metrics
