"""verifiers' `load_environment()` API (verifiers < 0.4) as an agentrl Environment.

`VerifiersLegacyEnv` wraps the `vf.Environment` a package's `load_environment()` returns
(`SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`, `StatefulToolEnv`, ... any subclass) and lets
verifiers run it as its authors meant:

- rows: the env's own formatted `get_dataset()` (train) and `get_eval_dataset()` (test), so
  `question`/`answer` columns, `system_prompt`, `few_shot` and `example_id` are verifiers' own
  formatting; the verifiers row travels in `info["verifiers_input"]`;
- episodes: verifiers' own `env.rollout(...)` (its `env_response`, stop conditions, `max_turns`,
  tool execution, `setup_state`/cleanup) with agentrl's model behind a verifiers `Client`
  (`agentrl_client_class()`): each model call goes to agentrl's ChatClient with the previous Turn, so
  token ids, logprobs and routed experts are agentrl's own `Turn`s;
- rewards: verifiers' own `env.rubric.score_group(states)` (its parsers, reward functions,
  weights, group functions); its reward and metrics become the rollout's. A reward function that raised
  (verifiers logs it and scores it 0) becomes the rollout's `grader_error`, counted by `agentrl eval`.

Sampling is agentrl's (`SamplingConfig`); the env's `sampling_args` are not used. Tested with
verifiers 0.3.1, whose old API is `verifiers.legacy` (aliased at `verifiers.*`).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
import uuid
import weakref
from contextvars import ContextVar
from typing import Any

from agentrl.environment import Environment
from agentrl.errors import AgentrlError
from agentrl.rubric import Rubric
from agentrl.sampling import ChatClient, SamplingConfig
from agentrl.types import FunctionCall, Message, Rollout, Task, ToolCall, Turn

__all__ = ["VerifiersLegacyEnv", "agentrl_client_class", "from_vf_message"]

INPUT_KEY = "verifiers_input"
_STATE_KEY = "verifiers_trajectory_id"


_REWARD_ERROR = re.compile(r"Error calling (group )?reward function (\S+): (.*)", re.DOTALL)
_SCORING: ContextVar[_RewardErrors | None] = ContextVar("verifiers_scoring", default=None)
"""The `_RewardErrors` of the group being scored in this task (and the tasks verifiers starts from it): groups
scored at once each keep their own reward functions' errors."""


