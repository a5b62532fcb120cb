"""A verifiers package running in its own venv, as an agentrl Environment of this process.

`VerifiersWorkerEnv.start` starts `agentrl.hub.interop.verifiers_worker` on the python of the venv
`agentrl env install` made for the package (`agentrl.hub.interop.verifiers_venv`), waits for its status
line (the load's one-line error, or the name, splits and tool schemas) and returns an
Environment whose rows, rollouts, scoring and groups run there. The package's model calls come
back over the same connection and go to this process's ChatClient (the token client of
`agentrl eval` and `agentrl train`, so token ids, logprobs and routed experts are the same as for
any agentrl environment); the turns are this process's own objects again when the rollouts
return. One connection per event loop; the worker stops when this process lets it go (`close`,
garbage collection or exit: its stdin closes).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl import env_vars
from agentrl.environment import Environment
from agentrl.errors import AgentrlError
from agentrl.hub.interop.verifiers_worker import READY, read_frame, rollout_from_wire, write_frame
from agentrl.sampling import ChatClient, SamplingConfig
from agentrl.types import Message, Rollout, Task, Turn

if TYPE_CHECKING:
    from agentrl.hub.interop.verifiers_project import VerifiersProject

__all__ = ["VerifiersWorkerEnv"]

START_TIMEOUT_S = float(env_vars.VERIFIERS_START_TIMEOUT.get())
_TURN_EXCLUDE = {"prompt_routed_experts": True, "completion": {"routed_experts": True}}


class _Worker:
    """The worker process, its folder (socket, log) and its stop."""

    def __init__(self, project: VerifiersProject, venv: Path, kwargs: dict[str, Any]) -> None:
        from agentrl.hub.interop.verifiers_project import WORKER_ENV
        from agentrl.hub.interop.verifiers_venv import venv_python

        self.name = project.name
        self.folder = Path(tempfile.mkdtemp(prefix="agentrl-vf-"))
        self.socket = str(self.folder / "s")
        self.log = self.folder / "worker.log"
        env = {**os.environ, WORKER_ENV: "1"}
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [str(venv_python(venv)), "-m", "agentrl.hub.interop.verifiers_worker", self.socket],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(project.folder),
            )
        self.process.stdin.write((json.dumps({"path": str(project.folder), "kwargs": kwargs}) + "\n").encode())
        self.process.stdin.flush()

    def status(self) -> dict[str, Any]:
        """The worker's status line (read until it comes, the process exits or START_TIMEOUT_S passes)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        buffer = b""
        stdout = self.process.stdout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([stdout], [], [], 1.0)
            if not ready:
                if self.process.poll() is not None:
                    break
                continue
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            for line in buffer.decode(errors="replace").splitlines():
                if line.startswith(READY):
                    return json.loads(line[len(READY):])
        self.stop()
        tail = " | ".join(self.log_tail())
        if time.monotonic() >= deadline:
            raise AgentrlError(f"verifiers package {self.name!r}: its worker did not load it in {START_TIMEOUT_S:.0f} s"
                               f" ($AGENTRL_VERIFIERS_START_TIMEOUT); its log: {tail}")
        raise AgentrlError(f"verifiers package {self.name!r}: its worker exited before loading it: {tail}")

    def log_tail(self, lines: int = 3) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        return [line.strip() for line in text.strip().splitlines()[-lines:]]

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.send_signal(signal.SIGKILL)
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)


class _Link:
    """This process's connection to the worker on one event loop: requests out, chat questions in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, worker: _Worker) -> None:
        self.reader, self.writer, self.worker = reader, writer, worker
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.clients: dict[int, ChatClient] = {}
        self.turns: dict[int, list[Turn]] = {}
        self.reading = asyncio.create_task(self._read())

    async def call(self, op: str, client: ChatClient | None = None, **arguments: Any) -> tuple[Any, list[Turn]]:
        request = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.pending[request] = future
        if client is not None:
            self.clients[request] = client
        self.turns[request] = []
        try:
            write_frame(self.writer, {"id": request, "op": op, **arguments})
            await self.writer.drain()
            result = await future
            return result, self.turns[request]
        finally:
            self.pending.pop(request, None)
            self.clients.pop(request, None)
            self.turns.pop(request, None)

    async def _read(self) -> None:
        problem = "the connection closed"
        try:
            while True:
                frame = await read_frame(self.reader)
                if frame["id"] < 0:
                    task = asyncio.create_task(self._chat(frame))
                    task.add_done_callback(lambda done: done.cancelled() or done.exception())
                    continue
                future = self.pending.get(frame["id"])
                if future is None or future.done():
                    continue
                if "error" in frame:
                    future.set_exception(AgentrlError(f"verifiers package {self.worker.name!r}: {frame['error']}"))
                else:
                    future.set_result(frame["result"])
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as error:
            problem = f"{type(error).__name__}: {error}"
        try:  # a closed connection is mostly the worker's end: say how it ended
            exited = await asyncio.to_thread(self.worker.process.wait, 5)
        except subprocess.TimeoutExpired:
            exited = None
        detail = (
            f"its worker exited ({exited}): {' | '.join(self.worker.log_tail())}" if exited is not None else problem
        )
        for future in self.pending.values():
            if not future.done():
                future.set_exception(AgentrlError(f"verifiers package {self.worker.name!r}: {detail}"))

    async def _chat(self, frame: dict[str, Any]) -> None:
        """A model call of the package's environment, made with the ChatClient of the request it serves."""
        request = frame["request"]
        try:
            client, turns = self.clients[request], self.turns[request]
            previous = None
            if frame.get("previous") is not None:
                previous = turns[frame["previous"]]
            elif frame.get("previous_turn") is not None:
                previous = Turn.model_validate(frame["previous_turn"])
            message, turn = await client.chat(
                [Message.model_validate(item) for item in frame["messages"]],
                tools=frame.get("tools"),
                sampling=SamplingConfig.model_validate(frame["sampling"]),
                previous=previous,
            )
            turns.append(turn)
            result = {
                "message": message.model_dump(mode="json", exclude_none=True),
                "turn": turn.model_dump(mode="json", exclude=_TURN_EXCLUDE),
                "ref": len(turns) - 1,
            }
            reply = {"id": frame["id"], "result": result}
        except Exception as error:  # noqa: BLE001 - inference failures are the rollout's, as in-process
            reply = {"id": frame["id"], "error": " ".join(f"{type(error).__name__}: {error}".split())}
        write_frame(self.writer, reply)
        await self.writer.drain()


