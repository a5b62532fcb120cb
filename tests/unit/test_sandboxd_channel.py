"""The command server's helper that runs as the sandbox user holds none of the server's fds (`leave_channel`).

`sandboxd.kill_marked` forks a helper that drops to the sandbox user to scan /proc, and never executes
anything. Before it drops, it lets go of the server's channel to the host (stdin and stdout) and of every other
fd, so no process of the sandbox user's ever holds them. Run here in a child process whose stdin and stdout are
pipes, as the server's are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import agentrl.sandbox.sandboxd as sandboxd

CHILD = """
import json, os, sys
sys.path.insert(0, {folder!r})
import sandboxd
held = [os.open("/dev/zero", os.O_RDONLY) for _ in range(3)] + list(os.pipe())  # the server's other fds
sandboxd.leave_channel()
report = os.open({report!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
os.write(report, json.dumps({{"held": held, "report": report, "fds": fds,
                              "targets": {{fd: os.readlink(f"/proc/self/fd/{{fd}}") for fd in (0, 1, 2)}}}}).encode())
"""


def test_the_helper_lets_go_of_the_channel_and_every_other_fd(tmp_path):
    report = tmp_path / "report.json"
    script = CHILD.format(folder=str(Path(sandboxd.__file__).parent), report=str(report))
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        child.stdin.close()
        assert child.stdout.read() == b""  # nothing the child did reached the channel
        assert child.wait(timeout=60) == 0, child.stderr.read().decode()
    finally:
        if child.poll() is None:
            child.kill()
    found = json.loads(report.read_text())
    assert found["targets"] == {str(fd): "/dev/null" for fd in (0, 1, 2)}, found
    assert not set(found["held"]) & (set(found["fds"]) - {found["report"], max(found["fds"])}), found
    assert set(found["fds"]) <= {0, 1, 2, found["report"], max(found["fds"])}, found  # the listing's own fd
