"""Stopping a run on SIGTERM or SIGINT (Ctrl-C): clean up what it started, keep what it wrote.

Without this, SIGTERM ends the driver at once (Ray's native signal handler prints a stack dump and
re-raises it): no `finally` runs, so the actors' vLLM servers, the Ray cluster it started and its
agents are left to die on their own, if they do. `stop_on_signals()` turns the first SIGTERM or
SIGINT in the driver's main thread into `RunStopped` (said at once on stderr; a `KeyboardInterrupt`, so neither the
orchestrator's `except Exception` nor asyncio's task machinery swallows it); the launcher's
clean-up then stops the servers, the actors and the local cluster, and `stopped_error` gives the
one line the CLI prints (exit status 128 + the signal's number). A Ray actor of the run that dies
(a trainer rank killed, say) ends it the same way: `actor_died_error` is its one line (exit
status 1). Further signals during that clean-up are ignored: every step of it is bounded in
time, and an interrupted clean-up is what leaves processes behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from agentrl.errors import AgentrlError

__all__ = ["RunStopped", "RunStoppedError", "ProcessDiedError", "stop_on_signals", "run_stoppable", "stopped_error",
           "actor_died_error", "actor_error", "ray_messages_to_log"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_STOPPING = "\nstopping ({}): cleaning up what the run started, its folder kept; further signals wait for it\n"
T = TypeVar("T")


class RunStopped(KeyboardInterrupt):
    """SIGTERM or SIGINT reached the driver: the run stops (raised in its main thread)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class ProcessDiedError(AgentrlError):
    """A process of the run (a trainer rank, an actor) died mid-run; its folder is intact and resumable."""

    exit_code = 1


class RunStoppedError(AgentrlError):
    """The run was stopped by a signal after cleaning up; its folder is intact and resumable."""

    def __init__(self, message: str, *, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, the first SIGTERM/SIGINT raises `RunStopped`; later ones are ignored.

    Only in the main thread (the only one Python delivers signals to); elsewhere a no-op.
    The previous handlers come back when the block ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if received:
            return  # cleaning up already: let it finish
        received.append(signum)
        try:  # said at once: the clean-up takes 10-30 s, and said nothing until it was done
            os.write(2, _STOPPING.format(signal.Signals(signum).name).encode())
        except OSError:
            pass
        raise RunStopped(signum)

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def run_stoppable(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, where a `RunStopped` raised inside one of its tasks leaves no traceback behind.

    The signal handler raises in whichever task is running; asyncio stores the stop in that task and re-raises
    it out of the loop, so nothing ever reads the task's exception, and when the task is collected asyncio
    logs "Task exception was never retrieved" with the whole stack, after the run's one error line. The loop
    here drops exactly those reports (a `RunStopped`); every other report goes to asyncio's default handler.
    """

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), RunStopped):
            return
        loop.default_exception_handler(context)

    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(handler)
        return runner.run(main)


@contextmanager
def ray_messages_to_log(log_file: Path) -> Iterator[None]:
    """While the run lasts, the messages Ray's driver prints from the cluster go into `log_file`, not the console.

    `ray.init(log_to_driver=False)` keeps the actors' own output off the console, but the driver still prints the
    raylet's error messages through `ray._private.worker.print_to_stdstream`: at a stop, one "(raylet) Task
    RolloutWorker.run_group failed. There are infinite retries remaining ..." line per in-flight task whose actor
    the clean-up kills, and Ray's "[repeated Nx across cluster]" notes, before the run's one error line. That
    function is swapped for one that appends to the run's logs (restored on exit; with a Ray that lacks it, this
    does nothing)."""
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None:
        yield
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def into_log(data: dict, ignore_prefix: bool = False) -> None:
        with lock, open(log_file, "a", encoding="utf-8", errors="replace") as handle:
            for line in data.get("lines") or []:
                handle.write(f"({data.get('pid', 'ray')}) {line}\n")

    ray_worker.print_to_stdstream = into_log
    try:
        yield
    finally:
        ray_worker.print_to_stdstream = original


def stopped_error(stopped: RunStopped, *, run_dir: Path, checkpoint_step: int | None) -> RunStoppedError:
    """The one line for a stopped run: which signal, what is kept, how to resume."""
    kept = (f"last checkpoint: step {checkpoint_step}" if checkpoint_step is not None
            else "no checkpoint yet: a resume starts from step 0")
    return RunStoppedError(f"stopped by {signal.Signals(stopped.signum).name}; {run_dir} is kept ({kept}); "
                           f"resume with: agentrl train --resume {run_dir}", signum=stopped.signum)


_ACTOR_FIELDS = re.compile(r"^\s*(class_name|name|pid|ip): (\S+)\s*$", re.M)
_EXIT_TYPE = re.compile(r"Worker exit type: (\w+)")


def actor_died_error(
    error: BaseException, *, run_dir: Path, run_id: str, checkpoint_step: int | None
) -> ProcessDiedError:
    """The one line for a run whose Ray actor died (`ray.exceptions.ActorDiedError`): which one, how, how to resume.

    Ray's own message is a paragraph (class, actor id, pid, node, common causes); the line keeps
    the actor's name within the run (`trainer-1`), its class, pid and node, and the exit type.
    """
    text = str(error)
    fields = dict(_ACTOR_FIELDS.findall(text))
    name = fields.get("name", "").removeprefix(f"{run_id}-") or fields.get("class_name", "an actor")
    where = ", ".join(part for part in (
        fields.get("class_name"),
        f"pid {fields['pid']}" + (f" on {fields['ip']}" if "ip" in fields else "") if "pid" in fields else None,
    ) if part)
    how = _EXIT_TYPE.search(text)
    kept = (f"last checkpoint: step {checkpoint_step}" if checkpoint_step is not None
            else "no checkpoint yet: a resume starts from step 0")
    return ProcessDiedError(
        f"{name}{f' ({where})' if where else ''} died{f' ({how.group(1)})' if how else ''}; the run cannot go on"
        f" without it; {run_dir} is kept ({kept}); resume with: agentrl train --resume {run_dir}"
    )


class ActorError(AgentrlError):
    """An actor of the run raised an `AgentrlError` (a trainer rank out of GPU memory, say): its line, and what
    the run folder keeps."""


def actor_error(cause: AgentrlError, *, run_dir: Path, checkpoint_step: int | None) -> ActorError:
    """The one line for a run that an actor's own `AgentrlError` ended (Ray hands it over wrapped in a traceback):
    the actor's line, the run folder kept, how to resume; the cause's exit status."""
    kept = (f"last checkpoint: step {checkpoint_step}" if checkpoint_step is not None
            else "no checkpoint yet: a resume starts from step 0")
    error = ActorError(f"{cause}; {run_dir} is kept ({kept}); resume with: agentrl train --resume {run_dir}")
    error.exit_code = cause.exit_code
    return error
