"""E2B backend: sandboxes in E2B's cloud through the `e2b` SDK's `AsyncSandbox`.

`SandboxConfig.image` names the E2B template (`agentrl-base:bookworm`, the local default,
maps to E2B's default template). Commands go through `sandbox.commands.run` with output
streamed into capped buffers (`retain_output=False`), so a flood never piles up in memory;
a timeout kills the command on E2B's side (the SDK raises `TimeoutException`). Files use
the SDK's filesystem API. The network is cut with `allow_internet_access=False` unless the
config asks for it, and the sandbox is killed on close.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import shlex
import tarfile
from pathlib import Path

from agentrl.errors import require
from agentrl.sandbox.archive import extract_archive
from agentrl.sandbox.base import BASE_IMAGE, CappedBuffer, RawExecResult, Sandbox, SandboxConfig, SandboxError
from agentrl.sandbox.labels import sandbox_labels

__all__ = ["E2BSandbox"]


class E2BSandbox(Sandbox):
    """A sandbox in E2B's cloud. `sandbox_class` defaults to `e2b.AsyncSandbox`."""

    backend = "e2b"

    def __init__(self, config: SandboxConfig, *, sandbox_class=None) -> None:
        super().__init__(config)
        self._sandbox_class = sandbox_class
        self.remote = None

    def _sdk(self):
        return require("e2b", "e2b")

    async def _start(self) -> None:
        e2b = self._sdk()
        sandbox_class = self._sandbox_class or e2b.AsyncSandbox
        api_key = self.config.e2b_api_key or os.environ.get("E2B_API_KEY")
        if not api_key:
            raise SandboxError("sandbox type 'e2b': no API key; set E2B_API_KEY or sandbox.e2b_api_key")
        template = None if self.config.image == BASE_IMAGE else self.config.image
        try:
            self.remote = await sandbox_class.create(
                template=template,
                timeout=int(max(self.config.startup_timeout_s, 300)),
                metadata=sandbox_labels(owner=self.owner, backend="e2b"),
                envs=dict(self.config.env),
                allow_internet_access=self.config.network,
                api_key=api_key,
            )
        except e2b.AuthenticationException as error:
            raise SandboxError(f"sandbox type 'e2b': E2B refused the API key ({error})") from None
        except e2b.SandboxException as error:
            raise SandboxError(
                f"sandbox type 'e2b': could not create a sandbox from template {template!r}: {error}"
            ) from None
        self.id = self.remote.sandbox_id
        if self.config.workdir:
            await self.remote.files.make_dir(self.config.workdir)

    async def _run(
        self, argv: list[str], *, timeout: float, cwd: str, env: dict[str, str], stdin: bytes | None,
        max_output: int,
    ) -> RawExecResult:
        e2b = self._sdk()
        out, err = CappedBuffer(max_output), CappedBuffer(max_output)
        command = shlex.join(argv)
        user = None if self.config.user in (None, "1000:1000") else self.config.user
        options = {"envs": env or None, "cwd": cwd, "user": user, "timeout": timeout,
                       "on_stdout": lambda text: out.write(text.encode()),
                       "on_stderr": lambda text: err.write(text.encode())}
        timed_out = False
        try:
            if stdin is None:
                result = await self.remote.commands.run(command, retain_output=False, **options)
            else:
                handle = await self.remote.commands.run(command, background=True, stdin=True, **options)
                await self.remote.commands.send_stdin(handle.pid, stdin)
                await self.remote.commands.close_stdin(handle.pid)
                result = await handle.wait()
            exit_code = result.exit_code
        except e2b.CommandExitException as error:
            exit_code = error.exit_code
        except e2b.TimeoutException:
            exit_code, timed_out = 137, True
        except e2b.SandboxException as error:
            raise SandboxError(f"sandbox {self.id}: E2B command failed: {error}") from None
        return RawExecResult(
            exit_code=exit_code, stdout=out.getvalue(), stderr=err.getvalue(), stdout_truncated=out.truncated,
            stderr_truncated=err.truncated, timed_out=timed_out,
        )

    # --- files through the SDK's filesystem API -----------------------------------------
    async def read_bytes(self, path: str) -> bytes:
        e2b = self._sdk()
        target = self._abs(path, "read_file")
        try:
            data = await self.remote.files.read(target, format="bytes")
        except e2b.NotFoundException:
            raise SandboxError(f"read_file {target}: No such file or directory") from None
        if len(data) > self.config.max_file_bytes:
            raise SandboxError(f"read_file {target}: larger than max_file_bytes={self.config.max_file_bytes}")
        return bytes(data)

    async def write_file(self, path: str, content: str | bytes, *, mode: int = 0o644) -> None:
        target = self._abs(path, "write_file")
        await self.remote.files.write(target, content.encode() if isinstance(content, str) else content)
        if mode != 0o644:
            await self.exec(["chmod", f"{mode:o}", target])

    async def upload(self, local_dir: str | Path, remote_dir: str) -> None:
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise SandboxError(f"upload: {local_dir} is not a folder")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for entry in sorted(local_dir.iterdir()):
                tar.add(entry, arcname=entry.name)
        archive = f"/tmp/agentrl-upload-{os.urandom(6).hex()}.tar"
        await self.remote.files.write(archive, buffer.getvalue())
        target = self._abs(remote_dir, "upload")
        result = await self.exec(f"mkdir -p {shlex.quote(target)} && tar -x -C {shlex.quote(target)} -f {archive}; "
                                 f"code=$?; rm -f {archive}; exit $code")
        if result.exit_code != 0:
            raise SandboxError(f"upload to {target}: {result.stderr.strip() or 'failed'}")

    async def download(self, remote_dir: str, local_dir: str | Path) -> list[str]:
        target = self._abs(remote_dir, "download")
        raw = await self.exec_bytes(f"set -o pipefail; tar -c -C {shlex.quote(target)} -f - . | base64 -w0",
                                    max_output=self.config.max_file_bytes * 4 // 3 + 4)
        if raw.exit_code != 0 or raw.stdout_truncated:
            raise SandboxError(
                f"download {target}: {raw.stderr.decode(errors='replace').strip() or 'too large or failed'}"
            )
        result = await asyncio.to_thread(extract_archive, base64.b64decode(raw.stdout), local_dir,
                                         max_bytes=self.config.max_file_bytes)
        return result.skipped

    async def kill_processes(self) -> None:
        """Every process of the sandbox user but this command (E2B's own daemon runs as root and stays)."""
        await self.exec(["/bin/sh", "-c", "kill -9 -1 2>/dev/null; true"], timeout=30)

    async def _close(self) -> None:
        if self.remote is not None:
            try:
                await self.remote.kill()
            except Exception:  # already gone on E2B's side: nothing left to clean up
                pass
