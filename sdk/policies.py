"""Scripted policies: a `ChatClient` that replays given assistant messages.

`ScriptedPolicy` answers from a script instead of a model: a list of replies (the reply
for a call is picked by how many assistant messages the conversation already has, so
concurrent rollouts each replay the script from the start) or a callable
`(messages, tools) -> reply`. A reply is a `Message`, a string, or a dict with `content`
and/or `tool_calls` (`tool_call(name, **arguments)` builds one). Uses: oracle policies
that show an environment can be solved, environment tests that run the real rollout loop,
and replaying recorded conversations.

Turns carry token ids from a fixed byte-level rendering (one token per UTF-8 byte, plus
role and end markers), rendered from the whole conversation each call the way a chat
template would be: when an environment keeps the history intact, each turn's prompt ids
extend the previous turn's, and `Rollout.sample()` proves it; logprobs are 0.0 (the
script is certain).
"""

from __future__ import annotations

import inspect
import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.sampling import SamplingConfig
from agentrl.types import Completion, FunctionCall, Message, ToolCall, Turn

__all__ = ["END_TOKEN", "ROLE_TOKENS", "ScriptedPolicy", "as_message", "render_tokens", "tool_call"]

ROLE_TOKENS = {"system": 256, "user": 257, "assistant": 258, "tool": 259}
END_TOKEN = 260

Reply = Message | str | dict[str, Any]
Script = Sequence[Reply] | Callable[[list[Message], list[dict[str, Any]] | None], Any]

_call_ids = itertools.count()


def tool_call(name: str, /, **arguments: Any) -> ToolCall:
    """A ToolCall to `name` with JSON-encoded keyword arguments."""
    return ToolCall(id=f"call_{next(_call_ids)}", function=FunctionCall(name=name, arguments=json.dumps(arguments)))


def _message_body(message: Message) -> str:
    body = message.content
    for call in message.tool_calls or []:
        body += f"<tool_call>{call.function.name} {call.function.arguments}</tool_call>"
    return body


def render_tokens(messages: Sequence[Message]) -> list[int]:
    """Byte-level token ids of a conversation: role marker, UTF-8 bytes, end marker per message."""
    tokens: list[int] = []
    for message in messages:
        tokens.append(ROLE_TOKENS[message.role])
        tokens.extend(_message_body(message).encode("utf-8"))
        tokens.append(END_TOKEN)
    return tokens


def as_message(reply: Any) -> Message:
    """A script reply (Message, str, or dict with content and/or tool_calls) as the assistant Message."""
    if isinstance(reply, Message):
        message = reply
    elif isinstance(reply, str):
        message = Message(role="assistant", content=reply)
    elif isinstance(reply, dict):
        data = {"role": "assistant", **reply}
        data["tool_calls"] = [
            call if isinstance(call, ToolCall) else ToolCall.model_validate(call)
            for call in data.get("tool_calls") or []
        ] or None
        message = Message.model_validate(data)
    else:
        raise AgentrlError(f"ScriptedPolicy: a reply must be a Message, str or dict, got {type(reply).__name__}")
    if message.role != "assistant":
        raise AgentrlError(f"ScriptedPolicy: replies are assistant messages, got role {message.role!r}")
    return message


class ScriptedPolicy:
    """A ChatClient that replays a script of assistant replies."""

    def __init__(self, script: Script, *, name: str = "scripted") -> None:
        if not callable(script):
            script = list(script)
            if not script:
                raise AgentrlError("ScriptedPolicy: the script is empty; give at least one reply")
        self.script = script
        self.name = name
        self.calls = 0
        """How many times `chat` was called (over all conversations)."""

    async def _reply(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> Message:
        if callable(self.script):
            reply = self.script(messages, tools)
            if inspect.isawaitable(reply):
                reply = await reply
            return as_message(reply)
        index = sum(1 for message in messages if message.role == "assistant")
        if index >= len(self.script):
            raise AgentrlError(
                f"ScriptedPolicy {self.name!r}: the script has {len(self.script)} replies and this is call {index + 1}"
            )
        return as_message(self.script[index])

    async def chat(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingConfig,
        previous: Turn | None = None,
    ) -> tuple[Message, Turn]:
        self.calls += 1
        message = await self._reply(list(messages), tools)
        prompt_ids = render_tokens(messages) + [ROLE_TOKENS["assistant"]]
        completion_ids = list(_message_body(message).encode("utf-8")) + [END_TOKEN]
        finish_reason = "stop"
        if len(completion_ids) > sampling.max_tokens:
            completion_ids = completion_ids[: sampling.max_tokens]
            finish_reason = "length"
            message = Message(role="assistant", content=bytes(completion_ids).decode("utf-8", "ignore"))
        completion = Completion(
            text=message.content, token_ids=completion_ids, logprobs=[0.0] * len(completion_ids),
            finish_reason=finish_reason,
        )
        return message, Turn(prompt_token_ids=prompt_ids, completion=completion)
