"""The bubblewrap sandbox's limits hold for the sandbox as a whole, with the real bwrap, cgroups and
tmpfs of this host: memory and processes are counted across concurrent commands, /dev is read-only
and /dev/shm is the sandbox's own size-limited tmpfs; close and gc leave no mount, cgroup or folder
behind (even with a command running); and without a cgroup the per-process rlimits stand in, with a
warning naming the limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
from sandbox_backends import bwrap_ok, config

from agentrl.sandbox import base, cgroups, create_sandbox
from agentrl.sandbox.bwrap_backend import BwrapSandbox
from agentrl.sandbox.bwrap_workspace import CGROUP_PREFIX, DISK_DIR, remove_orphan_cgroups
from agentrl.sandbox.gc import collect_garbage

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not bwrap_ok(), reason="bubblewrap or base rootfs missing"),
]
BWRAP = {"type": "bwrap"}
HOLD = "import sys, time; block = b'x' * (int(sys.argv[1]) << 20); time.sleep(4); print('held', flush=True)"
FORK_UNTIL_REFUSED = (
    "import os, time\n"
    "n = 0\n"
    "while n < 100:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except BlockingIOError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        os.close(1); os.close(2); time.sleep(30); os._exit(0)\n"
    "    n += 1\n"
    "print(n, flush=True)\n"
)


def mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


async def test_memory_is_counted_across_concurrent_commands():
    async with create_sandbox(config(BWRAP, memory_mb=200)) as sandbox:
        assert sandbox.cgroup is not None
        await sandbox.write_file("/tmp/hold.py", HOLD)
        results = await asyncio.gather(*(sandbox.exec("python3 /tmp/hold.py 120", timeout=60) for _ in range(2)))
    assert sum(result.stdout.count("held") for result in results) <= 1, results  # 2 x 120 MiB > 200 MiB


async def test_processes_are_counted_across_concurrent_commands():
    async with create_sandbox(config(BWRAP, pids_limit=24)) as sandbox:
        await sandbox.write_file("/tmp/fork.py", FORK_UNTIL_REFUSED)
        holder = asyncio.create_task(sandbox.exec("for i in $(seq 10); do sleep 8 & done; wait", timeout=60))
        for _ in range(100):
            if len(sandbox.cgroup.members()) >= 13:  # bwrap, its init, bash and 10 sleeps
                break
            await asyncio.sleep(0.05)
        forker = await sandbox.exec("python3 /tmp/fork.py", timeout=60)
        await sandbox.kill_processes()
        await holder
    # Alone it could fork about 21 times; the holder's 13 processes count against the same 24.
    assert forker.exit_code == 0 and 1 <= int(forker.stdout) <= 10, forker


async def test_dev_is_read_only_and_shm_is_the_sandbox_tmpfs():
    async with create_sandbox(config(BWRAP, disk_mb=64)) as sandbox:
        dev = await sandbox.exec("echo x > /dev/planted", timeout=20)
        sizes = await sandbox.exec("df -m --output=size /dev/shm /tmp /workspace /home/agent | tail -n +2", timeout=20)
        shared = await sandbox.exec("head -c 40M /dev/zero > /dev/shm/a; head -c 40M /dev/zero > big || echo full",
                                    timeout=30)
    assert dev.exit_code != 0 and "Read-only file system" in dev.stderr, dev
    assert [int(size) for size in sizes.stdout.split()] == [64] * 4, sizes.stdout
    assert "full" in shared.stdout, shared  # /dev/shm and the workspace share the 64 MiB


async def test_close_removes_everything_while_a_command_runs():
    sandbox = await BwrapSandbox(config(BWRAP)).start()
    try:
        running = asyncio.create_task(sandbox.exec("sleep 1000", timeout=100))
        for _ in range(100):
            if sandbox.cgroup.members():
                break
            await asyncio.sleep(0.05)
        assert sandbox.cgroup.members() and mounted(sandbox.root / DISK_DIR)
    finally:
        await sandbox.close()
    result = await asyncio.wait_for(running, timeout=10)
    assert result.exit_code == 137 and not result.timed_out, result
    assert not mounted(sandbox.root / DISK_DIR)
    assert not any(folder.exists() for folder in sandbox.cgroup.dirs)
    assert not sandbox.root.exists()


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def test_gc_removes_an_orphaned_sandbox_with_its_mount_and_cgroup():
    sandbox = await BwrapSandbox(config(BWRAP)).start()
    try:
        await sandbox.write_file("f.txt", "x")
        labels_file = sandbox.root / "labels.json"
        labels = json.loads(labels_file.read_text())
        labels_file.write_text(json.dumps({**labels, "agentrl.pid": str(dead_pid())}))  # its owner "died"
        removed = await asyncio.to_thread(collect_garbage, docker=False)
        assert sandbox.id in [info.id for info in removed]
        assert not mounted(sandbox.root / DISK_DIR)
        assert not any(folder.exists() for folder in sandbox.cgroup.dirs)
        assert not sandbox.root.exists()
    finally:
        await sandbox.close()


def test_gc_removes_cgroups_of_dead_owners():
    name = f"{CGROUP_PREFIX}{dead_pid()}.12345.test-orphan-{os.urandom(4).hex()}"
    group = cgroups.create(name, memory_bytes=64 << 20, pids=16)
    sleeper = subprocess.Popen(["sleep", "1000"], preexec_fn=lambda: group.join(os.getpid()))
    try:
        assert name in remove_orphan_cgroups()
        assert sleeper.wait(timeout=10) == -9
        assert not any(folder.exists() for folder in group.dirs)
    finally:
        sleeper.kill()
        sleeper.wait()
        group.kill_all()
        group.remove()


async def test_without_a_cgroup_rlimits_stand_in_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(base, "_warned_limits", set())  # the warning is once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with BwrapSandbox(config(BWRAP, memory_mb=256), cgroup_root=tmp_path) as sandbox:
            assert sandbox.cgroup is None
            limits = await sandbox.exec("ulimit -v; ulimit -u", timeout=20)
            big = await sandbox.exec(["python3", "-c", "b = b'x' * (400 << 20); print('allocated')"], timeout=30)
    assert [str(w.message).split(" (")[0] for w in caught if issubclass(w.category, RuntimeWarning)] == [
        "sandbox limit memory_mb and pids_limit cannot be enforced on this host",
        "sandbox limit cpus cannot be enforced on this host"]
    assert limits.stdout.split() == [str(256 * 1024), "64"], limits
    assert big.exit_code != 0 and "MemoryError" in big.stderr, big


async def test_a_sandbox_that_asks_for_network_gets_none_of_the_hosts(tmp_path, monkeypatch):
    """bwrap's only network is the host's own namespace: with `network=True` a sandbox read a server on the host's
    127.0.0.1 (where vLLM, Ray and the image registry listen) and a host abstract socket (a red-team pass,
    2026-12-07). It now runs with no network and says so, as Docker does without a bridge."""
    import http.server
    import socket
    import threading

    class Secret(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"host-only")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Secret)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"agentrl-test-{os.getpid()}-{id(tmp_path)}"
    abstract.bind("\0" + name)
    abstract.listen(1)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = (f"import socket, urllib.request\n"
             f"try: print(urllib.request.urlopen('http://127.0.0.1:{server.server_address[1]}/', timeout=3).read())\n"
             f"except Exception as error: print('http refused', type(error).__name__)\n"
             f"s = socket.socket(socket.AF_UNIX)\n"
             f"try: s.connect('\\0{name}'); print('abstract reached')\n"
             f"except Exception as error: print('abstract refused', type(error).__name__)\n")
    monkeypatch.setattr(base, "_warned_limits", set())  # the warning is once per process
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with create_sandbox(config(BWRAP, network=True)) as sandbox:
                result = await sandbox.exec(["python3", "-c", probe], timeout=30)
                note = sandbox.network_note
        assert "http refused" in result.stdout and "abstract refused" in result.stdout, result
        assert note and "ran with no network" in note, note
        assert any("127.0.0.1" in str(warning.message) for warning in caught)
        with pytest.raises(base.SandboxError, match="bubblewrap has no network of its own"):
            async with create_sandbox(config(BWRAP, network=True, unenforceable_limits="refuse")):
                pass
    finally:
        server.shutdown()
        server.server_close()
        abstract.close()


async def test_a_workdir_the_root_filesystem_lacks(tmp_path):
    """bwrap cannot make a mount point on the read-only root: every command failed with "Can't mkdir /app:
    Read-only file system" (a Harbor task whose workdir its image never made). In a tree agentrl exported the
    folder is made; in a root filesystem of the user's the sandbox refuses to start, in one line."""
    from agentrl.sandbox import SandboxError
    from agentrl.sandbox.base_image import rootfs_dir

    workdir = f"/agentrl-test-{os.getpid()}"
    async with create_sandbox(config(BWRAP, workdir=workdir)) as sandbox:
        result = await sandbox.exec("pwd && echo made > file && cat file", timeout=30)
    assert (result.exit_code, result.stdout) == (0, f"{workdir}\nmade\n"), result
    (rootfs_dir() / workdir.lstrip("/")).rmdir()  # the empty mount point, no longer needed

    # a parent that is a link out of the tree (Debian's /var/run -> /run): refused, nothing made on the host
    outside = f"/var/run/agentrl-test-{os.getpid()}"
    with pytest.raises(SandboxError, match=rf"workdir {outside} is not a folder of the root filesystem"):
        async with create_sandbox(config(BWRAP, workdir=outside)):
            pass
    assert not Path(outside).exists()

    users = tmp_path / "users-rootfs"
    users.symlink_to(rootfs_dir())  # the same tree, but not under agentrl's cache: not agentrl's to change
    with pytest.raises(SandboxError, match=rf"^sandbox type 'bwrap': workdir /app-missing is not a folder of the "
                                           rf"root filesystem {users}; create it in the image \(WORKDIR /app-missing\)"):
        async with create_sandbox(config(BWRAP, workdir="/app-missing", rootfs=str(users))):
            pass
