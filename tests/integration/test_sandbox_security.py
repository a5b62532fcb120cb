"""Security suite: each attack runs in a real sandbox (Docker under runc and gVisor, and
bubblewrap) and each test asserts that the attack failed and that the host is unharmed."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from sandbox_backends import BACKENDS, config, docker_ok

from agentrl.sandbox import SandboxError, create_sandbox

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _labelled_containers(owner: str) -> list[str]:
    """Ids of the Docker containers (running or not) labelled with this owner."""
    return subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.owner={owner}"],
                          capture_output=True, text=True).stdout.split()


def sandbox_exists(sandbox) -> bool:
    if sandbox.backend == "docker":
        out = subprocess.run(["docker", "inspect", sandbox.id], capture_output=True)
        return out.returncode == 0
    return sandbox.root.exists()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_network_is_unreachable(backend):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    probe = textwrap.dedent(f"""
        import socket
        for host, port in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("151.101.2.132", 80)]:
            try:
                socket.create_connection((host, port), timeout=3).close()
                print("CONNECTED", host)
            except OSError as error:
                print("blocked", host, type(error).__name__)
        try:
            socket.getaddrinfo("deb.debian.org", 80)
            print("CONNECTED dns")
        except OSError:
            print("blocked dns")
    """)
    try:
        async with create_sandbox(config(backend)) as sandbox:
            result = await sandbox.exec(["python3", "-c", probe], timeout=30)
    finally:
        listener.close()
    assert result.exit_code == 0, result.stderr
    assert "CONNECTED" not in result.stdout
    assert result.stdout.count("blocked") == 4


@pytest.mark.parametrize("backend", BACKENDS)
async def test_host_files_are_invisible(backend, tmp_path):
    secret = tmp_path / f"host-secret-{uuid.uuid4().hex}"
    secret.write_text("host secret")
    async with create_sandbox(config(backend)) as sandbox:
        result = await sandbox.exec(
            f"for p in {secret} /var/run/docker.sock /run/docker.sock /work/main /root/.pyenv /etc/docker/daemon.json; "
            "do if [ -e $p ]; then echo VISIBLE $p; else echo hidden $p; fi; done; "
            "cat /proc/1/root/etc/hostname 2>/dev/null | grep -v sandbox || true"
        )
        init = await sandbox.exec("tr '\\0' ' ' < /proc/1/cmdline")
    assert result.exit_code == 0, result.stderr
    assert "VISIBLE" not in result.stdout, result.stdout
    assert result.stdout.count("hidden") == 6
    assert init.exit_code == 0 and init.stdout
    assert "/var/cache" not in init.stdout and "/work" not in init.stdout  # no host paths via pid 1


FORK_BOMB = textwrap.dedent("""
    import os, time
    forked = 0
    try:
        while forked < 2000:
            if os.fork() == 0:
                time.sleep(2)
                os._exit(0)
            forked += 1
        print("UNLIMITED", forked)
    except OSError as error:
        print("stopped-at", forked, error.errno)
""")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_fork_bomb_is_stopped_by_pids_limit(backend):
    async with create_sandbox(config(backend)) as sandbox:
        if backend.get("runtime") == "runsc":
            # gVisor counts its own host threads against the limit: past it, the whole gVisor
            # sandbox dies instead of fork() failing. Either way the bomb got nowhere.
            try:
                bomb = await sandbox.exec(["python3", "-c", FORK_BOMB], timeout=30)
            except SandboxError as error:
                assert "stopped" in str(error)
                return
            assert "UNLIMITED" not in bomb.stdout
            assert "stopped-at" in bomb.stdout, (bomb.stdout, bomb.stderr)
        else:
            bomb = await sandbox.exec(["python3", "-c", FORK_BOMB], timeout=30)
            assert "UNLIMITED" not in bomb.stdout
            assert "stopped-at" in bomb.stdout, (bomb.stdout, bomb.stderr)
            assert int(bomb.stdout.split()[1]) < 64
        await asyncio.sleep(2.5)  # the bomb's children exit after 2 s
        after = await sandbox.exec("echo alive", timeout=20)
        assert after.stdout.strip() == "alive"
        # The classic shell bomb too: it keeps forking in the background until the sandbox is
        # destroyed; the limit holds it and removing the sandbox ends it promptly.
        await sandbox.exec(":(){ :|:& };:", timeout=3)
        await asyncio.sleep(1)
        started = time.monotonic()
    assert time.monotonic() - started < 30
    # The host still forks fine.
    assert subprocess.run(["true"]).returncode == 0


MEMORY_BOMB = textwrap.dedent("""
    chunks = []
    for _ in range(400):               # up to 4 GB in 10 MB pieces, each touched
        chunks.append(bytearray(b"x" * 10_000_000))
    print("ALLOCATED", len(chunks))
