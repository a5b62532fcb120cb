"""The MCP relay that runs inside a sandbox: one MCP client session per server, one short command per call.

Standard library only (python3 >= 3.8), uploaded into the sandbox by `agentrl.mcp_servers`:

    python3 relay.py serve SOCKET --stdio -- COMMAND ARG...   # a stdio server started here, as a child
    python3 relay.py serve SOCKET --http URL                   # a streamable-HTTP server on the sandbox's network
    python3 relay.py call SOCKET METHOD PARAMS_JSON             # one request; prints one JSON line

`serve` opens the MCP session (initialize, notifications/initialized), then answers each connection
to the Unix socket SOCKET: one JSON-RPC request in (method, params), its result or error out, one
request at a time, so the server sees one client for the whole episode (its state kept between
calls, as an agent's MCP client keeps it). It prints `ready` or `error: ...` on its first line.
`call` prints `{"result": ...}` or `{"error": "..."}`. Everything it prints is read on the host as
hostile input: it is size-capped and validated there with the `mcp` package's types.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request

PROTOCOL_VERSION = "2025-06-18"
CLIENT = {"name": "agentrl", "version": "1"}
TIMEOUT_S = float(os.environ.get("AGENTRL_MCP_TIMEOUT", "120"))
MAX_LINE = 8 << 20


class StdioServer:
    """A server started as a child; newline-delimited JSON-RPC on its stdin/stdout."""

    def __init__(self, argv):
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr)

    def send(self, message):
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        self.process.stdin.flush()

    def request(self, message):
        self.send(message)
        while True:
            line = self.process.stdout.readline(MAX_LINE)
            if not line:
                raise RuntimeError(f"the MCP server exited (status {self.process.poll()})")
            try:
                answer = json.loads(line)
            except ValueError:
                continue  # a server's stray output line
            if isinstance(answer, dict) and answer.get("id") == message["id"]:
                return answer
            if isinstance(answer, dict) and "method" in answer and "id" in answer:  # a server->client request
                self.send({"jsonrpc": "2.0", "id": answer["id"], "error": {"code": -32601, "message": "not supported"}})


class HttpServer:
    """A streamable-HTTP server: each message is a POST; a JSON or an event-stream answer."""

    def __init__(self, url):
        self.url = url
        self.session = None

    def _post(self, message):
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                   "MCP-Protocol-Version": PROTOCOL_VERSION}
        if self.session:
            headers["Mcp-Session-Id"] = self.session
        request = urllib.request.Request(self.url, data=json.dumps(message).encode(), headers=headers, method="POST")
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        self.session = response.headers.get("Mcp-Session-Id") or self.session
        return response

    def send(self, message):
        self._post(message).read(MAX_LINE)

    def request(self, message):
        response = self._post(message)
        kind = response.headers.get("Content-Type", "")
        if "text/event-stream" not in kind:
            return json.loads(response.read(MAX_LINE))
        data = []
        for raw in response:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif not line and data:
                answer = json.loads("\n".join(data))
                data = []
                if isinstance(answer, dict) and answer.get("id") == message["id"]:
                    return answer
        raise RuntimeError("the MCP server's event stream ended without an answer")


def serve(path, server):
    ids = iter(range(1, 1 << 62))
    answer = server.request({"jsonrpc": "2.0", "id": next(ids), "method": "initialize", "params": {
        "protocolVersion": PROTOCOL_VERSION, "capabilities": {}, "clientInfo": CLIENT}})
    if "error" in answer:
        raise RuntimeError(f"initialize failed: {answer['error']}")
    server.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(8)
    print("ready", flush=True)
    lock = threading.Lock()
    while True:
        connection, _ = listener.accept()
        with connection, lock:
            try:
                question = json.loads(_read_all(connection))
                reply = server.request({"jsonrpc": "2.0", "id": next(ids), "method": question["method"],
                                        "params": question.get("params") or {}})
                out = {"error": str(reply["error"])} if "error" in reply else {"result": reply.get("result")}
            except Exception as error:  # noqa: BLE001 - the caller gets one line
                out = {"error": f"{type(error).__name__}: {error}"}
            connection.sendall(json.dumps(out).encode())


def _read_all(connection):
    chunks = []
    while True:
        chunk = connection.recv(1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def call(path, method, params):
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(TIMEOUT_S)
    connection.connect(path)
    connection.sendall(json.dumps({"method": method, "params": json.loads(params)}).encode())
    connection.shutdown(socket.SHUT_WR)
    sys.stdout.write(_read_all(connection).decode("utf-8", "replace") + "\n")


def main(argv):
    if argv[:1] == ["call"] and len(argv) == 4:
        return call(argv[1], argv[2], argv[3])
    if argv[:1] == ["serve"] and len(argv) >= 4:
        try:
            server = (
                HttpServer(argv[3]) if argv[2] == "--http" else StdioServer(argv[4:] if argv[3] == "--" else argv[3:])
            )
            serve(argv[1], server)
        except Exception as error:  # noqa: BLE001
            print(f"error: {type(error).__name__}: {error}", flush=True)
            sys.exit(1)
        return None
    sys.exit("usage: relay.py serve SOCKET (--stdio -- COMMAND ... | --http URL) | call SOCKET METHOD PARAMS")


if __name__ == "__main__":
    main(sys.argv[1:])