class _RewardErrors(logging.Handler):
    """The reward functions that raised while verifiers scored a group: verifiers catches the exception, logs
    `Error calling reward function NAME: ERROR` and scores that function 0, so without this the rollout reads
    as a plain 0 with no trace of why. Attached to the `verifiers` logger for one `score_group`."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.raised: list[tuple[bool, str, str]] = []  # (a group function, its name, the error)

    def emit(self, record: logging.LogRecord) -> None:
        if _SCORING.get() is not self:
            return  # another group's scoring, in another task
        match = _REWARD_ERROR.match(record.getMessage())
        if match:
            self.raised.append((bool(match.group(1)), match.group(2), " ".join(match.group(3).split())[:300]))

    def blame(self, states: list[dict[str, Any]]) -> list[str | None]:
        """Each state's grader error: a group function's failure is every state's; a per-rollout function's is
        that of the states it scored 0 (verifiers' score for a raise), saying so when more scored 0 than raised."""
        blamed: list[str | None] = [None] * len(states)
        for group, name, error in self.raised:
            if group:
                blamed = [found or f"verifiers group reward function {name!r} raised: {error}" for found in blamed]
        for name in dict.fromkeys(name for group, name, _ in self.raised if not group):
            errors = [error for group, named, error in self.raised if not group and named == name]
            zero = [i for i, state in enumerate(states) if (state.get("metrics") or {}).get(name) == 0.0]
            how = "raised" if len(zero) == len(errors) else (
                f"raised in {len(errors)} of the group's {len(states)} rollouts, this one among the {len(zero)} it "
                "scored 0")
            for i in zero:
                blamed[i] = blamed[i] or f"verifiers reward function {name!r} {how}: {errors[0]}"
        return blamed


def _text(content: Any) -> str:
    """Message content as text (content parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if text:
            parts.append(text)
    return "".join(parts)


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def from_vf_message(message: Any) -> Message:
    """An agentrl Message from a verifiers message (pydantic or dict; flat `.name`/`.arguments` calls)."""
    role = _field(message, "role")
    if role == "text":  # verifiers' completion-style prompt
        role = "user"
    calls = []
    for call in _field(message, "tool_calls") or []:
        function = _field(call, "function")
        name = _field(call, "name") or _field(function, "name")
        arguments = _field(call, "arguments") or _field(function, "arguments") or "{}"
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append(
            ToolCall(
                id=str(_field(call, "id") or f"call_{uuid.uuid4().hex[:8]}"),
                function=FunctionCall(name=str(name), arguments=arguments),
            )
        )
    return Message(
        role=role,
        content=_text(_field(message, "content")),
        tool_calls=calls or None,
        tool_call_id=_field(message, "tool_call_id"),
        name=_field(message, "name") if role == "tool" else None,
    )


def _tool_schema(tool: Any) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.parameters or {"type": "object", "properties": {}},
        },
    }


def _finish_reason(turn: Turn, has_calls: bool) -> str | None:
    reason = turn.completion.finish_reason
    if has_calls and reason != "length":
        return "tool_calls"
    return reason if reason in ("stop", "length") else "stop"


@functools.cache
def agentrl_client_class() -> type:
    """`AgentrlClient`, a verifiers `Client` subclass (made on first use: it needs verifiers)."""
    from verifiers.clients import Client

    class AgentrlClient(Client):
        """A verifiers `Client` whose model is an agentrl ChatClient; one per rollout (it keeps the Turns)."""

        def __init__(self, chat: ChatClient, sampling: SamplingConfig) -> None:
            super().__init__(chat)
            self.sampling = sampling
            self.turns: list[Turn] = []

        async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            from verifiers.types import Response, ResponseMessage, ResponseTokens, Usage
            from verifiers.types import ToolCall as VfToolCall

            messages = [from_vf_message(message) for message in prompt]
            schemas = [_tool_schema(tool) for tool in tools or []] or None
            message, turn = await self.client.chat(
                messages,
                tools=schemas,
                sampling=self.sampling,
                previous=self.turns[-1] if self.turns else None,
            )
            self.turns.append(turn)
            calls = [
                VfToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
                for call in message.tool_calls or []
            ]
            completion = turn.completion
            prompt_ids, completion_ids = list(turn.prompt_token_ids), list(completion.token_ids)
            tokens = ResponseTokens(
                prompt_ids=prompt_ids,
                prompt_mask=[0] * len(prompt_ids),
                completion_ids=completion_ids,
                completion_mask=[1] * len(completion_ids),
                completion_logprobs=list(completion.logprobs),
            )
            finish = _finish_reason(turn, bool(calls))
            return Response(
                id=f"agentrl-{uuid.uuid4().hex[:12]}",
                created=int(time.time()),
                model=model,
                usage=Usage(
                    prompt_tokens=len(prompt_ids),
                    reasoning_tokens=0,
                    completion_tokens=len(completion_ids),
                    total_tokens=len(prompt_ids) + len(completion_ids),
                ),
                message=ResponseMessage(
                    content=message.content,
                    tool_calls=calls or None,
                    finish_reason=finish,
                    is_truncated=finish == "length",
                    tokens=tokens,
                ),
            )

        # The abstract hooks of a provider client; get_response above does the whole call.
        def setup_client(self, config):
            raise AgentrlError("AgentrlClient wraps an agentrl ChatClient; it takes no ClientConfig")

        async def to_native_tool(self, tool):
            return _tool_schema(tool)

        async def to_native_prompt(self, messages):
            return [from_vf_message(message) for message in messages], {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            raise NotImplementedError("AgentrlClient.get_response calls the agentrl ChatClient directly")

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            return response

        async def close(self):
            return None

    return AgentrlClient


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _rows(dataset: Any) -> list[dict[str, Any]]:
    rows = []
    for index, row in enumerate(dataset.to_list()):
        vf_input = _json_safe(row)
        info = row.get("info") or {}
        if isinstance(info, str):
            info = json.loads(info) if info.strip() else {}
        rows.append(
            {
                "prompt": [
                    from_vf_message(message).model_dump(exclude_none=True) for message in row["prompt"]
                ],
                "answer": str(row.get("answer") or ""),
                "task": str(row.get("task") or "default"),
                "example_id": row.get("example_id", index),
                "info": {**(info if isinstance(info, dict) else {"info": info}), INPUT_KEY: vf_input},
            }
        )
    return rows


def _refuse_empty_prompts(name: str, vf_env: Any, splits: dict[str, Any]) -> None:
    """One line at load for rows whose conversation would start empty: a row without prompt messages, and no
    `setup_state` of the package's own that could write one (verifiers' first model call sends the row's
    prompt; every rollout would fail with "Cannot apply chat template to an empty conversation")."""
    owner = type(vf_env).setup_state.__module__ if hasattr(type(vf_env), "setup_state") else "verifiers"
    if not owner.startswith("verifiers"):
        return
    for split, rows in splits.items():
        empty = [index for index, row in enumerate(rows()[:64]) if not row["prompt"]]
        if empty:
            raise AgentrlError(
                f"verifiers package {name!r}: {split} row {empty[0]} has an empty prompt and the environment "
                "writes none in setup_state, so every rollout would start from an empty conversation; give "
                "the rows a prompt (or a question)"
            )


class VerifiersLegacyEnv(Environment):
    """A verifiers `load_environment()` env: verifiers' rollout loop and rubric, agentrl's model and Turns."""

    def __init__(self, vf_env: Any, *, name: str) -> None:
        if not hasattr(vf_env, "rollout") or not hasattr(vf_env, "rubric"):
            raise AgentrlError(
                f"verifiers package {name!r}: load_environment returned {type(vf_env).__name__}, "
                "not a verifiers Environment"
            )
        splits: dict[str, Any] = {}
        if (
            getattr(vf_env, "dataset_source", None) is not None
            or getattr(vf_env, "dataset", None) is not None
        ):
            splits["train"] = lambda: _rows(vf_env.get_dataset())
        if (
            getattr(vf_env, "eval_dataset_source", None) is not None
            or getattr(vf_env, "eval_dataset", None) is not None
        ):
            splits["test"] = lambda: _rows(vf_env.get_eval_dataset())
        elif "train" in splits:
            splits["test"] = splits[
                "train"
            ]  # verifiers evaluates on the train set when there is no eval_dataset
        super().__init__(name=name, splits=splits, rubric=Rubric())
        _refuse_empty_prompts(name, vf_env, splits)
        self.vf_env = vf_env
        """The verifiers Environment that runs the episodes and scores them."""
        self._states: dict[str, Any] = {}

    async def rollout(self, client: ChatClient, task: Task, *, sampling: SamplingConfig) -> Rollout:
        vf_input = task.info.get(INPUT_KEY)
        if not isinstance(vf_input, dict):
            raise AgentrlError(
                f"environment {self.name!r}: task info has no {INPUT_KEY!r} (rows come from "
                "this environment's own datasets)"
            )
        started = time.monotonic()
        adapter = agentrl_client_class()(client, sampling)
        error = None
        try:
            state = await self.vf_env.rollout(dict(vf_input), adapter, "agentrl", {})
        except Exception as exc:  # noqa: BLE001 - a failed episode ends up on the rollout, never raises
            state, error = None, f"{type(exc).__name__}: {exc}"
        messages = [message.model_copy() for message in task.prompt]
        kept: dict[str, Any] = {}
        if state is not None:
            messages += [from_vf_message(message) for message in state.get("completion") or []]
            if state.get("error") is not None:
                error = f"{type(state['error']).__name__}: {state['error']}"
            kept = {"stop_condition": state.get("stop_condition"), _STATE_KEY: state["trajectory_id"]}
            self._states[state["trajectory_id"]] = state
        rollout = Rollout(
            task=task,
            messages=messages,
            turns=adapter.turns,
            error=error,
            truncated=bool(state and state.get("is_truncated")),
            elapsed_s=time.monotonic() - started,
            state=kept,
        )
        if (
            state is not None
        ):  # a rollout never scored (an SFT demonstration...) does not keep its state alive
            weakref.finalize(rollout, self._states.pop, state["trajectory_id"], None)
        return rollout

    async def score(self, rollouts: list[Rollout]) -> list[Rollout]:
        """verifiers' own rubric scores the group (`rubric.score_group`), then its cleanup runs."""
        scored = [(rollout, self._states.pop(rollout.state.get(_STATE_KEY), None)) for rollout in rollouts]
        states = [state for _, state in scored if state is not None]
        raised = _RewardErrors()
        if states:
            verifiers_logger = logging.getLogger("verifiers")
            verifiers_logger.addHandler(raised)
            scoring = _SCORING.set(raised)
            try:
                await self.vf_env.rubric.score_group(states)
            finally:
                _SCORING.reset(scoring)
                verifiers_logger.removeHandler(raised)
        blamed = dict(zip(map(id, states), raised.blame(states)))
        for rollout, state in scored:
            if state is None:
                rollout.reward, rollout.metrics["rollout_error"] = 0.0, 1.0
                continue
            rollout.grader_error = rollout.grader_error or blamed.get(id(state))
            rollout.metrics.update({key: float(value) for key, value in (state.get("metrics") or {}).items()})
            rollout.reward = float(state.get("reward") or 0.0)
            if rollout.error is not None:
                rollout.reward, rollout.metrics["rollout_error"] = 0.0, 1.0
            await self.vf_env.rubric.cleanup(state)
        return rollouts
