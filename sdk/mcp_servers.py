"""MCP servers in or beside a sandbox, their tools offered to the policy as ordinary tool calls.

An environment names its servers with `McpServerSpec`s: `stdio` (a command run *inside* the
agent's sandbox, which must hold it) or `streamable-http` (a URL on the sandbox's own network, e.g.
a Harbor compose service; the sandbox has no other route out, so a server on the internet is
refused in one line by the environment that reads the spec, `check_local`). `SandboxMcp` puts
`agentrl.mcp_relay` (standard library only) into the sandbox, starts one relay per server there
(the MCP session: initialize once, one client for the whole episode), lists the tools and calls
them, each call one short command in the sandbox. The relay's output is hostile like any sandbox
output: capped, parsed as JSON, validated with the `mcp` package's own types (`ListToolsResult`,
`CallToolResult`) before anything reaches the model. Tools are offered under their own names
(`<server>_<tool>` when two servers share one); the calls and results are the rollout's tool
calls and tool messages, so they are in the token stream, `rollouts.jsonl` and the viewer.

A relay that died (the agent killed it; `kill_processes` between steps) is started again at the
next call, with a new session.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field

from agentrl.config import BaseConfig
from agentrl.errors import AgentrlError
from agentrl.types import untrusted_json

RELAY_TIMEOUT_S = 7 * 86_400.0
"""The relay's command runs for the episode: the longest timeout a sandbox accepts (`agentrl.sandbox.base.
MAX_TIMEOUT_S`; the core does not import the sandboxes, a test keeps the two equal)."""

__all__ = ["McpServerSpec", "SandboxMcp", "check_local", "result_text"]

RELAY_DIR = "/tmp/.agentrl-mcp"
RELAY_SOURCE = Path(__file__).with_name("mcp_relay.py")
MAX_REPLY_BYTES = 4 << 20
START_TIMEOUT_S = 60.0


class McpServerSpec(BaseConfig):
    """One MCP server an environment offers the agent."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """The server's name (tools of two servers with the same name are prefixed with it)."""
    transport: Literal["stdio", "streamable-http"] = "stdio"
    """`stdio`: `command` runs inside the sandbox; `streamable-http`: `url` on the sandbox's network."""
    command: str | None = None
    """The stdio server's program (in the sandbox's image)."""
    args: list[str] = []
    """Its arguments."""
    env: dict[str, str] = {}
    """Extra environment variables of the stdio server."""
    url: str | None = None
    """The streamable-HTTP endpoint, e.g. `http://mcp-server:8000/mcp` (a compose service)."""


def check_local(spec: McpServerSpec, *, service_hosts: set[str], where: str) -> None:
    """One line when the server cannot run here: a stdio server without a command, an HTTP server that is
    not one of `service_hosts` (the sandbox's own network: it would need the internet, which sandboxes lack)."""
    if spec.transport == "stdio":
        if not spec.command:
            raise AgentrlError(f"{where}: MCP server {spec.name!r} (stdio) has no command")
        return
    host = urlsplit(spec.url or "").hostname or ""
    if host not in service_hosts:
        raise AgentrlError(
            f"{where}: MCP server {spec.name!r} at {spec.url!r} is not on the sandbox's own network "
            f"({', '.join(sorted(service_hosts)) or 'no services'}); it would need the internet, which agentrl's "
            "sandboxes do not have"
        )


def _schema(name: str, tool: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": tool.description or "",
                                             "parameters": tool.input_schema or {"type": "object"}}}


