"""`docker exec` path of Docker sandboxes (used when the in-container server is unavailable).

The command runs as the sandbox user under `timeout -s KILL` (which kills its whole process
group at the deadline) with a marker variable in its environment. Output is read from the
exec's attach socket frame by frame into capped buffers (a 100 MB print never sits in
memory), stdin is written beside the reads, and a command that outlives its deadline
(a child escaped the process group and holds the output open) is cut off host-side, after
which every process carrying its marker is killed. A sandbox that died meanwhile (OOM of
init, gVisor past its pids limit) is reported as such.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from agentrl import env_vars
from agentrl.sandbox.base import CappedBuffer, RawExecResult, SandboxError

__all__ = ["EXEC_MARKER", "HARD_DEADLINE_GRACE_S", "exec_via_docker", "kill_all_via_docker", "kill_exec_processes"]

HARD_DEADLINE_GRACE_S = 3.0
EXEC_MARKER = env_vars.EXEC_ID.name
# Kill every process that inherited one exec's marker variable (its escaped children too).
_KILL_EXEC = (
    'for d in /proc/[0-9]*; do grep -qz "^{marker}={exec_id}$" "$d/environ" 2>/dev/null '
    '&& kill -9 "${{d#/proc/}}" 2>/dev/null; done; true'
)

# Kill every process but init (pid 1), the container's launcher (the oldest child of init:
# orphans reparented to init come later) and this script, in rounds until none is left. A zombie counts
# only while other threads of it run (its leader ended alone with SYS_exit).
_KILL_ALL = (
    'me=$$; launcher=""; '
    'for d in /proc/[0-9]*; do p=${d#/proc/}; set -- $(sed "s/.*) //" "$d/stat" 2>/dev/null); '
    'if [ "$2" = 1 ] && { [ -z "$launcher" ] || [ "$p" -lt "$launcher" ]; }; then launcher=$p; fi; done; '
    'for round in 1 2 3 4 5 6 7 8 9 10; do n=0; '
    'for d in /proc/[0-9]*; do p=${d#/proc/}; case " 1 $me $launcher " in *" $p "*) continue;; esac; '
    'set -- $(sed "s/.*) //" "$d/stat" 2>/dev/null); '
    'if [ "$1" = Z ]; then t=; while read -r k v; do [ "$k" = Threads: ] && t=$v; done 2>/dev/null < "$d/status"; '
    '[ "$t" = 1 ] && continue; fi; '
    'kill -9 "$p" 2>/dev/null && n=$((n+1)); done; [ "$n" = 0 ] && break; done; true'
)


def exec_via_docker(
    api, container_id: str, *, user: str, argv: list[str], timeout: float, cwd: str, env: dict[str, str],
    stdin: bytes | None, max_output: int, why_dead: Callable[[], str | None],
) -> RawExecResult:
    """Run one command with `docker exec`; `why_dead()` says why the sandbox stopped (None: alive)."""
    wrapped = ["timeout", "-s", "KILL", f"{timeout:.3f}", *argv]
    marker = os.urandom(8).hex()
    started = time.monotonic()
    exec_id = api.exec_create(
        container_id, wrapped, stdin=stdin is not None, user=user,
        environment={**env, EXEC_MARKER: marker}, workdir=cwd,
    )["Id"]
    raw = api.exec_start(exec_id, socket=True)
    sock: socket.socket = raw._sock
    reader = raw._response.raw._fp.fp if hasattr(raw, "_response") else raw
    out, err = CappedBuffer(max_output), CappedBuffer(max_output)
    cut_off = False
    try:
        frames = _FrameReader(reader, sock, out, err, alive=lambda: why_dead() is None)
        if stdin is not None:  # written beside the reads: a command echoing its input must not deadlock
            threading.Thread(target=_send_stdin, args=(sock, stdin), daemon=True).start()
        finished = frames.read_until(started + timeout + 0.5)
        if not finished and api.exec_inspect(exec_id).get("Running"):
            finished = frames.read_until(started + timeout + HARD_DEADLINE_GRACE_S)
        # Not finished: the command is dead but an escaped child still holds its output open.
        cut_off = not finished
    finally:
        try:
            raw._response.close() if hasattr(raw, "_response") else None
        finally:
            raw.close()
    exit_code = -1
    for _ in range(50):
        info = api.exec_inspect(exec_id)
        if not info.get("Running"):
            exit_code = info.get("ExitCode", -1)
            break
        time.sleep(0.02)
    if exit_code is None or exit_code < 0 or exit_code >= 126:
        # A crashed sandbox (gVisor past its pids limit reports 128 before dockerd sees it stop).
        for _ in range(10 if exit_code in (None, -1, 128) else 1):
            dead = why_dead()
            if dead:
                break
            time.sleep(0.2)
        if dead:
            raise SandboxError(f"sandbox {container_id[:12]}: {dead}")
    elapsed = time.monotonic() - started
    timed_out = cut_off or (exit_code == 137 and elapsed >= timeout * 0.98)
    if timed_out:  # children that left the process group (setsid, daemons) die too
        kill_exec_processes(api, container_id, user=user, marker=marker)
    return RawExecResult(
        exit_code=exit_code, stdout=out.getvalue(), stderr=err.getvalue(), stdout_truncated=out.truncated,
        stderr_truncated=err.truncated, timed_out=timed_out,
    )


def kill_exec_processes(api, container_id: str, *, user: str, marker: str) -> None:
    """SIGKILL every process in the container that carries this command's marker."""
    script = _KILL_EXEC.format(marker=EXEC_MARKER, exec_id=marker)
    exec_id = api.exec_create(container_id, ["/bin/sh", "-c", script], user=user)["Id"]
    api.exec_start(exec_id)


def kill_all_via_docker(api, container_id: str) -> None:
    """SIGKILL every process but the container's init and launcher (as root, which holds CAP_KILL)."""
    exec_id = api.exec_create(container_id, ["/bin/sh", "-c", _KILL_ALL], user="0:0")["Id"]
    api.exec_start(exec_id)


class _FrameReader:
    """Demultiplexes Docker's attach stream (8-byte headers) into two capped buffers."""

    IDLE_CHECK_S = 2.0

    def __init__(self, reader, sock: socket.socket, out: CappedBuffer, err: CappedBuffer, *, alive) -> None:
        self.sock, self.out, self.err = sock, out, err
        self.alive = alive  # called after IDLE_CHECK_S without data: False ends the read
        self.pending = b""
        # The HTTP parser may have buffered the stream's first bytes; take them without
        # blocking, then read the socket itself (select + recv survive idle timeouts).
        sock.setblocking(False)
        try:
            initial = reader.read1(65536)
        except (BlockingIOError, OSError):
            initial = None
        sock.setblocking(True)
        if initial:
            self._feed(initial)

    def read_until(self, deadline: float) -> bool:
        """Read until the stream ends or the sandbox died (True) or the deadline passes (False)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            readable, _, _ = select.select([self.sock], [], [], min(remaining, self.IDLE_CHECK_S))
            if not readable:
                if not self.alive():
                    return True
                continue
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return True
            if not chunk:
                return True
            self._feed(chunk)

    def _feed(self, chunk: bytes) -> None:
        self.pending += chunk
        while len(self.pending) >= 8:
            stream_type, size = struct.unpack(">BxxxL", self.pending[:8])
            if len(self.pending) < 8 + size:
                break
            payload, self.pending = self.pending[8 : 8 + size], self.pending[8 + size :]
            (self.err if stream_type == 2 else self.out).write(payload)


def _send_stdin(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # the command exited without reading all of it
        pass
