"""ToolEnv: a multi-turn environment whose model calls typed Python tools.

The tools (plain or async functions with annotations and a docstring) are offered to the
model as OpenAI tool schemas (`agentrl.tools.Tool`). After each assistant message with
`tool_calls`, every call is run and its result appended as a `tool` message; a message
without tool calls ends the episode. A call to an unknown tool, with arguments that do
not fit the signature, or a tool that raises, gives the model an `Error: ...` tool message
and the episode goes on; it never crashes the rollout. Tool output is capped at
`max_tool_output_chars`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.environment import MultiTurnEnv
from agentrl.errors import AgentrlError
from agentrl.tools import Tool, ToolArgumentError
from agentrl.types import Message, ToolCall

__all__ = ["ToolEnv"]


class ToolEnv(MultiTurnEnv):
    """Runs the assistant's tool calls and feeds the results back until it answers."""

    def __init__(
        self,
        *,
        tools: Sequence[Callable[..., Any] | Tool] = (),
        max_tool_output_chars: int = 8000,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.tools: dict[str, Tool] = {}
        for item in tools:
            self.add_tool(item)
        self.max_tool_output_chars = max_tool_output_chars
        """Tool results longer than this are cut (with a note) before the model sees them."""

    def add_tool(self, tool: Callable[..., Any] | Tool) -> None:
        """Offer another tool to the model."""
        tool = tool if isinstance(tool, Tool) else Tool(tool)
        if tool.name in self.tools:
            raise AgentrlError(f"{type(self).__name__}: two tools are named {tool.name!r}")
        self.tools[tool.name] = tool

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return [tool.schema for tool in self.tools.values()] or None

    def is_completed(self, messages: list[Message], state: dict[str, Any]) -> bool:
        last = messages[-1] if messages else None
        return last is not None and last.role == "assistant" and not last.tool_calls

    async def call_tool(self, call: ToolCall, state: dict[str, Any]) -> str:
        """Run one tool call and return the text the model sees (errors included)."""
        tool = self.tools.get(call.function.name)
        if tool is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return f"Error: unknown tool {call.function.name!r}; available tools: {available}"
        try:
            output = await tool.call(call.function.arguments)
        except ToolArgumentError as exc:
            return f"Error: {exc}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model sees the tool's failure
            state["tool_errors"] = state.get("tool_errors", 0) + 1
            return f"Error: {tool.name} raised {type(exc).__name__}: {exc}"
        if len(output) > self.max_tool_output_chars:
            cut = len(output) - self.max_tool_output_chars
            output = output[: self.max_tool_output_chars] + f"\n... [{cut} characters cut]"
        return output

    async def env_response(self, messages: list[Message], state: dict[str, Any]) -> list[Message]:
        last = messages[-1]
        calls = last.tool_calls or []
        state["tool_calls"] = state.get("tool_calls", 0) + len(calls)
        outputs = await asyncio.gather(*(self.call_tool(call, state) for call in calls))
        return [
            Message(role="tool", content=output, tool_call_id=call.id, name=call.function.name)
            for call, output in zip(calls, outputs)
        ]