def result_text(result: Any) -> str:
    """A CallToolResult as the text the model sees (structured content when there is no text part)."""
    parts = []
    for item in result.content:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource" and hasattr(item.resource, "text"):
            parts.append(item.resource.text)
        else:
            parts.append(f"[{kind} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    text = "\n".join(parts)
    return f"Error: {text}" if result.is_error else text


class SandboxMcp:
    """The MCP servers of one episode in its sandbox: start, list tools, call."""

    def __init__(self, sandbox: Any, specs: list[McpServerSpec]) -> None:
        self.sandbox = sandbox
        self.specs = {spec.name: spec for spec in specs}
        self.routes: dict[str, tuple[str, str]] = {}
        """Offered tool name -> (server, the server's own tool name)."""
        self.schemas: list[dict[str, Any]] = []
        self._relays: dict[str, asyncio.Task] = {}

    def _socket(self, server: str) -> str:
        return f"{RELAY_DIR}/{server}.sock"

    async def _start(self, spec: McpServerSpec) -> None:
        """Run the relay as a command of its own for the episode (bubblewrap ends a command's processes with
        it, so the relay is a running command, not a background job) and wait for its first line."""
        sock = self._socket(spec.name)
        old = self._relays.pop(spec.name, None)
        if old is not None:
            old.cancel()
        await self.sandbox.exec(["rm", "-f", sock, f"{sock}.log"])
        target = ["--stdio", "--", spec.command, *spec.args] if spec.transport == "stdio" else ["--http", spec.url]
        serve = " ".join(shlex.quote(part) for part in ["python3", f"{RELAY_DIR}/relay.py", "serve", sock, *target])
        env = "".join(f"{key}={shlex.quote(value)} " for key, value in spec.env.items())
        relay = asyncio.create_task(self.sandbox.exec(
            ["/bin/sh", "-c", f"{env}exec {serve} > {sock}.log 2>&1 < /dev/null"], timeout=RELAY_TIMEOUT_S))
        relay.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._relays[spec.name] = relay
        wait = (f"for i in $(seq 1 {int(START_TIMEOUT_S * 10)}); do "
                f"head -n1 {sock}.log 2>/dev/null | grep -q . && break; sleep 0.1; done; head -n1 {sock}.log")
        result = await self.sandbox.exec(["/bin/sh", "-c", wait], timeout=START_TIMEOUT_S + 10)
        first = result.stdout.strip()[:300]
        if first != "ready":
            tail = (await self.sandbox.exec(["/bin/sh", "-c", f"tail -n 3 {sock}.log"])).stdout.strip()[-300:]
            raise AgentrlError(f"MCP server {spec.name!r} did not start in the sandbox: "
                               f"{first or 'no answer'} {' | '.join(tail.splitlines()[1:])}".strip())

    def stop(self) -> None:
        """Stop waiting on the relays (their processes end with the sandbox, or at `kill_processes`)."""
        for relay in self._relays.values():
            relay.cancel()
        self._relays.clear()

    async def aclose(self) -> None:
        self.stop()

    async def start(self) -> list[dict[str, Any]]:
        """Put the relay in the sandbox, start every server and list their tools (OpenAI tool schemas)."""
        from mcp.types import ListToolsResult

        check = await self.sandbox.exec(["/bin/sh", "-c", "command -v python3"])
        if check.exit_code != 0:
            raise AgentrlError("MCP servers in a sandbox need python3 in its image (agentrl's relay runs on it)")
        await self.sandbox.write_file(f"{RELAY_DIR}/relay.py", RELAY_SOURCE.read_text(), mode=0o755)
        await asyncio.gather(*(self._start(spec) for spec in self.specs.values()))
        listed: list[tuple[str, Any]] = []
        for server in self.specs:
            result = ListToolsResult.model_validate(await self._request(server, "tools/list", {}))
            listed += [(server, tool) for tool in result.tools]
        counts: dict[str, int] = {}
        for _, tool in listed:
            counts[tool.name] = counts.get(tool.name, 0) + 1
        for server, tool in listed:
            name = tool.name if counts[tool.name] == 1 else f"{server}_{tool.name}"
            if name in self.routes:  # a route taken already would be overwritten: refuse, naming both
                first_server, first_tool = self.routes[name]
                if (first_server, first_tool) == (server, tool.name):
                    raise AgentrlError(f"MCP server {server!r} lists tool {tool.name!r} twice")
                raise AgentrlError(
                    f"MCP tool name {name!r} would be both server {first_server!r}'s tool {first_tool!r} and server "
                    f"{server!r}'s tool {tool.name!r} (tools of the same name are prefixed with their server's "
                    "name): rename one of the servers")
            self.routes[name] = (server, tool.name)
            self.schemas.append(_schema(name, tool))
        return self.schemas

    async def _request(self, server: str, method: str, params: dict[str, Any], *, retry: bool = True) -> Any:
        argv = ["python3", f"{RELAY_DIR}/relay.py", "call", self._socket(server), method, json.dumps(params)]
        raw = await self.sandbox.exec_bytes(argv, max_output=MAX_REPLY_BYTES)
        try:
            reply = untrusted_json(raw.stdout.decode("utf-8", "replace"))
            if not isinstance(reply, dict):
                raise ValueError("not an object")
        except ValueError:
            if retry and raw.exit_code != 0:  # the relay is gone: start it again, once
                await self._start(self.specs[server])
                return await self._request(server, method, params, retry=False)
            problem = (raw.stderr or raw.stdout).decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
            raise AgentrlError(f"MCP server {server!r}: {method} gave no answer: {problem[0][:300]}") from None
        if "error" in reply:
            raise AgentrlError(f"MCP server {server!r}: {method} failed: {str(reply['error'])[:300]}")
        return reply.get("result")

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Call an offered tool; the text the model sees (a tool's own error as `Error: ...`)."""
        from mcp.types import CallToolResult

        if name not in self.routes:
            raise AgentrlError(f"unknown MCP tool {name!r}")
        server, tool = self.routes[name]
        try:
            result = await self._request(server, "tools/call", {"name": tool, "arguments": arguments})
            return result_text(CallToolResult.model_validate(result))
        except AgentrlError as error:
            return f"Error: {error}"
        except (ValueError, RecursionError) as error:  # a result the mcp types refuse
            return f"Error: MCP server {server!r} answered {name} with an invalid result ({str(error)[:200]})"
