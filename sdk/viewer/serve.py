"""Serving the viewer with uvicorn on 127.0.0.1: in the foreground (`agentrl view`) or in a thread.

`serve(paths, port=...)` blocks until Ctrl-C; `ViewerServer(paths)` starts the same server in a
background thread (tests, bench/viewer.py) and stops it on `stop()` or leaving its `with`. Port 0
takes a free port; the URL is known once the socket is bound. Only loopback is ever bound.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from agentrl.errors import AgentrlError, require

__all__ = ["HOST", "ViewerServer", "serve", "view_command"]

HOST = "127.0.0.1"


def view_command(*paths: str | Path) -> str:
    """The command that opens the viewer on these folders (printed by `agentrl train` and `agentrl eval`)."""
    import shlex

    return "agentrl view " + " ".join(shlex.quote(str(path)) for path in paths)


def _bound_socket(port: int) -> socket.socket:
    """A socket bound to HOST:port and already listening: a client given the URL at once is queued
    in the backlog until the server accepts, never refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise AgentrlError(f"agentrl view: port {port} on {HOST} is taken ({error.strerror}); "
                           "pass another --port, or --port 0 for a free one") from None
    return sock


def _server(paths: list[str | Path]):
    uvicorn = require("uvicorn", "view")
    require("starlette", "view")
    from agentrl.viewer.app import create_app

    config = uvicorn.Config(create_app(paths), log_level="warning", access_log=False, lifespan="off")
    return uvicorn.Server(config)


def serve(paths: list[str | Path], *, port: int = 8765, on_ready=None) -> None:
    """Serve the viewer on http://127.0.0.1:PORT until interrupted."""
    server = _server(paths)
    sock = _bound_socket(port)
    try:
        if on_ready is not None:
            on_ready(f"http://{HOST}:{sock.getsockname()[1]}/")
        server.run(sockets=[sock])
    finally:
        sock.close()


class ViewerServer:
    """The viewer in a background thread: `with ViewerServer([run_dir]) as viewer: viewer.url`."""

    def __init__(self, paths: list[str | Path], *, port: int = 0) -> None:
        self._server = _server(paths)
        self._socket = _bound_socket(port)
        self.url = f"http://{HOST}:{self._socket.getsockname()[1]}/"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="agentrl-viewer", daemon=True)

    def start(self, *, timeout_s: float = 30.0) -> ViewerServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise AgentrlError(f"agentrl view: the server did not start within {timeout_s:g} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._socket.close()

    def __enter__(self) -> ViewerServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
