"""verifiers' own scoring of the completions in an agentrl `results.jsonl`, run on a package venv's python.

    python tests/verifiers_rescore.py PACKAGE_FOLDER RESULTS_JSONL [KWARGS_JSON]

prints one JSON list: per record `{"reward": ..., "metrics": {...}}` as verifiers scores the same
completions, with nothing of agentrl's adapter:

- the old API (`load_environment()`): `vf_env.run_group` on the record's verifiers row with verifiers'
  own OpenAI chat client replaying the record's assistant replies (tests/verifiers_replay.py);
- v1: the exported Taskset's task of the record, scored by `Task.score` on a `Trace` built from the
  record's messages with verifiers' own types (one chain, the assistant turns sampled).

It runs where verifiers is (a venv `agentrl env install` made), never in agentrl's own environment.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _legacy(module, records, kwargs):
    from agentrl.types import ToolCall
    from tests.verifiers_replay import replay_client

    vf_env = module.load_environment(**kwargs)
    scores = []
    for record in records:
        prompt_len = len(record["task"]["prompt"])
        replies = []
        for message in record["messages"][prompt_len:]:
            if message["role"] == "assistant":
                calls = [ToolCall.model_validate(call) for call in message.get("tool_calls") or []]
                replies.append({"content": message.get("content") or "", "tool_calls": calls})
        row = dict(record["task"]["info"]["verifiers_input"])
        [output] = asyncio.run(vf_env.run_group([row], replay_client(replies), "replay", {}))
        scores.append({"reward": output["reward"], "metrics": dict(output["metrics"])})
    return scores


def v1_trace(vf_task, messages):
    """A verifiers Trace of `messages` (agentrl record messages) for `vf_task`, built from verifiers' types."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    converted = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "system":
            converted.append(vf.SystemMessage(content=content))
        elif role == "user":
            converted.append(vf.UserMessage(content=content))
        elif role == "tool":
            converted.append(vf.ToolMessage(tool_call_id=message["tool_call_id"], content=content))
        else:
            calls = [
                vf.ToolCall(id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"])
                for call in message.get("tool_calls") or []
            ]
            converted.append(vf.AssistantMessage(content=content, tool_calls=calls or None))
    return Trace(
        task=TraceTask(type=type(vf_task).__name__, data=vf_task.data),
        agent=AgentInfo(config=AgentConfig()),
        nodes=[
            MessageNode(parent=index - 1 if index else None, message=message, sampled=message.role == "assistant")
            for index, message in enumerate(converted)
        ],
    )


def v1_tasks(module, kwargs):
    from verifiers.v1 import Taskset, TasksetConfig
    from verifiers.v1.utils.generic import concrete_type

    [taskset_class] = [
        value for name in module.__all__
        if isinstance(value := getattr(module, name), type) and issubclass(value, Taskset)
    ]
    config_type = concrete_type(taskset_class, TasksetConfig, origin=Taskset) or TasksetConfig
    return list(taskset_class(config_type.model_validate(kwargs)))


def _v1(module, records, kwargs):
    tasks = v1_tasks(module, kwargs)
    scores = []
    for record in records:
        vf_task = tasks[record["task"]["info"]["verifiers_task"]]
        trace = v1_trace(vf_task, record["messages"])
        asyncio.run(vf_task.score(trace))
        metrics = {name: (value.score if value is not None else None) for name, value in trace.rewards.items()}
        metrics.update(trace.metrics)
        scores.append({"reward": trace.reward, "metrics": metrics})
    return scores


def main() -> None:
    folder, results = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    import tomllib

    name = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]
    sys.path.insert(0, str(folder))
    module = importlib.import_module(name.replace("-", "_").lower())
    v1 = any(isinstance(getattr(module, item, None), type) for item in getattr(module, "__all__", []))
    print(json.dumps(_v1(module, records, kwargs) if v1 else _legacy(module, records, kwargs)))


if __name__ == "__main__":
    main()
