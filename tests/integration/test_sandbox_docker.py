"""Docker and bubblewrap sandboxes against the real engine: exec, files, limits, pool, errors."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid

import pytest

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.sandbox import SandboxConfig, SandboxError, SandboxPool, create_sandbox

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

needs_docker = pytest.mark.skipif(
    subprocess.run(["docker", "info"], capture_output=True).returncode != 0, reason="no Docker engine"
)
LOCAL_BACKENDS = [pytest.param("docker", marks=needs_docker), "bwrap"]


def owner() -> str:
    return f"test-docker-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
async def test_exec_files_and_transfer(backend, tmp_path):
    cfg = SandboxConfig(type=backend, env={"GREETING": "hi"}, owner=owner())
    async with create_sandbox(cfg) as sandbox:
        result = await sandbox.exec("echo $GREETING $EXTRA; pwd; id -u; echo oops >&2; exit 3", env={"EXTRA": "there"})
        assert result.exit_code == 3 and not result.ok
        assert result.stdout == "hi there\n/workspace\n1000\n"
        assert result.stderr == "oops\n"
        assert (await sandbox.exec(["python3", "-c", "import sys; print(sys.argv[1])", "a b"])).stdout == "a b\n"
        assert (await sandbox.exec("cat", stdin="piped")).stdout == "piped"

        await sandbox.write_file("pkg/mod.py", "VALUE = 41 + 1\n")
        assert await sandbox.read_file("/workspace/pkg/mod.py") == "VALUE = 41 + 1\n"
        assert (await sandbox.exec("python3 -c 'import mod; print(mod.VALUE)'", cwd="/workspace/pkg")).stdout == "42\n"
        payload = bytes(range(256)) * 4000
        await sandbox.write_file("/tmp/blob.bin", payload)
        assert await sandbox.read_bytes("/tmp/blob.bin") == payload
        with pytest.raises(SandboxError, match="No such file"):
            await sandbox.read_file("missing.txt")

        source = tmp_path / "src"
        (source / "sub").mkdir(parents=True)
        (source / "a.txt").write_text("A")
        (source / "sub" / "b.txt").write_text("B")
        await sandbox.upload(source, "/workspace/up")
        listing = await sandbox.exec("cd up && find . -type f | sort && stat -c %u a.txt")
        assert listing.stdout == "./a.txt\n./sub/b.txt\n1000\n"
        await sandbox.exec("cd up && echo C > sub/c.txt && ln -s /etc/passwd link && ln -s a.txt inner")
        skipped = await sandbox.download("/workspace/up", tmp_path / "back")
    assert (tmp_path / "back" / "sub" / "c.txt").read_text() == "C\n"
    assert (tmp_path / "back" / "a.txt").read_text() == "A"
    # Links are never written on the host, in or out of the folder; download lists them.
    assert not (tmp_path / "back" / "link").exists() and not (tmp_path / "back" / "inner").exists()
    assert sorted(skipped) == ["./inner (symbolic link)", "./link (symbolic link)"]
    with pytest.raises(SandboxError, match="closed"):
        await sandbox.exec("true")


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
async def test_concurrent_commands_in_one_sandbox(backend):
    async with create_sandbox(SandboxConfig(type=backend, owner=owner())) as sandbox:
        results = await asyncio.gather(*(
            sandbox.exec(f"sleep 0.{index % 3}; echo out-{index}; echo err-{index} >&2; exit {index}")
            for index in range(12)
        ))
        home = await sandbox.exec("touch $HOME/.probe && echo $HOME")
    for index, result in enumerate(results):
        assert (result.exit_code, result.stdout, result.stderr) == (index, f"out-{index}\n", f"err-{index}\n")
    assert home.exit_code == 0 and home.stdout.strip() == "/home/agent"


@needs_docker
async def test_docker_limits_and_disk_are_applied():
    cfg = SandboxConfig(cpus=0.5, memory_mb=300, pids_limit=50, disk_mb=64, owner=owner())
    async with create_sandbox(cfg) as sandbox:
        host = subprocess.run(["docker", "inspect", "-f", "{{json .HostConfig}}", sandbox.id], capture_output=True,
                              text=True, check=True).stdout
        assert '"NanoCpus":500000000' in host and '"Memory":314572800' in host and '"PidsLimit":50' in host
        assert '"CapDrop":["ALL"]' in host and "no-new-privileges" in host and '"NetworkMode":"none"' in host
        # Disk: writing past disk_mb fails (tmpfs fallback on this engine, or storage-opt).
        fill = await sandbox.exec("head -c 100000000 /dev/zero > big; echo rc=$?; ls -l big | awk '{print $5}'")
        assert "rc=0" not in fill.stdout
        assert int(fill.stdout.split()[-1]) <= 64 * 1024 * 1024
        assert sandbox.disk_mode in ("tmpfs", "storage-opt")
        if sandbox.disk_mode == "tmpfs":
            assert "Read-only file system" in (await sandbox.exec("touch /usr/x")).stderr
        # No privilege: no capabilities, cannot become root.
        caps = await sandbox.exec("grep CapEff /proc/self/status")
        assert caps.stdout.split()[-1] == "0000000000000000"


@needs_docker
async def test_image_content_in_workdir_is_kept():
    tag = f"agentrl-test-seed:{uuid.uuid4().hex[:8]}"
    build = subprocess.run(
        ["docker", "build", "--network", "none", "-q", "-t", tag, "-"],
        input="FROM agentrl-base:bookworm\nRUN mkdir -p /workspace/repo && echo seeded > /workspace/repo/f.txt "
        "&& chown -R 1000:1000 /workspace\n",
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr
    try:
        async with create_sandbox(SandboxConfig(image=tag, owner=owner())) as sandbox:
            result = await sandbox.exec("cat repo/f.txt && echo more >> repo/f.txt && cat repo/f.txt")
            assert result.stdout == "seeded\nseeded\nmore\n", result.stderr
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


@needs_docker
@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        # a package's image is not agentrl-base: build-base would not make it (an ecosystem walk-through)
        ({"image": "agentrl-no-such-image:latest"}, NotFoundError,
         r"not in the local Docker engine; build it \(`agentrl env check ENV` names the command, `agentrl env build "
         r"PKG` builds a package's Dockerfile\) or docker pull/load it$"),
        ({"memory_mb": 2}, SandboxError, "refused the sandbox.*memory_mb=2.*Minimum memory"),
        ({"cpus": 512}, SandboxError, "refused the sandbox.*cpus=512"),
    ],
    ids=["missing-image", "memory-too-small", "too-many-cpus"],
)
async def test_docker_errors_are_one_line(overrides, error, pattern):
    with pytest.raises(error, match=pattern) as caught:
        async with create_sandbox(SandboxConfig(owner=owner(), **overrides)):
            pass
    assert "\n" not in str(caught.value)


async def test_missing_docker_engine_suggests_bwrap(monkeypatch):
    from agentrl.sandbox import docker_engine

    monkeypatch.setattr(docker_engine, "_client", None)
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(AgentrlError, match="no Docker engine answers.*type = 'bwrap'") as caught:
        async with create_sandbox(SandboxConfig(owner=owner())):
            pass
    assert "\n" not in str(caught.value)
    monkeypatch.setattr(docker_engine, "_client", None)


async def test_bwrap_missing_rootfs_is_clear(tmp_path):
    with pytest.raises(SandboxError, match="rootfs .* missing.*build-base"):
        async with create_sandbox(SandboxConfig(type="bwrap", rootfs=str(tmp_path / "none"))):
            pass


@needs_docker
async def test_pool_hands_out_fresh_started_sandboxes():
    cfg = SandboxConfig(owner=owner())
    async with SandboxPool(cfg, size=2) as pool:
        assert pool.ready == 2
        async with pool.sandbox() as first:
            await first.write_file("state.txt", "task one")
            first_id = first.id
        # Released sandboxes are destroyed, never reused.
        gone = subprocess.run(["docker", "inspect", first_id], capture_output=True)
        assert gone.returncode != 0
        async with pool.sandbox() as second:
            assert second.id != first_id
            assert (await second.exec("cat state.txt")).exit_code != 0
        # More concurrent acquisitions than the pool holds still succeed.
        sandboxes = await asyncio.gather(*(pool.acquire() for _ in range(3)))
        assert len({s.id for s in sandboxes}) == 3
        held = [s.id for s in sandboxes]
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.owner={cfg.owner}"],
                          capture_output=True, text=True).stdout.split()
    assert left == [] and len(held) == 3


async def _until_gone(sandbox, process_name: str, *, timeout_s: float = 30.0) -> None:
    """Return once no process named `process_name` runs in `sandbox`'s container (asked as root, through the engine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        probe = sandbox.client.api.exec_create(sandbox.id, ["pgrep", "-x", process_name], user="0:0")["Id"]
        sandbox.client.api.exec_start(probe)
        if sandbox.client.api.exec_inspect(probe)["ExitCode"] == 1:
            return
        assert time.monotonic() < deadline, f"{process_name} still runs {timeout_s:.0f} s after it was killed"
        await asyncio.sleep(0.05)


