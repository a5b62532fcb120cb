"""Host side of the in-container command server (`sandboxd.py`) of Docker sandboxes.

The container's main process is `sandboxd` (when the image has python3), started with
stdin open. Before the container starts, the host attaches to its stdin/stdout/stderr
(one hijacked connection); requests go out as length-prefixed `marshal` frames on stdin
(written by the host, read by sandboxd), answers come back as JSON lines on stdout inside
Docker's multiplexed frames, parsed on the host (never unmarshalled: the sandbox is
untrusted). Each request carries a fresh random token; an answer counts only when its id
is waited for and its token matches. An answer with a waited-for id and a wrong token
means something inside wrote into the channel: the connection is marked `tampered`, closed,
and the sandbox falls back to `docker exec`. A reader thread owns the socket's read side.
When the server is gone (no python3 in the image, the model killed it, the connection
dropped), `alive` turns False, the host stops reading, and the sandbox falls back to `docker
exec`. The launcher (sandboxd's parent, which keeps the container running) then waits on stdin
with shell builtins only: it holds sandboxd's capabilities, so it must never run a program of
the image, which a root on a writable root can have replaced. A line longer than any answer
(`MAX_ANSWER_LINE_BYTES`) is tampering too: the host never holds more.
"""

from __future__ import annotations

import itertools
import json
import marshal
import secrets
import select
import socket
import struct
import threading
from pathlib import Path

__all__ = ["MAX_ANSWER_LINE_BYTES", "SERVER_MAX_OUTPUT_BYTES", "ServerConnection", "server_command"]

_SOURCE = (Path(__file__).with_name("sandboxd.py")).read_bytes()
HEADER = 12  # every message to sandboxd: a 12-digit length, then the bytes
# The launcher reads sandboxd's source from stdin (a short command line in `ps`), unbuffered
# so that no request is swallowed. If python3 is missing or the server ends, the container
# stays up for `docker exec`.
_READ_SOURCE = (
    "import os\n"
    "def read(n):\n"
    "    data = b''\n"
    "    while len(data) < n:\n"
    "        chunk = os.read(0, n - len(data))\n"
    "        if not chunk: raise SystemExit(1)\n"
    "        data += chunk\n"
    "    return data\n"
    f"exec(compile(read(int(read({HEADER}))), 'sandboxd', 'exec'))\n"
)
_LAUNCH = (
    "if command -v python3 >/dev/null 2>&1; then python3 -I -S -c \"$0\"; fi; "
    "echo '{\"gone\": 1}'; while read -r _; do :; done"  # until the host closes stdin (the sandbox closes)
)


