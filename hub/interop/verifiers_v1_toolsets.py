"""verifiers v1 MCP toolsets (`vf.Toolset`) served to agentrl's loop, as verifiers serves them by default.

A taskset's `toolsets(config)` (one instance shared by every rollout) and a task's `toolsets(config)`
(a fresh instance per rollout, `setup_task(task)` run on it) are MCP servers written with `@vf.tool`
methods. verifiers' default runs each as a server process beside the rollout (the `subprocess`
runtime on the evaluating machine) and hands its tools to the harness; here each is an `mcp`
`MCPServer` in the package's worker process, registered by the toolset's own `register`, set up by
its own `setup`, reached through the `mcp` package's in-memory `Client` (one client session per
rollout, so the protocol, schemas and results are MCP's). `ToolsetMcp` has the interface of
`agentrl.mcp_servers.SandboxMcp` (`routes`, `schemas`, `call`, `aclose`), so `ToolEnv` offers the
tools beside its own and routes their calls.

Refused in one line at load (`refuse_toolsets`): a toolset with a `url` (a remote server: it would need
the internet), a `colocated` one (verifiers installs the package in the task's box and runs it
there), one whose typed state is synced with the rollout's trace state (agentrl keeps no state channel).
"""

from __future__ import annotations

import contextlib
from typing import Any

from agentrl.errors import AgentrlError

__all__ = ["ToolsetMcp", "refuse_toolsets"]


def refuse_toolsets(name: str, toolsets: list[Any]) -> None:
    from verifiers.v1.state import State

    for toolset in toolsets:
        label = f"verifiers taskset {name!r}: MCP toolset {type(toolset).__name__}"
        config = toolset.config
        if getattr(config, "url", None):
            raise AgentrlError(f"{label} is a remote server at {config.url!r}; it would need the internet, which "
                               "agentrl's rollouts do not have")
        if getattr(config, "colocated", False):
            raise AgentrlError(f"{label} is colocated (verifiers installs the package in the task's box and runs "
                               "it there), which agentrl does not run")
        if toolset._state_cls is not State:
            raise AgentrlError(f"{label} syncs its typed state ({toolset._state_cls.__name__}) with the rollout, "
                               "which agentrl does not run")


class ToolsetMcp:
    """One rollout's view of its toolsets: in-memory MCP client sessions to their servers."""

    def __init__(self, shared: list[tuple[Any, Any]], task_toolsets: list[Any]) -> None:
        self.shared = shared
        """(toolset, MCPServer) pairs set up once for the environment."""
        self.task_toolsets = task_toolsets
        self.routes: dict[str, tuple[Any, str]] = {}
        self.schemas: list[dict[str, Any]] = []
        self._stack = contextlib.AsyncExitStack()

    @staticmethod
    async def serve(toolset: Any) -> Any:
        """The toolset as an MCPServer, registered and set up by its own code."""
        from mcp.server.mcpserver import MCPServer

        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        await toolset.setup()
        return server

    async def start(self, vf_task: Any) -> list[dict[str, Any]]:
        from mcp import Client

        servers = list(self.shared)
        for toolset in self.task_toolsets:
            server = await self.serve(toolset)
            await toolset.setup_task(vf_task)
            servers.append((toolset, server))
        listed = []
        for toolset, server in servers:
            client = await self._stack.enter_async_context(Client(server))
            listed += [(toolset, client, tool) for tool in (await client.list_tools()).tools]
        counts: dict[str, int] = {}
        for _, _, tool in listed:
            counts[tool.name] = counts.get(tool.name, 0) + 1
        for toolset, client, tool in listed:
            name = tool.name if counts[tool.name] == 1 else f"{toolset.server_name}_{tool.name}"
            self.routes[name] = (client, tool.name)
            self.schemas.append({"type": "function", "function": {
                "name": name, "description": tool.description or "",
                "parameters": tool.input_schema or {"type": "object"}}})
        return self.schemas

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        from agentrl.mcp_servers import result_text

        client, tool = self.routes[name]
        try:
            return result_text(await client.call_tool(tool, arguments))
        except Exception as error:  # noqa: BLE001 - the model sees the failure, as from any tool
            return f"Error: {type(error).__name__}: {error}"

    async def aclose(self) -> None:
        await self._stack.aclose()
