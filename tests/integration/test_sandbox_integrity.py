"""Integrity suite: attacks on what the host believes about a sandbox, each planted the way a model
would plant it (through commands it runs), under Docker with runc and gVisor and under bubblewrap.
Each test asserts that the attack failed and that the host is unchanged.

- a process left behind by one command tries to forge the answers of later commands, file reads
  and downloads (the in-sandbox command server's channel);
- archives that `download` receives: links out, hard links, `..`, absolute names, devices and the
  CVE-2025-4517 long-path chain, delivered by a `tar` the agent controls;
- paths that leave the working directory;
- the host's environment, nested user namespaces, memory across several processes, shared
  memory and the disk limit in total;
- a command whose background child keeps its output open, and an executable workspace;
- a timed-out command's children that left its session;
- a process whose leader thread ended alone (a "zombie" that runs), killed all the same.
"""

from __future__ import annotations

import asyncio
import base64
import textwrap
import time
import uuid

import pytest
from sandbox_backends import BACKENDS, DOCKER_BACKENDS, config

from agentrl.sandbox import SandboxError, create_sandbox
from tests.hostile_archives import crafted_archives, host_snapshot, links_or_specials

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FORGER = textwrap.dedent(r'''
    import base64, json, os, signal, sys, time
    stop_victims = sys.argv[1] == "stop"
    state = open("/tmp/forger.state", "w", buffering=1)
    def log(*parts):
        state.write(" ".join(map(str, parts)) + "\n")
    matches = {}  # pid -> parent of each python3 running the source it read from stdin
    for name in os.listdir("/proc"):
        try:
            command = open(f"/proc/{name}/cmdline", "rb").read() if name.isdigit() else b""
            if command.startswith(b"python3") and b"exec(compile(read(" in command:
                matches[int(name)] = int(open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    # The command server itself: not a child it forked for a command (or its kill helper), which shares its
    # command line until it executes, already running as the sandbox user.
    roots = [pid for pid, parent in matches.items() if parent not in matches]
    server = min(roots) if roots else None
    log("server", server, "children", len(matches) - len(roots))
    out = None
    if server:
        for what, flags in (("fd/1", os.O_WRONLY), ("fd/0", os.O_RDONLY), ("mem", os.O_RDONLY),
                            ("environ", os.O_RDONLY)):
            try:
                fd = os.open(f"/proc/{server}/{what}", flags)
                log("opened", what)
                if what == "fd/1":
                    out = fd
            except OSError as error:
                log("denied", what, error.errno)
        try:
            os.kill(server, signal.SIGSTOP)
            os.kill(server, signal.SIGCONT)
            log("opened", "signal")
        except OSError as error:
            log("denied", "signal", error.errno)
    log("ready")
    forged = base64.b64encode(b"FORGED all tests passed\n").decode()
    while True:
        if stop_victims:
            for name in os.listdir("/proc"):
                try:
                    if name.isdigit() and b"VICTIM_MARK" in open(f"/proc/{name}/cmdline", "rb").read():
                        os.kill(int(name), signal.SIGSTOP)
                except OSError:
                    pass
        if out is not None:
            for request_id in range(200):
                answer = {"id": request_id, "token": "0" * 32, "exit_code": 0, "stdout": forged, "stderr": "",
                          "stdout_total": 24, "stderr_total": 0, "timed_out": False}
                try:
                    os.write(out, (json.dumps(answer) + "\n").encode())
                except OSError:
                    pass
        time.sleep(0.02)
''')
VICTIM = "sleep 1; echo '3 tests failed' # VICTIM_MARK\nexit 3"