SERVER_MAX_OUTPUT_BYTES = 8 * 1024 * 1024
"""The largest `max_output` a command sent through sandboxd may have (larger ones go through docker exec)."""
MAX_ANSWER_LINE_BYTES = 2 * (SERVER_MAX_OUTPUT_BYTES * 4 // 3 + 4) + 65536
"""The longest line a genuine answer can be (stdout and stderr in base64, and the rest): a longer one is something
inside writing into the channel, so the host stops reading instead of holding it all."""


def _frame(payload: bytes) -> bytes:
    return b"%012d" % len(payload) + payload


def server_command() -> list[str]:
    """The container command that runs sandboxd."""
    return ["/bin/sh", "-c", _LAUNCH, _READ_SOURCE]


class ServerConnection:
    """One attached connection to a sandbox's sandboxd, shared by concurrent callers."""

    def __init__(self, api, container_id: str) -> None:
        self.api = api
        self.container_id = container_id
        self.alive = False
        self.tampered = False
        """An answer with a wrong token arrived: something inside wrote into the channel."""
        self.launcher_pid = 0
        """The container's launcher process (sandboxd's parent), which `kill_all` must spare."""
        self.ready = threading.Event()  # set on hello or when the server is gone
        self.hello = threading.Event()  # set once sandboxd said it serves requests
        self._ids = itertools.count()
        self._waiting: dict[int, list] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._raw = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def attach(self) -> None:
        """Attach to the (created, not yet started) container's streams and start reading."""
        raw = self.api.attach_socket(self.container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        self._raw = raw
        self._sock = raw._sock
        reader = raw._response.raw._fp.fp if hasattr(raw, "_response") else raw
        self._sock.setblocking(False)
        try:
            initial = reader.read1(65536)
        except (BlockingIOError, OSError):
            initial = None
        self._sock.setblocking(True)
        self.alive = True
        self._sock.sendall(_frame(_SOURCE))  # read by the launcher once it starts
        self._thread = threading.Thread(target=self._read_loop, args=(initial or b"",), daemon=True,
                                        name=f"sandboxd-{self.container_id[:12]}")
        self._thread.start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait for sandboxd's hello (or its 'gone'); True when it serves requests."""
        self.ready.wait(timeout)
        return self.alive and self.hello.is_set()

    def _read_loop(self, pending: bytes) -> None:
        line_buffer = bytearray()
        frames = bytearray(pending)
        try:
            while True:
                while len(frames) >= 8:
                    stream_type, size = struct.unpack(">BxxxL", frames[:8])
                    if len(frames) < 8 + size:
                        break
                    payload = bytes(frames[8 : 8 + size])
                    del frames[: 8 + size]
                    if stream_type == 1:  # answers are JSON lines; a long one spans many frames
                        start = 0
                        while (newline := payload.find(b"\n", start)) >= 0:
                            line_buffer += payload[start:newline]
                            self._dispatch(bytes(line_buffer))
                            line_buffer.clear()
                            start = newline + 1
                        line_buffer += payload[start:]
                        if len(line_buffer) > MAX_ANSWER_LINE_BYTES:
                            self.tampered = True
                            break
                if self.tampered or not self.alive:  # nothing more to read: stdin stays open, the container runs
                    break
                readable, _, _ = select.select([self._sock], [], [], 5.0)
                if not readable:
                    continue
                chunk = self._sock.recv(262144)
                if not chunk:
                    break
                frames += chunk
        except (OSError, ValueError):
            pass
        finally:
            if self.tampered:
                self.close()
            self._shut_down()

    def _dispatch(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        if "ready" in message and not self.hello.is_set():
            self.launcher_pid = int(message.get("launcher") or 0)
            self.hello.set()
            self.ready.set()
            return
        if "gone" in message:
            self._shut_down()
            return
        with self._lock:
            slot = self._waiting.get(message.get("id"))
            if slot is not None and message.get("token") != slot[2]:
                slot = None
                self.tampered = True
            elif slot is not None:
                del self._waiting[message["id"]]
        if self.tampered:
            self.close()
            self._shut_down()
            return
        if slot is not None:
            slot[1] = message
            slot[0].set()

    def _shut_down(self) -> None:
        self.alive = False
        self.ready.set()
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for slot in waiting.values():
            slot[0].set()  # answer None: the caller falls back or reports the sandbox dead

    def request(self, *, argv: list[str], cwd: str, env: dict[str, str], stdin: bytes | None, timeout: float,
                max_output: int, marker: str, wait: float) -> dict | None:
        """Send one command; its answer, or None when the server died or did not answer within `wait`."""
        return self._send({"marker": marker, "argv": list(argv), "cwd": cwd, "env": dict(env),
                           "timeout": float(timeout), "max_output": int(max_output), "stdin": stdin}, wait=wait)

    def kill_all(self, *, wait: float, within_s: float = 10.0) -> dict | None:
        """Ask sandboxd to kill every process but init, the launcher and itself, trying for `within_s`; its answer
        (`killed`, `survivors`: processes still running when it gave up) or None."""
        return self._send({"op": "kill_all", "within_s": float(within_s)}, wait=wait)

    def _send(self, message: dict, *, wait: float) -> dict | None:
        if not self.alive:
            return None
        request_id = next(self._ids)
        token = secrets.token_hex(16)
        slot: list = [threading.Event(), None, token]
        with self._lock:
            self._waiting[request_id] = slot
        data = _frame(marshal.dumps({"id": request_id, "token": token, **message}))
        try:
            with self._write_lock:
                self._sock.sendall(data)
        except OSError:
            self._shut_down()
            return None
        answered = slot[0].wait(wait)
        with self._lock:
            self._waiting.pop(request_id, None)
        return slot[1] if answered else None

    def close(self) -> None:
        self.alive = False
        for closer in (getattr(self._raw, "_response", None), self._raw):
            try:
                if closer is not None:
                    closer.close()
            except Exception:  # closing a socket the daemon already dropped
                pass
