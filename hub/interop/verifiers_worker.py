"""The worker process of a verifiers package: the package's Environment, served to agentrl's rollout loop.

`python -m agentrl.hub.interop.verifiers_worker SOCKET` runs on the python of the package's venv
(`agentrl.hub.interop.verifiers_venv`), started by `agentrl.hub.interop.verifiers_proxy.VerifiersWorkerEnv`. It
reads `{"path", "kwargs"}` as one JSON line on stdin, loads the package in this process
(`load_in_process`: verifiers is importable here), listens on the Unix socket SOCKET (its folder
is the parent's, mode 0700), prints one JSON line on stdout (`{"ok": ...}` with the name, splits
and tool schemas, or `{"error": "..."}` with the load's one-line error) and serves until its
stdin closes (the parent exited or closed it).

Frames are a 4-byte big-endian length and a JSON object. The parent asks `rows` (a split's
rows), `rollout`, `score` and `run_group`; while one of those runs, the environment's model
calls come back to the parent as `chat` requests on the same connection (answered with the
message and the turn, token ids included, routed experts left in the parent). A rollout's turns
go back as `{"ref": n}` when they are the parent's own turns, so the parent re-attaches its
objects (with their routed experts) instead of receiving them twice.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import struct
import sys
import threading
from typing import Any

__all__ = ["READY", "read_frame", "rollout_from_wire", "rollout_to_wire", "write_frame"]

READY = "agentrl-verifiers-worker: "
"""The prefix of the worker's one status line on stdout (a package may print lines of its own first)."""

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30
_TURN_EXCLUDE = {"prompt_routed_experts": True, "completion": {"routed_experts": True}}


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes")
    return json.loads(await reader.readexactly(size))


def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    writer.write(_HEADER.pack(len(data)) + data)


def rollout_to_wire(rollout: Any, refs: dict[int, int]) -> dict[str, Any]:
    """A Rollout as JSON; a turn the parent made (its id in `refs`) as `{"ref": n}`."""
    wire = rollout.model_dump(mode="json", exclude={"turns"})
    wire["turns"] = [
        {"ref": refs[id(turn)]} if id(turn) in refs else turn.model_dump(mode="json", exclude=_TURN_EXCLUDE)
        for turn in rollout.turns
    ]
    return wire


def rollout_from_wire(wire: dict[str, Any], turns: dict[int, Any]) -> Any:
    """A Rollout from JSON; `{"ref": n}` turns are `turns[n]`."""
    from agentrl.types import Rollout, Turn

    data = dict(wire)
    data["turns"] = [turns[item["ref"]] if "ref" in item else Turn.model_validate(item) for item in wire["turns"]]
    return Rollout.model_validate(data)


class _ParentClient:
    """The ChatClient the package's environment talks to: each call is a `chat` request to the parent."""

    def __init__(self, connection: _Connection, request: int) -> None:
        self.connection = connection
        self.request = request
        self.refs: dict[int, int] = {}
        self.turns: list[Any] = []  # keeps the turns alive, so their ids stay theirs

    async def chat(self, messages, *, tools=None, sampling, previous=None):
        from agentrl.types import Message, Turn

        answer = await self.connection.ask(
            {
                "op": "chat",
                "request": self.request,
                "messages": [message.model_dump(mode="json", exclude_none=True) for message in messages],
                "tools": tools,
                "sampling": sampling.model_dump(mode="json"),
                "previous": None if previous is None else self.refs.get(id(previous)),
                "previous_turn": None if previous is None or id(previous) in self.refs
                else previous.model_dump(mode="json", exclude=_TURN_EXCLUDE),
            }
        )
        turn = Turn.model_validate(answer["turn"])
        self.refs[id(turn)] = answer["ref"]
        self.turns.append(turn)
        return Message.model_validate(answer["message"]), turn


