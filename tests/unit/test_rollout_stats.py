"""The step's rollout figures (`agentrl.rl.rollout_stats`) from real ToolEnv episodes of scripted policies:
tool calls, rollouts without one, parse failures of malformed `<tool_call>` blocks, generation time."""

from __future__ import annotations

from agentrl.chat import assistant_message, unparsed_tool_calls
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.rl.rollout_stats import rollout_step_metrics
from agentrl.sampling import SamplingConfig
from agentrl.tool_env import ToolEnv
from agentrl.types import Rollout, Task

SAMPLING = SamplingConfig(max_tokens=200)


def echo(text: str) -> str:
    """Echo a text.

    Args:
        text: what to echo
    """
    return text


def test_unparsed_tool_calls_are_the_blocks_left_in_the_content():
    good = '<tool_call>{"name": "echo", "arguments": {"text": "a"}}</tool_call>'
    assert unparsed_tool_calls(assistant_message(good).content) == 0
    for bad in ('<tool_call>{"name": "echo", "arguments": {"text": </tool_call>',  # bad JSON
                '<tool_call>{"arguments": {}}</tool_call>',  # no name
                '<tool_call>{"name": "echo", "argum'):  # cut by max_tokens
        assert unparsed_tool_calls(assistant_message(bad).content) == 1, bad
    assert unparsed_tool_calls(assistant_message(good + "<tool_call>{oops}</tool_call>").content) == 1


async def test_step_metrics_count_calls_failures_and_time():
    env = ToolEnv(tools=[echo], max_turns=4)
    task = Task(prompt=[{"role": "user", "content": "go"}])
    calls_twice = ScriptedPolicy([{"content": "", "tool_calls": [tool_call("echo", text="a")]},
                                  {"content": "", "tool_calls": [tool_call("echo", text="b")]}, "done"])
    malformed = ScriptedPolicy(['<tool_call>{"name": "echo", "arguments": {"text": </tool_call>'])
    silent = ScriptedPolicy(["no tools for me"])
    rollouts = [await env.rollout(policy, task, sampling=SAMPLING) for policy in (calls_twice, malformed, silent)]
    metrics = rollout_step_metrics(rollouts)
    assert metrics["tool_calls_per_rollout"] == 2 / 3
    assert metrics["rollouts_without_tool_calls"] == 2
    assert metrics["tool_call_parse_failures"] == 1
    assert metrics["tool_call_parse_failure_rate"] == 1 / 5  # 3 + 1 + 1 assistant messages
    assert 0 <= metrics["rollout_generation_s"] <= metrics["rollout_s"]
    assert "rollout_sandbox_s" not in metrics  # no sandbox in a plain ToolEnv
    with_sandbox = [rollouts[0].model_copy(update={"state": {**rollouts[0].state, "sandbox_s": 3.0}}),
                    rollouts[1].model_copy(update={"state": {**rollouts[1].state, "sandbox_s": 1.0}})]
    assert rollout_step_metrics(with_sandbox)["rollout_sandbox_s"] == 2.0
    scored = [rollouts[0].model_copy(update={"metrics": {"solved": 1.0, "tool_calls": 2.0}}),
              rollouts[1].model_copy(update={"metrics": {"solved": 0.0, "tool_calls": 0.0}})]
    figures = rollout_step_metrics(scored)
    assert figures["metrics/solved"] == 0.5 and figures["metrics/tool_calls"] == 1.0
    assert rollout_step_metrics([]) == {}
    errored = rollout_step_metrics([Rollout(task=task, error="boom", elapsed_s=2.0)])
    assert errored["rollout_s"] == 2.0 and errored["rollouts_without_tool_calls"] == 1


def test_tokens_whose_routing_came_back_unknown_are_counted_per_step():
    import numpy as np

    from agentrl.types import Completion, Turn

    task = Task(prompt=[{"role": "user", "content": "go"}])
    known = np.zeros((5, 3, 2), dtype=np.int16)
    known[:, 1:] = 4  # layer 0 dense (zeros), layers 1-2 routed
    partly = known.copy()
    partly[:3] = -1  # three prompt tokens a connector loaded and nobody stitched
    turn = Turn(prompt_token_ids=[1] * 5, prompt_routed_experts=partly,
                completion=Completion(token_ids=[7, 8, 9], routed_experts=np.concatenate([
                    -np.ones_like(known[:1]), known[:1], -np.ones_like(known[:1])])))  # the last: never forwarded
    whole = Turn(prompt_token_ids=[1] * 5, prompt_routed_experts=known,
                 completion=Completion(token_ids=[7], routed_experts=known[:1]))
    metrics = rollout_step_metrics([Rollout(task=task, turns=[turn]), Rollout(task=task, turns=[whole])])
    assert (metrics["routing_unknown_prompt_tokens"], metrics["routing_unknown_completion_tokens"]) == (3, 1)
    plain = Rollout(task=task, turns=[Turn(prompt_token_ids=[1], completion=Completion(token_ids=[2]))])
    assert "routing_unknown_prompt_tokens" not in rollout_step_metrics([plain])