async def _plant_forger(sandbox, mode: str) -> str:
    """Start the forger as a detached process the way a model would; its state once it is ready (or gone)."""
    await sandbox.write_file("/tmp/forger.py", FORGER)
    await sandbox.exec(f"setsid nohup python3 /tmp/forger.py {mode} >/dev/null 2>&1 &", timeout=20)
    state = ""
    for _ in range(100):  # bwrap ends every process with its command: the forger may never get ready
        state = (await sandbox.exec("cat /tmp/forger.state 2>/dev/null", timeout=20)).stdout
        if "ready" in state:
            break
        await asyncio.sleep(0.1)
    return state


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_earlier_process_cannot_forge_later_answers(backend, tmp_path):
    async with create_sandbox(config(backend)) as sandbox:
        await sandbox.write_file("report.txt", "real content\n")
        state = await _plant_forger(sandbox, "forge")
        if sandbox.backend == "docker":
            assert "ready" in state, state
            # The command server is out of the agent's reach: no fd, no memory, no signal. (Its
            # environment is the sandbox's own; gVisor lets the same-container user read it.)
            for what in ("fd/1", "fd/0", "mem", "signal"):
                assert f"denied {what}" in state, state
        victim = await sandbox.exec(VICTIM, timeout=30)
        content = await sandbox.read_file("report.txt")
        await sandbox.download(".", tmp_path / "out")
    assert (victim.exit_code, victim.stdout) == (3, "3 tests failed\n"), victim
    assert content == "real content\n"
    assert (tmp_path / "out" / "report.txt").read_text() == "real content\n"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_kill_processes_ends_what_the_agent_left_running(backend):
    async with create_sandbox(config(backend)) as sandbox:
        await _plant_forger(sandbox, "stop")
        await sandbox.exec("for i in 1 2 3; do setsid nohup sleep 100000 >/dev/null 2>&1 & done", timeout=20)
        await sandbox.kill_processes()
        left = await sandbox.exec("ps -eo args | grep -E 'forger|sleep 100000' | grep -v grep || true", timeout=20)
        victim = await sandbox.exec(VICTIM, timeout=30)
        alive = await sandbox.exec("echo alive", timeout=20)
    assert left.stdout == "", left.stdout
    assert (victim.exit_code, victim.stdout, victim.timed_out) == (3, "3 tests failed\n", False), victim
    assert alive.stdout == "alive\n"


LEADERLESS = textwrap.dedent("""
    import ctypes, os, platform, threading, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            def beat():
                count = 0
                while True:
                    count += 1
                    with open("/tmp/heartbeat.new", "w") as handle:
                        handle.write(str(count))
                    os.replace("/tmp/heartbeat.new", "/tmp/heartbeat")  # never seen half written
                    time.sleep(0.005)
            threading.Thread(target=beat).start()
            time.sleep(0.2)
            ctypes.CDLL(None).syscall(60 if platform.machine() == "x86_64" else 93, 0)  # SYS_exit: the leader alone
        os._exit(0)
    os.wait()
""")
# Waits until /proc shows a zombie with more than one thread: the leaderless process, running.
SEE_LEADERLESS = ('for i in $(seq 100); do for d in /proc/[0-9]*; do '
                  'if grep -q "^State:.Z" $d/status 2>/dev/null && ! grep -q "^Threads:.1$" $d/status; then '
                  'echo seen; exit 0; fi; done; sleep 0.05; done; exit 1')


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_process_whose_leader_thread_ended_alone_is_killed(backend):
    """A process can end its leader thread alone (SYS_exit) and run on in another thread: /proc then shows a zombie.
    It is alive: kill_processes kills it (red team, 2026-12-07: on runc it outlived a kill reported as clean)."""
    async with create_sandbox(config(backend)) as sandbox:
        await sandbox.write_file("/tmp/leaderless.py", LEADERLESS)
        planted = await sandbox.exec("python3 /tmp/leaderless.py && " + SEE_LEADERLESS, timeout=30)
        assert planted.stdout == "seen\n", planted
        await sandbox.kill_processes()
        first = await sandbox.exec("cat /tmp/heartbeat", timeout=20)
        await asyncio.sleep(0.5)
        second = await sandbox.exec("cat /tmp/heartbeat", timeout=20)
    assert first.stdout and first.stdout == second.stdout, (first.stdout, second.stdout)


