"""agentrl's in-sandbox MCP relay against the `mcp` package's own client and server, on this host.

- the test server (tests/fixtures/mcp/notes_server.py, standard library only, so sandbox images without
  `mcp` can run it) answers the `mcp` package's own stdio client: it speaks the protocol;
- the relay (`agentrl.mcp_relay`) drives a server written with the `mcp` package (`MCPServer`, stdio)
  and the test server over streamable HTTP: one session across calls (state kept), results that
  `mcp.types.CallToolResult` accepts, a tool error as `isError`;
- `SandboxMcp`'s text of results, and `check_local`'s one-line refusal of a server off the sandbox's
  network.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from agentrl.errors import AgentrlError
from agentrl.mcp_servers import McpServerSpec, check_local, result_text

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "tests" / "fixtures" / "mcp" / "notes_server.py"
RELAY = ROOT / "sdk" / "mcp_relay.py"
LIBRARY_SERVER = '''
from mcp.server.mcpserver import MCPServer

app = MCPServer("adder")
TOTAL = [0]


@app.tool()
def add(value: int) -> str:
    """Add to the running total."""
    TOTAL[0] += value
    return f"total {TOTAL[0]}"


app.run()
'''


def test_the_test_server_speaks_mcp_to_the_library_client():
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    async def main():
        async with stdio_client(StdioServerParameters(command=sys.executable, args=[str(NOTES)])) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = await session.list_tools()
                first = await session.call_tool("add_note", {"text": "a"})
                second = await session.call_tool("add_note", {"text": "b"})
                failed = await session.call_tool("fail", {})
                return [tool.name for tool in tools.tools], first, second, failed

    names, first, second, failed = anyio.run(main)
    assert names == ["add_note", "list_notes", "count_words", "fail"]
    assert (first.content[0].text, second.content[0].text) == ("noted (1)", "noted (2)")
    assert failed.is_error


def _serve(tmp_path, *target: str) -> tuple[subprocess.Popen, str]:
    sock = str(tmp_path / "s.sock")
    process = subprocess.Popen([sys.executable, str(RELAY), "serve", sock, *target], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process, sock


def _call(sock: str, method: str, params: dict) -> dict:
    out = subprocess.run([sys.executable, str(RELAY), "call", sock, method, json.dumps(params)],
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_relay_keeps_one_session_with_a_library_server(tmp_path):
    from mcp.types import CallToolResult, ListToolsResult

    server = tmp_path / "adder.py"
    server.write_text(LIBRARY_SERVER)
    process, sock = _serve(tmp_path, "--stdio", "--", sys.executable, str(server))
    try:
        tools = ListToolsResult.model_validate(_call(sock, "tools/list", {})["result"])
        assert [tool.name for tool in tools.tools] == ["add"]
        assert tools.tools[0].input_schema["properties"]["value"]["type"] == "integer"
        results = [CallToolResult.model_validate(_call(sock, "tools/call", {"name": "add", "arguments": {"value": v}})
                                                 ["result"]) for v in (2, 3)]
        assert [result_text(result) for result in results] == ["total 2", "total 5"]  # one session: state kept
        bad = CallToolResult.model_validate(_call(sock, "tools/call", {"name": "add", "arguments": {"value": "x"}})
                                            ["result"])
        assert bad.is_error and result_text(bad).startswith("Error: ")
    finally:
        process.kill()
        process.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_relay_over_streamable_http(tmp_path):
    from mcp.types import CallToolResult

    port = _free_port()
    server = subprocess.Popen([sys.executable, str(NOTES), "--http", str(port), "127.0.0.1"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        process, sock = _serve(tmp_path, "--http", f"http://127.0.0.1:{port}/mcp")
        try:
            for text in ("x", "y"):
                _call(sock, "tools/call", {"name": "add_note", "arguments": {"text": text}})
            listed = CallToolResult.model_validate(_call(sock, "tools/call", {"name": "list_notes"})["result"])
            assert result_text(listed) == "x\ny"
            assert "unknown tool" in _call(sock, "tools/call", {"name": "nope"})["error"]
        finally:
            process.kill()
            process.wait()
    finally:
        server.kill()
        server.wait()


def test_servers_off_the_sandbox_network_are_one_line():
    local = McpServerSpec(name="db", transport="streamable-http", url="http://db-mcp:8000/mcp")
    check_local(local, service_hosts={"db-mcp"}, where="task.toml")
    remote = McpServerSpec(name="search", transport="streamable-http", url="https://api.example.com/mcp")
    with pytest.raises(AgentrlError, match=r"task.toml: MCP server 'search' at 'https://api.example.com/mcp' is not "
                       r"on the sandbox's own network \(db-mcp\); it would need the internet") as caught:
        check_local(remote, service_hosts={"db-mcp"}, where="task.toml")
    assert "\n" not in str(caught.value)
    with pytest.raises(AgentrlError, match="has no command"):
        check_local(McpServerSpec(name="x"), service_hosts=set(), where="task.toml")


def test_the_relays_episode_timeout_is_the_longest_a_sandbox_accepts():
    from agentrl.mcp_servers import RELAY_TIMEOUT_S
    from agentrl.sandbox.base import MAX_TIMEOUT_S

    assert RELAY_TIMEOUT_S == MAX_TIMEOUT_S