@needs_docker
async def test_docker_exec_fallback_when_server_is_gone():
    async with create_sandbox(SandboxConfig(owner=owner(), max_output_bytes=1000)) as sandbox:
        assert (await sandbox.exec("echo via-server")).stdout == "via-server\n"
        refused = await sandbox.exec("pkill -x sandboxd; echo $?")
        assert refused.stdout != "0\n"  # a command cannot signal the server (another uid)
        served = sandbox.server_execs
        assert served >= 2
        # The server dies (as if it crashed): root kills it through the engine.
        killer = sandbox.client.api.exec_create(sandbox.id, ["pkill", "-x", "sandboxd"], user="0:0")["Id"]
        sandbox.client.api.exec_start(killer)
        await _until_gone(sandbox, "sandboxd")
        # From here on commands go through `docker exec`, with the same guarantees.
        result = await sandbox.exec("echo $X; echo err >&2; exit 4", env={"X": "fallback"})
        assert (result.exit_code, result.stdout, result.stderr) == (4, "fallback\n", "err\n")
        assert (await sandbox.exec("cat", stdin=b"z" * 5000)).stdout == "z" * 1000
        capped = await sandbox.exec("head -c 10000000 /dev/zero")
        assert capped.stdout_truncated and len(capped.stdout) == 1000
        slow = await sandbox.exec("(setsid sleep 300 &); sleep 300", timeout=1)
        assert slow.timed_out and slow.exit_code == 137
        left = await sandbox.exec("ps -eo args | grep -c '^sleep 300' || true")
        assert left.stdout.strip() == "0"
        await sandbox.write_file("f.txt", "through exec")
        assert await sandbox.read_file("f.txt") == "through exec"
        assert sandbox.server_execs == served  # nothing went through the dead server