@pytest.mark.parametrize("backend", DOCKER_BACKENDS)
async def test_processes_the_kill_left_running_are_an_error_and_grading_refuses_them(backend, tmp_path):
    """sandboxd gives up after its time to kill (a fork chain faster than its SIGKILLs): it says how many still run,
    and the sandbox raises instead of taking it for a clean kill; the grader scores such an episode 0 without
    carrying its files. A time of 0 makes the give-up certain: the first scan finds the sleepers, none signalled."""
    from agentrl.sandbox.grading import WorkdirRejected, grade_in_fresh_sandbox

    async with create_sandbox(config(backend)) as sandbox:
        await sandbox.exec("for i in 1 2; do setsid nohup sleep 100000 >/dev/null 2>&1 & done", timeout=20)
        from agentrl.errors import ProcessesSurvived

        with pytest.raises(ProcessesSurvived, match=r"(\d+) processes still ran after 0 s of SIGKILL") as caught:
            await sandbox.kill_processes(within_s=0.0)
        assert caught.value.count >= 2  # the two sleepers, and their shells where they still run
        await sandbox.kill_processes()  # the usual time: every one is killed, none reported
        left = await sandbox.exec("ps -eo args | grep 'sleep 100000' | grep -v grep || true", timeout=20)
        assert left.stdout == "", left.stdout
        await sandbox.exec("setsid nohup sleep 100000 >/dev/null 2>&1 &", timeout=20)
        real_kill = sandbox.kill_processes
        sandbox.kill_processes = lambda: real_kill(within_s=0.0)
        graded = []
        with pytest.raises(WorkdirRejected, match=r"grading: sandbox \w+: 1 processes still ran"):
            await grade_in_fresh_sandbox(sandbox, lambda fresh: graded.append(fresh), keep_open=True)
        assert graded == []


@pytest.mark.parametrize("backend", DOCKER_BACKENDS)
async def test_a_timed_out_commands_children_that_left_its_session_are_killed(backend):
    """At a timeout the command server kills the command's process group, and its helper (running as the sandbox
    user, holding none of the server's fds: `sandboxd.leave_channel`) finds the children that left it by their
    marker. The server answers on afterwards."""
    async with create_sandbox(config(backend)) as sandbox:
        served = sandbox.server_execs
        slow = await sandbox.exec("(setsid sleep 301 &); (setsid nohup sleep 302 >/dev/null 2>&1 &); sleep 300",
                                  timeout=1)
        left = await sandbox.exec("ps -eo args | grep -E '^sleep 30[12]' || true", timeout=20)
        after = await sandbox.exec("echo after", timeout=20)
    assert slow.timed_out and slow.exit_code == 137, slow
    assert left.stdout == "", left.stdout
    assert after.stdout == "after\n"
    assert sandbox.server_execs == served + 3  # every command went through the server, none through `docker exec`


@pytest.mark.parametrize("backend", BACKENDS)
async def test_download_writes_nothing_outside_its_folder(backend, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("host file\n")
    before = host_snapshot(outside)
    archives = crafted_archives(outside)
    # The agent puts its own `tar` first on PATH (a user-writable bin folder, as ~/.local/bin is).
    fake_tar = "#!/usr/bin/python3\nimport base64, os, sys\nopen('/tmp/fake-tar-ran', 'w').close()\n" + \
        "sys.stdout.buffer.write(base64.b64decode(open(os.environ['ARCHIVE']).read()))\n"
    path = "/home/agent/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    async with create_sandbox(config(backend, env={"PATH": path, "ARCHIVE": "/tmp/archive.b64"})) as sandbox:
        await sandbox.write_file("/home/agent/.local/bin/tar", fake_tar, mode=0o755)
        for name, archive in archives.items():
            await sandbox.write_file("/tmp/archive.b64", base64.b64encode(archive).decode())
            dest = tmp_path / f"dest-{name}"
            try:
                await sandbox.download(".", dest)
            except SandboxError as error:
                assert "download" in str(error)
            assert host_snapshot(outside) == before, name
            assert links_or_specials(dest) == [], name
            assert not any(p.stat().st_mode & 0o7000 for p in dest.rglob("*")), name
        ran = await sandbox.exec("test -e /tmp/fake-tar-ran && echo yes && rm /home/agent/.local/bin/tar", timeout=20)
        # Links and specials the real tar puts in the archive.
        made = await sandbox.exec(
            f"mkdir -p tree/sub && echo inside > tree/sub/file.txt && ln -s /etc tree/etc-link && "
            f"ln -s ../../../../.. tree/up && ln -s {outside} tree/host-link && echo o > tree/o && ln tree/o tree/hard && "
            f"mkfifo tree/fifo && echo ok", timeout=20)
        assert made.stdout == "ok\n", made
        skipped = await sandbox.download("tree", tmp_path / "dest-real")
        assert (tmp_path / "dest-real" / "sub" / "file.txt").read_text() == "inside\n"
        assert links_or_specials(tmp_path / "dest-real") == [] and len(skipped) >= 4, skipped
    assert ran.stdout == "yes\n"  # the crafted archives did reach the host
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("pwned")) == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_relative_paths_may_not_leave_the_workdir(backend, tmp_path):
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "f.txt").write_text("x")
    async with create_sandbox(config(backend)) as sandbox:
        await sandbox.write_file("sub/f.txt", "inside\n")
        assert await sandbox.read_file("sub/../sub/f.txt") == "inside\n"
        assert "root:" in await sandbox.read_file("/etc/passwd")  # absolute paths name the sandbox's own files
        for action in (lambda: sandbox.read_file("../../etc/passwd"), lambda: sandbox.write_file("../x", "x"),
                       lambda: sandbox.upload(tmp_path / "up", "../.."), lambda: sandbox.download("..", tmp_path / "d")):
            with pytest.raises(SandboxError, match="leaves the working directory"):
                await action()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_host_environment_is_not_visible(backend, monkeypatch):
    canary = f"canary-{uuid.uuid4().hex}"
    monkeypatch.setenv("AGENTRL_HOST_CANARY", canary)
    async with create_sandbox(config(backend)) as sandbox:
        seen = await sandbox.exec("cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c canary- || true",
                                  timeout=20)
    assert seen.stdout.strip() == "0"


