"""`agentrl.rl.stopping`: real signals to a real process, the one line a stopped run prints.

(The whole run stopped by SIGTERM / SIGINT, servers and Ray included: tests/e2e/test_train_stop.py.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.rl.stopping import RunStopped, stopped_error

_CHILD = r"""
import asyncio, gc, os, signal, sys, time
from agentrl.rl.stopping import RunStopped, run_stoppable, stop_on_signals

signum = int(sys.argv[1])
# what this process started with (SIGINT is SIG_IGN under a shell's background job, not Python's default handler)
before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)

async def busy():
    try:  # the handler runs inside this task, between two of its bytecodes
        os.kill(os.getpid(), signum)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pass
    except Exception:  # an orchestrator's `except Exception` must not swallow the stop
        print("swallowed", flush=True)
    await asyncio.sleep(0)

async def main():
    await asyncio.gather(asyncio.sleep(10), asyncio.ensure_future(busy()))

with stop_on_signals():
    try:
        run_stoppable(main())
    except RunStopped as stopped:
        print("stopped", stopped.signum, flush=True)
        gc.collect()  # the stopped task goes: asyncio reports an exception nobody read, if it was not told not to
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal during the clean-up is ignored
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        print("cleaned up", flush=True)
print("restored", signal.getsignal(signal.SIGTERM) == before[0], signal.getsignal(signal.SIGINT) == before[1],
      flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_first_signal_stops_the_block_and_later_ones_wait_for_its_clean_up(signum):
    out = subprocess.run([sys.executable, "-c", _CHILD, str(int(signum))], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [f"stopped {int(signum)}", "cleaned up", "restored True True"], out.stdout
    # the stop said at once, and nothing else: no "Task exception was never retrieved" and its traceback
    assert out.stderr == (f"\nstopping ({signal.Signals(signum).name}): cleaning up what the run started, its folder "
                          "kept; further signals wait for it\n"), out.stderr[-2000:]


def test_the_stopped_line_names_the_signal_what_is_kept_and_how_to_resume(tmp_path: Path):
    error = stopped_error(RunStopped(signal.SIGTERM), run_dir=tmp_path / "run", checkpoint_step=3)
    assert str(error) == (f"stopped by SIGTERM; {tmp_path / 'run'} is kept (last checkpoint: step 3); "
                          f"resume with: agentrl train --resume {tmp_path / 'run'}")
    assert error.exit_code == 128 + signal.SIGTERM
    early = stopped_error(RunStopped(signal.SIGINT), run_dir=tmp_path / "run", checkpoint_step=None)
    assert "no checkpoint yet: a resume starts from step 0" in str(early) and early.exit_code == 130


def test_ray_messages_at_a_stop_go_to_the_run_log_not_the_console(tmp_path, capfd):
    """A real local Ray: an actor (restarts and task retries unbounded, as the rollout workers) killed with a task in
    flight makes the driver print "(raylet) Task ... failed. There are infinite retries remaining ..." whatever
    log_to_driver says; under `ray_messages_to_log` it lands in the run's log, and the console stays clean."""
    import time

    ray = pytest.importorskip("ray", reason="the train extra (ray) is not installed")
    import ray._private.worker as ray_worker

    from agentrl.rl.stopping import ray_messages_to_log

    @ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
    class Napper:
        def nap(self, started: str) -> None:
            Path(started).touch()
            time.sleep(60)

    log = tmp_path / "logs" / "ray.log"
    original = ray_worker.print_to_stdstream
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        with ray_messages_to_log(log):
            napper = Napper.remote()
            started = tmp_path / "napping"
            napping = napper.nap.remote(str(started))
            deadline = time.monotonic() + 60
            while not started.exists():  # the task is in flight when its actor is killed
                assert time.monotonic() < deadline, "the nap never started"
                time.sleep(0.05)
            ray.kill(napper)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "Napper.nap" not in (log.read_text() if log.exists() else ""):
                time.sleep(0.2)
            del napping
    finally:
        ray.shutdown()
    assert ray_worker.print_to_stdstream is original
    assert "Napper.nap" in log.read_text() and "(raylet)" in log.read_text()
    console = "".join(capfd.readouterr())
    assert "Napper.nap" not in console and "(raylet)" not in console, console
