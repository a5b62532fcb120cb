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
- `routing_unknown_prompt_tokens`, `routing_unknown_completion_tokens`: tokens of the step's turns whose routed
  experts came back unknown (-1 in every layer: a prefix-cache or KV-connector block whose rows were not held, a
  P/D prompt the client could not stitch; a completion's last token, which no forward pass takes in, left out);
  Router Replay routes those live. Absent without routed experts;
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


def _unknown_tokens(experts: Any, *, last: bool = True) -> int:
    if experts is None or experts.array.size == 0:
        return 0
    rows = experts.array if last else experts.array[:-1]
    return int((rows < 0).reshape(len(rows), -1).all(axis=1).sum()) if len(rows) else 0


def _unknown_routing(rollouts: list[Rollout]) -> dict[str, int]:
    """Prompt and completion tokens whose routed experts are unknown, over the rollouts' turns that carry any."""
    turns = [turn for rollout in rollouts for turn in rollout.turns
             if turn.prompt_routed_experts is not None or turn.completion.routed_experts is not None]
    if not turns:
        return {}
    return {"routing_unknown_prompt_tokens": sum(_unknown_tokens(turn.prompt_routed_experts) for turn in turns),
            "routing_unknown_completion_tokens": sum(_unknown_tokens(turn.completion.routed_experts, last=False)
                                                     for turn in turns)}


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
    metrics.update(_unknown_routing(rollouts))
    metrics.update({
        "tool_calls_per_rollout": _mean([float(count) for count in calls]),
        "rollouts_without_tool_calls": sum(1 for count in calls if count == 0),
        "tool_call_parse_failures": failures,
        "tool_call_parse_failure_rate": failures / len(assistant) if assistant else 0.0,
    })
    return metrics