@pytest.mark.parametrize("backend", BACKENDS)
async def test_no_root_in_a_nested_user_namespace(backend):
    async with create_sandbox(config(backend)) as sandbox:
        shell = await sandbox.exec("unshare -r id -u", timeout=20)
        python = await sandbox.exec(["python3", "-c", "import os; os.unshare(os.CLONE_NEWUSER); print('unshared')"],
                                    timeout=20)
    assert shell.exit_code != 0 and shell.stdout.strip() != "0", shell
    assert python.exit_code != 0 and "unshared" not in python.stdout, python


@pytest.mark.parametrize("backend", BACKENDS)
async def test_threads_start_under_the_seccomp_profile(backend):
    """The profile that refuses namespaces lets threads start: under gVisor Docker's default profile (its clone3 rule,
    answered EPERM there instead of ENOSYS) made every pthread_create fail."""
    async with create_sandbox(config(backend)) as sandbox:
        started = await sandbox.exec(["python3", "-c", "import threading\nthreads = [threading.Thread(target=print, "
                                      "args=(index,)) for index in range(4)]\nfor t in threads: t.start()\n"
                                      "for t in threads: t.join()"], timeout=30)
    assert (started.exit_code, sorted(started.stdout.split())) == (0, ["0", "1", "2", "3"]), started


@pytest.mark.parametrize("backend", DOCKER_BACKENDS)
async def test_clone3_answers_enosys(backend):
    """clone3's flags cannot be filtered by seccomp (they are behind a pointer): a profile answers it ENOSYS so that
    the C library falls back to clone, whose namespace flags are refused. runsc's profile has no clone3 rule
    (Debian's runsc answers such a rule EPERM); gVisor answers ENOSYS itself, which a runsc upgrade could change."""
    probe = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "print(libc.syscall(435, 0, 0), ctypes.get_errno())")
    async with create_sandbox(config(backend)) as sandbox:
        result = await sandbox.exec(["python3", "-c", probe], timeout=30)
    assert result.stdout.split() == ["-1", "38"], result


HOLD_MEMORY = textwrap.dedent("""
    import sys, time
    block = b"x" * (int(sys.argv[1]) << 20)  # one allocation, every page touched
    time.sleep(3)
    print("held", flush=True)
""")


@pytest.mark.parametrize("backend", BACKENDS)
async def test_memory_limit_holds_across_processes(backend):
    async with create_sandbox(config(backend, memory_mb=256)) as sandbox:
        await sandbox.write_file("/tmp/hold.py", HOLD_MEMORY)
        try:
            result = await sandbox.exec("for i in 1 2 3; do python3 /tmp/hold.py 150 & done; wait", timeout=60)
        except SandboxError as error:  # gVisor: the OOM killer may take the whole sandbox
            assert backend.get("runtime") == "runsc" and "OOM killed: True" in str(error), str(error)
            return
    assert result.stdout.count("held") <= 1, result


