"""ToolEnv: a multi-turn environment whose model calls typed Python tools.

The tools (plain or async functions with annotations and a docstring) are offered to the
model as OpenAI tool schemas (`agentrl.tools.Tool`). After each assistant message with
`tool_calls`, every call is run and its result appended as a `tool` message; a message
without tool calls ends the episode. A call to an unknown tool, with arguments that do
not fit the signature, or a tool that raises, gives the model an `Error: ...` tool message
and the episode goes on; it never crashes the rollout. Tool output is capped at
`max_tool_output_chars`. Calls of one message run in order (a later call may depend on an
earlier one, e.g. write a file then run it) unless `parallel_tool_calls=True`.

Tools can take arguments the model never sees: a tool parameter named `state` receives the
rollout's state dict, and subclasses supply others (a sandbox...) by overriding
`hidden_tool_args` and adding the tool with `Tool(func, hidden=("sandbox",))`.

MCP servers in or beside a rollout's sandbox (`agentrl.mcp_servers`): `start_mcp` in the
rollout's setup offers their tools beside the env's own for that rollout (`tools_for`), their
calls go to the servers, `stop_mcp` in its cleanup closes them. `attach_mcp` takes any session
with the same interface (`routes`, `schemas`, `call`, `aclose`; verifiers toolsets use it).
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.environment import MultiTurnEnv, maybe_await
from agentrl.errors import AgentrlError
from agentrl.tools import Tool, ToolArgumentError
from agentrl.types import Message, ToolCall

__all__ = ["ToolEnv"]

_MCP: dict[str, Any] = {}
"""Live MCP sessions (`SandboxMcp`) by `state["mcp_key"]`: not JSON, so kept off the state."""


class ToolEnv(MultiTurnEnv):
    """Runs the assistant's tool calls and feeds the results back until it answers."""

    def __init__(
        self,
        *,
        tools: Sequence[Callable[..., Any] | Tool] = (),
        max_tool_output_chars: int = 8000,
        parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.parallel_tool_calls = parallel_tool_calls
        """Run the calls of one assistant message concurrently instead of in order."""
        self.tools: dict[str, Tool] = {}
        for item in tools:
            self.add_tool(item)
        self.max_tool_output_chars = max_tool_output_chars
        """Tool results longer than this are cut (with a note) before the model sees them."""

    def add_tool(self, tool: Callable[..., Any] | Tool) -> None:
        """Offer another tool to the model."""
        if not isinstance(tool, Tool):
            takes_state = "state" in inspect.signature(tool).parameters
            tool = Tool(tool, hidden=("state",) if takes_state else ())
        if tool.name in self.tools:
            raise AgentrlError(f"{type(self).__name__}: two tools are named {tool.name!r}")
        self.tools[tool.name] = tool

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return [tool.schema for tool in self.tools.values()] or None

    def is_completed(self, messages: list[Message], state: dict[str, Any]) -> bool:
        last = messages[-1] if messages else None
        return last is not None and last.role == "assistant" and not last.tool_calls

    def hidden_tool_args(self, tool: Tool, state: dict[str, Any]) -> dict[str, Any]:
        """Values of a tool's hidden arguments for this rollout (default: `state`)."""
        return {"state": state}

    async def start_mcp(self, sandbox: Any, specs: Sequence[Any], state: dict[str, Any]) -> None:
        """Start the MCP servers `specs` (`McpServerSpec`s or dicts) for this rollout in/beside `sandbox`."""
        from agentrl.mcp_servers import McpServerSpec, SandboxMcp

        session = SandboxMcp(sandbox, [McpServerSpec.model_validate(spec) for spec in specs])
        try:
            await session.start()
        except BaseException:
            session.stop()
            raise
        await self.attach_mcp(session, state)

    async def attach_mcp(self, session: Any, state: dict[str, Any]) -> None:
        """Offer a started MCP session's tools in this rollout (a name clash with the env's own tools is an error)."""
        clash = sorted(set(session.routes) & set(self.tools))
        if clash:
            await session.aclose()
            raise AgentrlError(f"{type(self).__name__}: MCP tool {clash[0]!r} has the name of one of its own tools")
        state["mcp_key"] = uuid.uuid4().hex
        state["mcp_tools"] = sorted(session.routes)
        _MCP[state["mcp_key"]] = session

    async def stop_mcp(self, state: dict[str, Any]) -> None:
        """Close the rollout's MCP session (sandbox servers then die with the sandbox)."""
        session = _MCP.pop(state.get("mcp_key", ""), None)
        if session is not None:
            await session.aclose()

    def tools_for(self, state: dict[str, Any]) -> list[dict[str, Any]] | None:
        session = _MCP.get(state.get("mcp_key", ""))
        if session is None:
            return self.tool_schemas
        return [*(self.tool_schemas or []), *session.schemas]

    async def call_tool(self, call: ToolCall, state: dict[str, Any]) -> str:
        """Run one tool call and return the text the model sees (errors included)."""
        session = _MCP.get(state.get("mcp_key", ""))
        if session is not None and call.function.name in session.routes:
            try:
                arguments = call.function.parsed_arguments()
            except (ValueError, TypeError) as exc:
                return f"Error: {exc}"
            state["mcp_calls"] = state.get("mcp_calls", 0) + 1
            output = await session.call(call.function.name, arguments)
            if len(output) > self.max_tool_output_chars:
                cut = len(output) - self.max_tool_output_chars
                output = output[: self.max_tool_output_chars] + f"\n... [{cut} characters cut]"
            return output
        tool = self.tools.get(call.function.name)
        if tool is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return f"Error: unknown tool {call.function.name!r}; available tools: {available}"
        hidden: dict[str, Any] = {}
        if tool.hidden:  # a missing hidden value is the environment's bug: it fails the rollout
            hidden = dict(await maybe_await(self.hidden_tool_args(tool, state)))
            missing = [name for name in tool.hidden if name not in hidden]
            if missing:
                raise AgentrlError(
                    f"{type(self).__name__}.hidden_tool_args gave no {', '.join(missing)} for tool {tool.name!r}"
                )
        try:
            output = await tool.call(call.function.arguments, hidden=hidden)
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
        if self.parallel_tool_calls:
            outputs = await asyncio.gather(*(self.call_tool(call, state) for call in calls))
        else:
            outputs = [await self.call_tool(call, state) for call in calls]
        return [
            Message(role="tool", content=output, tool_call_id=call.id, name=call.function.name)
            for call, output in zip(calls, outputs)
        ]