@needs_docker
async def test_image_without_python_uses_docker_exec():
    tag = f"agentrl-test-nopython:{uuid.uuid4().hex[:8]}"
    build = subprocess.run(["docker", "build", "--network", "none", "-q", "-t", tag, "-"],
                           input="FROM agentrl-base:bookworm\nRUN rm -f /usr/bin/python3*\n",
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    try:
        async with create_sandbox(SandboxConfig(image=tag, owner=owner())) as sandbox:
            result = await sandbox.exec("echo no python here; command -v python3 || echo none")
            assert result.stdout == "no python here\nnone\n"
            assert sandbox.server_execs == 0
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


@needs_docker
async def test_coreutils_work_under_gvisor():
    runtimes = subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True).stdout
    if "runsc" not in runtimes:
        pytest.skip("gVisor runtime runsc not registered")
    async with create_sandbox(SandboxConfig(runtime="runsc", owner=owner())) as sandbox:
        await sandbox.write_file("a.txt", "12345")
        result = await sandbox.exec("ls; stat -c %s a.txt; ls -la / | grep -c workspace")
        assert result.exit_code == 0, result.stderr
        assert result.stdout == "a.txt\n5\n1\n"
        runtime = subprocess.run(["docker", "inspect", "-f", "{{.HostConfig.Runtime}}", sandbox.id],
                                 capture_output=True, text=True).stdout.strip()
        assert runtime == "runsc"


@pytest.mark.parametrize("backend", LOCAL_BACKENDS)
def test_cli_run_and_ls(backend):
    import sys

    cli = [sys.executable, "-m", "agentrl.cli", "sandbox"]
    ran = subprocess.run([*cli, "run", "--type", backend, "-e", "WHO=cli", "--", "bash", "-c", "echo hi $WHO; exit 4"],
                         capture_output=True, text=True)
    assert (ran.returncode, ran.stdout) == (4, "hi cli\n"), ran.stderr
    slow = subprocess.run([*cli, "run", "--type", backend, "--timeout", "1", "--", "sleep", "30"],
                          capture_output=True, text=True)
    assert slow.returncode == 137 and "killed after 1s timeout" in slow.stderr
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import asyncio, sys\nfrom agentrl.sandbox import SandboxConfig, create_sandbox\n"
         "async def main():\n"
         f"    async with create_sandbox(SandboxConfig(type={backend!r}, owner='cli-ls-test')) as sb:\n"
         "        print(sb.id, flush=True)\n        await asyncio.sleep(60)\n"
         "asyncio.run(main())\n"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        sandbox_id = holder.stdout.readline().strip()
        listing = subprocess.run([*cli, "ls", "--type", backend], capture_output=True, text=True)
        assert listing.returncode == 0
        row = [line for line in listing.stdout.splitlines() if "cli-ls-test" in line]
        assert len(row) == 1 and sandbox_id[:12] in row[0] and "yes" not in row[0]  # alive, not an orphan
    finally:
        holder.kill()
        holder.wait()
        subprocess.run([*cli, "gc", "--owner", "cli-ls-test"], capture_output=True)


@needs_docker
def test_every_request_of_the_shared_client_uses_one_pool_that_is_never_closed():
    """docker-py keyed its unix-socket pools by request URL and kept 25, closing the oldest: with dozens of
    sandboxes a pool another thread had just taken was closed under it (a rollout of an eval lost to "Pool is
    closed."). Here a pool is taken, then more distinct URLs than docker-py keeps are requested of the real engine."""
    import docker

    from agentrl.sandbox.docker_engine import docker_client

    client = docker_client()
    adapter = client.api.adapters["http+docker://"]
    taken = adapter.get_connection("http+docker://localhost/v1.47/containers/agentrl-taken/json")
    for index in range(40):
        with pytest.raises(docker.errors.NotFound):
            client.api.inspect_container(f"agentrl-test-no-such-container-{uuid.uuid4().hex[:6]}-{index}")
    assert taken.pool is not None, "the pool taken first was closed by later requests"
    assert adapter.get_connection("http+docker://localhost/v1.47/containers/other/json") is taken
