"""The GPU tests' early failure reports (`tests/early_failures.py`, hooked in by `tests/gpu/conftest.py`): a failure
is on the terminal and in `$AGENTRL_FAILURES_FILE` while the session still runs, so a killed phase keeps it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAILING_THEN_HANGING = '''
import time


def test_fails_first():
    assert 1 == 2, "MARKER-early-failure"


def test_hangs_until_killed():
    time.sleep(120)
'''


def test_a_failure_is_written_before_the_session_ends_and_survives_a_kill(tmp_path):
    suite = tmp_path / "gpu_copy"
    suite.mkdir()
    shutil.copy(ROOT / "tests" / "gpu" / "conftest.py", suite / "conftest.py")  # the real hook, in a folder of its own
    (suite / "test_sample.py").write_text(FAILING_THEN_HANGING)
    failures = tmp_path / "out" / "failures.txt"
    log = tmp_path / "pytest.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTRL_FAILURES_FILE": str(failures)}
    with log.open("w") as output:
        process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                                    "--rootdir", str(suite), str(suite)], cwd=suite, env=env, stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and process.poll() is None:
                if failures.exists() and "MARKER-early-failure" in failures.read_text():
                    break
                time.sleep(0.2)
        finally:
            still_running = process.poll() is None
            if still_running:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    said = log.read_text()
    assert still_running, f"pytest ended before it was killed:\n{said}"
    written = failures.read_text()
    assert "=== FAILED test_sample.py::test_fails_first (call" in written, written
    assert "MARKER-early-failure" in written and "assert 1 == 2" in written, written
    assert "MARKER-early-failure" in said, said  # on the terminal too, not only in the file
    assert "short test summary" not in said  # it came from the hook: the session never reached its summary