@pytest.mark.parametrize("backend", BACKENDS)
async def test_shared_memory_and_disk_are_limited_in_total(backend):
    async with create_sandbox(config(backend, disk_mb=128)) as sandbox:
        shm = await sandbox.exec("dd if=/dev/zero of=/dev/shm/fill bs=1M count=300 2>&1; ls -l /dev/shm/fill",
                                 timeout=60)
        await sandbox.exec("rm -f /dev/shm/fill", timeout=20)
        disk = await sandbox.exec(
            "for i in 1 2 3; do dd if=/dev/zero of=part$i bs=1M count=60 2>/dev/null || echo full $i; done; du -sm .",
            timeout=60)
    shm_bytes = int(shm.stdout.strip().splitlines()[-1].split()[4])
    assert shm_bytes < 200 << 20, shm.stdout
    assert "full" in disk.stdout and int(disk.stdout.split()[-2]) <= 128, disk.stdout


@pytest.mark.parametrize("backend", [*DOCKER_BACKENDS, BACKENDS[2]])
@pytest.mark.parametrize("disk_limit", ["auto", "tmpfs", "none"])
async def test_workspace_is_executable_in_every_disk_mode(backend, disk_limit):
    if backend.get("type") == "bwrap" and disk_limit != "auto":
        pytest.skip("bubblewrap has one disk mode")
    async with create_sandbox(config(backend, disk_limit=disk_limit)) as sandbox:
        await sandbox.write_file("run.sh", "#!/bin/sh\necho ran from the workspace\n", mode=0o755)
        result = await sandbox.exec("./run.sh", timeout=20)
    assert (result.exit_code, result.stdout) == (0, "ran from the workspace\n"), result


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_background_child_does_not_hold_the_command(backend):
    async with create_sandbox(config(backend)) as sandbox:
        started = time.monotonic()
        result = await sandbox.exec("echo started; sleep 100000 &", timeout=30)
        took = time.monotonic() - started
        await sandbox.kill_processes()
        left = await sandbox.exec("ps -eo args | grep 'sleep 100000' | grep -v grep || true", timeout=20)
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "started\n", False), result
    assert took < 15, took  # it returned when the shell exited, not at the 30 s timeout
    assert left.stdout == ""


@pytest.mark.parametrize("backend", DOCKER_BACKENDS[:1])  # under gVisor the root command cannot kill sandboxd
async def test_a_program_planted_for_the_launcher_never_runs(backend):
    """On a writable root a root command owns the image's programs and may kill sandboxd (same uid). The launcher
    then ran `exec sleep infinity`: a planted `sleep` ran with sandboxd's capabilities (SETUID, SETGID, KILL),
    survived kill_processes, and streamed into the host's channel, which held it all (600 MB in a red-team pass,
    2026-12-07). The launcher now waits with shell builtins; commands go on through docker exec."""
    planted = ("#!/bin/sh\necho ran > /tmp/planted-ran\n"  # then 64 MiB into the channel, no newline; then waits
               "exec python3 -c 'import os, time; [os.write(1, b\"A\" * 65536) for _ in range(1024)]; time.sleep(600)'\n")
    async with create_sandbox(config(backend, user="0:0", disk_limit="none", pids_limit=128)) as sandbox:
        server = sandbox._server
        assert server is not None and server.alive
        await sandbox.write_file("/tmp/sleep", planted)
        plant = ("for path in /usr/local/bin/sleep /usr/bin/sleep /bin/sleep; do cp /tmp/sleep $path; "
                 "chmod +x $path; done; for d in /proc/[0-9]*; do "
                 "[ \"$(cat $d/comm 2>/dev/null)\" = sandboxd ] && kill -9 ${d#/proc/}; done; echo planted")
        await sandbox.exec(["/bin/sh", "-c", plant], timeout=30)
        deadline = time.monotonic() + 10
        while server.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not server.alive and not server.tampered
        await asyncio.sleep(1)
        after = await sandbox.exec("cat /tmp/planted-ran 2>/dev/null; echo still-serves", timeout=30)
        await sandbox.kill_processes()
        left = await sandbox.exec("cat /proc/[0-9]*/comm 2>/dev/null | sort | uniq -c", timeout=30)
    assert after.stdout == "still-serves\n", after
    assert "python3" not in left.stdout and "sleep" not in left.stdout, left.stdout
