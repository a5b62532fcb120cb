"""The E2B backend against a fake of `e2b.AsyncSandbox`.

E2B's cloud cannot be reached from here, so `FakeAsyncSandbox` stands in for it. It follows
the real SDK's interface as installed (`AsyncSandbox.create(template=, timeout=, metadata=,
envs=, allow_internet_access=, api_key=)`, `.sandbox_id`, `.commands.run(cmd, background=,
envs=, user=, cwd=, on_stdout=, on_stderr=, stdin=, timeout=, retain_output=, shell=)` returning a
`CommandResult` or raising the SDK's own `CommandExitException` / `TimeoutException`,
`.commands.send_stdin/close_stdin`, `.files.read/write/make_dir`, `.kill()`), and the test
checks those signatures against the installed `e2b` package so the fake cannot drift. Its
commands really run, in a local temporary folder (path-mapped), so outputs are real.
A real-cloud test runs only when E2B_API_KEY is set.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

e2b = pytest.importorskip("e2b")

from agentrl.sandbox import SandboxConfig, SandboxError, create_sandbox
from agentrl.sandbox.e2b_backend import E2BSandbox

CommandResult = e2b.CommandResult


class _Handle:
    def __init__(self, proc, pump):
        self.pid = proc.pid
        self._proc, self._pump = proc, pump

    async def wait(self):
        return await self._pump


class _Commands:
    def __init__(self, box: FakeAsyncSandbox) -> None:
        self.box = box
        self.procs: dict[int, asyncio.subprocess.Process] = {}

    async def run(self, cmd, background=None, envs=None, user=None, cwd=None, on_stdout=None, on_stderr=None,
                  stdin=None, timeout=60, request_timeout=None, *, retain_output=True, shell=None):
        local_cmd = cmd.replace("/workspace", str(self.box.root / "workspace")).replace("/tmp/", f"{self.box.root}/tmp/")
        # The SDK's default shell is `bash -l -c`; here without -l: this host's login profile is not the sandbox's
        proc = await asyncio.create_subprocess_exec(
            *(shell or ["/bin/bash", "-c"]), local_cmd, cwd=self.box.local(cwd or "/workspace"),
            env={"PATH": os.environ["PATH"], **self.box.envs, **(envs or {})},
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )
        self.procs[proc.pid] = proc
        out_parts, err_parts = [], []

        async def pump(stream, callback, keep):
            while chunk := await stream.read(4096):
                text = chunk.decode(errors="replace")
                if callback:
                    callback(text)
                if retain_output:
                    keep.append(text)

        async def finish():
            try:
                await asyncio.wait_for(
                    asyncio.gather(pump(proc.stdout, on_stdout, out_parts), pump(proc.stderr, on_stderr, err_parts),
                                   proc.wait()), timeout)
            except TimeoutError:
                os.killpg(proc.pid, 9)
                await proc.wait()
                raise e2b.TimeoutException("context deadline exceeded") from None
            result = CommandResult(stderr="".join(err_parts), stdout="".join(out_parts), exit_code=proc.returncode,
                                   error=None)
            if proc.returncode != 0:
                raise e2b.CommandExitException(stderr=result.stderr, stdout=result.stdout, exit_code=result.exit_code,
                                               error=None)
            return result

        if background:
            return _Handle(proc, asyncio.ensure_future(finish()))
        return await finish()

    async def send_stdin(self, pid, data, request_timeout=None):
        proc = self.procs[pid]
        proc.stdin.write(data.encode() if isinstance(data, str) else data)
        await proc.stdin.drain()

    async def close_stdin(self, pid, request_timeout=None):
        self.procs[pid].stdin.close()


class _Files:
    def __init__(self, box: FakeAsyncSandbox) -> None:
        self.box = box

    async def read(self, path, format="text", user=None, request_timeout=None, gzip=False, stream_idle_timeout=None):
        local = self.box.local(path)
        if not local.exists():
            raise e2b.NotFoundException(f"file {path} not found")
        data = local.read_bytes()
        return bytearray(data) if format == "bytes" else data.decode()

    async def write(self, path, data, user=None, request_timeout=None, gzip=False, use_octet_stream=None,
                    metadata=None):
        local = self.box.local(path)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data.encode() if isinstance(data, str) else bytes(data))

    async def make_dir(self, path, user=None, request_timeout=None):
        self.box.local(path).mkdir(parents=True, exist_ok=True)
        return True


class FakeAsyncSandbox:
    """Stands in for e2b.AsyncSandbox (see the module docstring)."""

    created: list[FakeAsyncSandbox] = []

    def __init__(self, **options) -> None:
        self.options = options
        self.sandbox_id = f"fake-{uuid.uuid4().hex[:8]}"
        self.envs = dict(options.get("envs") or {})
        self.root = Path(tempfile.mkdtemp(prefix="fake-e2b-"))
        (self.root / "tmp").mkdir()
        self.commands = _Commands(self)
        self.files = _Files(self)
        self.killed = False

    def local(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    @classmethod
    async def create(cls, template=None, timeout=None, metadata=None, envs=None, secure=None,
                     allow_internet_access=None, **opts):
        if opts.get("api_key") != "test-key":
            raise e2b.AuthenticationException("invalid API key")
        box = cls(template=template, timeout=timeout, metadata=metadata, envs=envs,
                  allow_internet_access=allow_internet_access, **opts)
        cls.created.append(box)
        return box

    async def kill(self, **opts):
        self.killed = True
        shutil.rmtree(self.root, ignore_errors=True)
        return True


def test_fake_follows_the_installed_sdk():
    real = e2b.AsyncSandbox
    for name in ("template", "timeout", "metadata", "envs", "allow_internet_access"):
        assert name in inspect.signature(real.create).parameters
    from e2b.sandbox_async.commands.command import Commands
    from e2b.sandbox_async.filesystem.filesystem import Filesystem

    for real_fn, fake_fn in [(Commands.run, _Commands.run), (Commands.send_stdin, _Commands.send_stdin),
                             (Commands.close_stdin, _Commands.close_stdin), (Filesystem.read, _Files.read),
                             (Filesystem.write, _Files.write), (Filesystem.make_dir, _Files.make_dir)]:
        assert list(inspect.signature(real_fn).parameters) == list(inspect.signature(fake_fn).parameters), real_fn
    assert hasattr(real, "kill") and "exit_code" in inspect.signature(e2b.CommandExitException).parameters


def e2b_sandbox(**overrides) -> E2BSandbox:
    config = SandboxConfig(type="e2b", e2b_api_key="test-key", env={"BASE": "b"}, **overrides)
    return E2BSandbox(config, sandbox_class=FakeAsyncSandbox)


async def test_e2b_adapter_exec_files_and_kill(tmp_path):
    async with e2b_sandbox(max_output_bytes=1000) as sandbox:
        box = FakeAsyncSandbox.created[-1]
        assert box.options["allow_internet_access"] is False
        assert box.options["template"] is None  # the local base image maps to E2B's default template
        assert box.options["metadata"]["agentrl.owner"] == sandbox.owner
        result = await sandbox.exec("echo $BASE $X; echo err >&2; exit 3", env={"X": "x"})
        assert (result.exit_code, result.stdout, result.stderr) == (3, "b x\n", "err\n")
        big = await sandbox.exec("head -c 50000 /dev/zero | tr '\\0' a")
        assert big.stdout_truncated and len(big.stdout) == 1000
        slow = await sandbox.exec("sleep 5", timeout=0.5)
        assert slow.timed_out and slow.exit_code == 137
        assert (await sandbox.exec("cat", stdin="via stdin")).stdout == "via stdin"
        await sandbox.write_file("dir/f.txt", "content")
        assert await sandbox.read_file("/workspace/dir/f.txt") == "content"
        with pytest.raises(SandboxError, match="No such file"):
            await sandbox.read_file("missing")
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "a.txt").write_text("A")
        await sandbox.upload(tmp_path / "up", "/workspace/up")
        assert (await sandbox.exec("cat /workspace/up/a.txt")).stdout == "A"
        await sandbox.download("/workspace/up", tmp_path / "down")
        assert (tmp_path / "down" / "a.txt").read_text() == "A"
    assert box.killed and not box.root.exists()


async def test_e2b_errors_are_clear(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxError, match="E2B_API_KEY"):
        async with create_sandbox(SandboxConfig(type="e2b")):
            pass
    with pytest.raises(SandboxError, match="refused the API key"):
        async with E2BSandbox(SandboxConfig(type="e2b", e2b_api_key="wrong"), sandbox_class=FakeAsyncSandbox):
            pass


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="E2B_API_KEY not set: the real E2B cloud is not used")
async def test_real_e2b_cloud():
    async with create_sandbox(SandboxConfig(type="e2b")) as sandbox:
        result = await sandbox.exec("echo hello from e2b")
    assert result.stdout == "hello from e2b\n"