""")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_memory_bomb_is_killed_by_memory_limit(backend):
    async with create_sandbox(config(backend)) as sandbox:
        try:
            bomb = await sandbox.exec(["python3", "-c", MEMORY_BOMB], timeout=60)
        except SandboxError as error:
            # Under gVisor the OOM killer may take the whole sandbox (its memory is one cgroup).
            assert backend.get("runtime") == "runsc" and "OOM killed: True" in str(error), str(error)
            return
        assert "ALLOCATED" not in bomb.stdout
        assert bomb.exit_code != 0 and not bomb.timed_out
        # The sandbox (and the host) keep working.
        after = await sandbox.exec("echo alive")
    assert after.stdout.strip() == "alive"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_infinite_loop_is_killed_at_timeout(backend):
    async with create_sandbox(config(backend)) as sandbox:
        started = time.monotonic()
        result = await sandbox.exec("while true; do :; done", timeout=2)
        elapsed = time.monotonic() - started
        leftover = await sandbox.exec("ps -eo args | grep -c '^/bin/bash -c while' || true")
    assert result.timed_out and result.exit_code == 137
    assert 1.5 < elapsed < 10
    assert leftover.stdout.strip() == "0"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_huge_output_is_capped(backend):
    async with create_sandbox(config(backend)) as sandbox:
        result = await sandbox.exec("head -c 100000000 /dev/zero | tr '\\0' a; echo done >&2", timeout=60)
    assert result.exit_code == 0
    assert len(result.stdout) == 1_000_000 and set(result.stdout) == {"a"}
    assert result.stdout_truncated and not result.stderr_truncated
    assert result.stderr == "done\n"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sandbox_removed_after_exception(backend):
    kept = None
    with pytest.raises(RuntimeError, match="boom"):
        async with create_sandbox(config(backend)) as sandbox:
            kept = sandbox
            assert sandbox_exists(sandbox)
            raise RuntimeError("boom")
    assert kept is not None and not sandbox_exists(kept)


OWNER_SCRIPT = """
import asyncio, sys
from agentrl.sandbox import SandboxConfig, SandboxError, create_sandbox
async def main():
    sandbox = await create_sandbox(SandboxConfig(type=sys.argv[1], runtime=sys.argv[2], owner=sys.argv[3])).start()
    print(sandbox.id, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


@pytest.mark.parametrize("backend", BACKENDS)
async def test_gc_after_kill_9_leaves_no_sandbox(backend):
    owner = f"test-gc-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, backend["type"], backend.get("runtime", "runc"), owner],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        sandbox_id = proc.stdout.readline().strip()
        assert sandbox_id, "the owning process did not create a sandbox"
        from agentrl.sandbox.gc import list_sandboxes

        mine = [s for s in list_sandboxes() if s.owner == owner]
        assert len(mine) == 1 and not mine[0].orphan
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert [s.orphan for s in list_sandboxes() if s.owner == owner] in ([True], [])
        gc = subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", "gc"], capture_output=True, text=True)
        assert gc.returncode == 0, gc.stderr
        for _ in range(50):  # another process's start-up gc may be finishing the same removal
            if not [s for s in list_sandboxes() if s.owner == owner]:
                break
            time.sleep(0.2)
        assert [s for s in list_sandboxes() if s.owner == owner] == []
        if backend["type"] == "docker":
            labelled = _labelled_containers(owner)
            assert labelled == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", "gc", "--owner", owner], capture_output=True)


@pytest.mark.skipif(not docker_ok(), reason="no Docker engine")
async def test_next_process_start_up_removes_orphans():
    owner = f"test-startup-gc-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, "docker", "runc", owner], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # A fresh process's first sandbox reaps the orphans of dead processes before starting.
        run = subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", "run", "--", "true"],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        labelled = _labelled_containers(owner)
        assert labelled == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", "gc", "--owner", owner], capture_output=True)


@pytest.mark.skipif(not docker_ok(), reason="no Docker engine")
def test_unclosed_sandbox_is_removed_at_interpreter_exit():
    owner = f"test-atexit-{uuid.uuid4().hex[:8]}"
    script = (
        "import asyncio, sys\n"
        "from agentrl.sandbox import SandboxConfig, create_sandbox\n"
        "async def main():\n"
        "    sandbox = await create_sandbox(SandboxConfig(owner=sys.argv[1])).start()\n"
        "    print(sandbox.id, flush=True)\n"
        "asyncio.run(main())\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", script, owner], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
        labelled = _labelled_containers(owner)
        assert labelled == []
    finally:
        subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", "gc", "--owner", owner], capture_output=True)