class _Connection:
    """One parent connection: its requests run concurrently; `chat` questions go back on it."""

    def __init__(self, env: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.env, self.reader, self.writer = env, reader, writer
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count(1)
        self.tasks: set[asyncio.Task] = set()

    async def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        question = -next(self.ids)  # the worker's questions have negative ids
        future = asyncio.get_running_loop().create_future()
        self.pending[question] = future
        write_frame(self.writer, {"id": question, **message})
        await self.writer.drain()
        return await future

    async def serve(self) -> None:
        try:
            while True:
                frame = await read_frame(self.reader)
                if frame["id"] < 0:  # the parent's answer to a chat question
                    future = self.pending.pop(frame["id"], None)
                    if future is not None and not future.done():
                        if "error" in frame:
                            future.set_exception(RuntimeError(frame["error"]))
                        else:
                            future.set_result(frame["result"])
                    continue
                task = asyncio.create_task(self._answer(frame))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for task in list(self.tasks):
                task.cancel()
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("the parent closed the connection"))

    async def _answer(self, frame: dict[str, Any]) -> None:
        try:
            result = await self._run(frame)
            reply = {"id": frame["id"], "result": result}
        except Exception as error:  # noqa: BLE001 - the environment's failure goes back as one line
            reply = {"id": frame["id"], "error": " ".join(f"{type(error).__name__}: {error}".split())}
        write_frame(self.writer, reply)
        await self.writer.drain()

    async def _run(self, frame: dict[str, Any]) -> Any:
        from agentrl.sampling import SamplingConfig
        from agentrl.types import Rollout, Task

        op = frame["op"]
        if op == "rows":
            return self.env.get_dataset(frame["split"]).to_list()
        if op == "score":
            rollouts = [Rollout.model_validate(item) for item in frame["rollouts"]]
            return [rollout.model_dump(mode="json") for rollout in await self.env.score(rollouts)]
        client = _ParentClient(self, frame["id"])
        task = Task.model_validate(frame["task"])
        sampling = SamplingConfig.model_validate(frame["sampling"])
        if op == "rollout":
            return rollout_to_wire(await self.env.rollout(client, task, sampling=sampling), client.refs)
        if op == "run_group":
            group = await self.env.run_group(client, task, n=frame["n"], sampling=sampling)
            return [rollout_to_wire(rollout, client.refs) for rollout in group]
        raise ValueError(f"unknown request {op!r}")


def _load(request: dict[str, Any]) -> Any:
    from agentrl.hub.interop.verifiers_project import find_verifiers_project, load_in_process

    project = find_verifiers_project(request["path"])
    if project is None:
        raise ValueError(f"{request['path']}: not a verifiers package")
    return load_in_process(project, dict(request.get("kwargs") or {}))


async def _serve(env: Any, socket_path: str, stop: asyncio.Event) -> None:
    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _Connection(env, reader, writer).serve()
        finally:
            writer.close()

    server = await asyncio.start_unix_server(accept, path=socket_path, limit=MAX_FRAME)
    os.chmod(socket_path, 0o600)
    schemas = env.tool_schemas
    _status({"ok": {"name": env.name, "splits": env.splits, "tool_schemas": schemas}})
    os.dup2(2, 1)  # from now on the package's prints go to the log, never to a pipe nobody reads
    async with server:
        await stop.wait()


def _status(message: dict[str, Any]) -> None:
    sys.stdout.write(READY + json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    from agentrl.errors import AgentrlError
    from agentrl.hub.interop.verifiers_project import WORKER_ENV

    os.environ[WORKER_ENV] = "1"
    socket_path = sys.argv[1]
    request = json.loads(sys.stdin.readline())
    try:
        env = _load(request)
    except AgentrlError as error:
        _status({"error": str(error)})
        sys.exit(2)
    except Exception as error:  # noqa: BLE001 - one line for the parent
        _status({"error": " ".join(f"{type(error).__name__}: {error}".split())})
        sys.exit(2)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def watch_parent() -> None:  # stdin closes when the parent exits or lets the worker go
        sys.stdin.read()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=watch_parent, daemon=True).start()
    loop.run_until_complete(_serve(env, socket_path, stop))


if __name__ == "__main__":
    main()