class VerifiersWorkerEnv(Environment):
    """A verifiers package loaded in its worker process; rollouts, scoring and groups run there."""

    def __init__(
        self, worker: _Worker, status: dict[str, Any], *, folder: Path, venv: Path, kwargs: dict[str, Any]
    ) -> None:
        splits = {split: (lambda split=split: self._rows(split)) for split in status["splits"]}
        super().__init__(name=status["name"], splits=splits)
        self.worker = worker
        self._tool_schemas = status.get("tool_schemas")
        self._links: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._reload = (str(folder), str(venv), dict(kwargs))
        self.path = folder
        self._finalizer = weakref.finalize(self, worker.stop)
        atexit.register(self._finalizer)

    @classmethod
    def start(cls, project: VerifiersProject, venv: Path, kwargs: dict[str, Any]) -> VerifiersWorkerEnv:
        worker = _Worker(project, venv, kwargs)
        status = worker.status()
        if "error" in status:
            worker.stop()
            raise AgentrlError(status["error"])
        return cls(worker, status["ok"], folder=project.folder, venv=venv, kwargs=kwargs)

    def __reduce__(self):  # another process (a Ray worker) starts its own worker on the same venv
        return _reload, self._reload

    def close(self) -> None:
        """Let the worker go (it also goes when this object is collected or the process exits)."""
        self._finalizer()

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self._tool_schemas

    def _rows(self, split: str) -> list[dict[str, Any]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(self.worker.socket)
            data = json.dumps({"id": 1, "op": "rows", "split": split}).encode()
            connection.sendall(struct.pack(">I", len(data)) + data)
            header = _receive(connection, 4)
            frame = json.loads(_receive(connection, struct.unpack(">I", header)[0]))
        if "error" in frame:
            raise AgentrlError(f"verifiers package {self.worker.name!r}: {frame['error']}")
        return frame["result"]

    async def _link(self) -> _Link:
        loop = asyncio.get_running_loop()
        link = self._links.get(loop)
        if link is None or link.reading.done():
            if self.worker.process.poll() is not None:
                raise AgentrlError(f"verifiers package {self.worker.name!r}: its worker exited: "
                                   f"{' | '.join(self.worker.log_tail())}")
            reader, writer = await asyncio.open_unix_connection(self.worker.socket, limit=1 << 30)
            link = self._links[loop] = _Link(reader, writer, self.worker)
        return link

    async def rollout(self, client: ChatClient, task: Task, *, sampling: SamplingConfig) -> Rollout:
        link = await self._link()
        wire, turns = await link.call("rollout", client, task=task.model_dump(mode="json"),
                                      sampling=sampling.model_dump(mode="json"))
        return rollout_from_wire(wire, dict(enumerate(turns)))

    async def score(self, rollouts: list[Rollout]) -> list[Rollout]:
        link = await self._link()
        wires, _ = await link.call("score", rollouts=[rollout.record() for rollout in rollouts])
        scored = [Rollout.model_validate(wire) for wire in wires]
        for rollout, result in zip(rollouts, scored):  # keep this process's turns (routed experts)
            rollout.reward, rollout.metrics, rollout.state = result.reward, result.metrics, result.state
            rollout.error, rollout.truncated, rollout.grader_error = result.error, result.truncated, result.grader_error
        return rollouts

    async def run_group(self, client: ChatClient, task: Task, *, n: int, sampling: SamplingConfig) -> list[Rollout]:
        if n < 1:
            raise AgentrlError(f"run_group: n must be >= 1, got {n}")
        link = await self._link()
        wires, turns = await link.call("run_group", client, task=task.model_dump(mode="json"), n=n,
                                       sampling=sampling.model_dump(mode="json"))
        refs = dict(enumerate(turns))
        return [rollout_from_wire(wire, refs) for wire in wires]


def _reload(path: str, venv: str, kwargs: dict[str, Any]) -> Environment:
    from agentrl.hub.interop.verifiers_project import find_verifiers_project

    return VerifiersWorkerEnv.start(find_verifiers_project(path), Path(venv), kwargs)


def _receive(connection: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise AgentrlError("the verifiers worker closed the connection")
        data += chunk
    return bytes(data)
