"""The one async Sandbox interface, its config, and the results it returns.

A backend (Docker, bubblewrap, E2B) implements `_start`, `_run` (run an argv with optional
stdin bytes, capped output and a deadline) and `_close`. File transfer (`read_file`,
`write_file`, `upload`, `download`) is built here on top of `_run` with shell tools that
run *inside* the sandbox, so a symlink planted by sandboxed code can never make the host
read or write its own files; a backend with a native file API may override them.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from agentrl import env_vars
from agentrl.config import BaseConfig
from agentrl.errors import AgentrlWarning, SandboxError
from agentrl.sandbox.archive import extract_archive, pack_folder, resolve_path

__all__ = ["ExecResult", "RawExecResult", "Sandbox", "SandboxConfig", "SandboxError", "default_owner",
           "limit_not_enforced", "network_not_available"]

BASE_IMAGE = "agentrl-base:bookworm"
QUICK_READ_BYTES = 4 * 1024 * 1024  # reads try this cap first (fast paths), then max_file_bytes
MAX_TIMEOUT_S = 7 * 86_400.0  # a week: any longer command timeout is a mistake (and 1e30 overflows the clocks)


def default_owner() -> str:
    """The run id sandboxes are labelled with: `$AGENTRL_RUN_ID`, else `pid-<pid>`."""
    return env_vars.RUN_ID.get() or f"pid-{os.getpid()}"


class SandboxConfig(BaseConfig):
    """How to create a sandbox: backend, image, limits, network and environment."""

    type: Literal["docker", "bwrap", "e2b"] = "docker"
    """Backend: 'docker' (default), 'bwrap' (bubblewrap, no Docker engine needed) or 'e2b' (E2B cloud)."""
    image: str = BASE_IMAGE
    """Docker image (docker), E2B template (e2b); bwrap uses `rootfs` instead."""
    runtime: Literal["runc", "runsc"] = "runc"
    """Docker OCI runtime: 'runsc' (gVisor) is recommended for untrusted code; 'runc' is the default."""
    rootfs: str | None = None
    """bwrap only: root filesystem tree (default: the base image's debootstrap tree)."""
    cpus: float = Field(default=1.0, gt=0, le=4096, allow_inf_nan=False)
    """CPU limit in cores."""
    memory_mb: int = Field(default=1024, gt=0)
    """Memory limit in MiB (no swap beyond it); a process exceeding it is killed."""
    pids_limit: int = Field(default=256, gt=0)
    """Maximum number of processes/threads in the sandbox (stops fork bombs)."""
    disk_mb: int = Field(default=2048, gt=0)
    """Writable disk limit in MiB (Docker storage-opt where supported, else size-limited tmpfs mounts)."""
    disk_limit: Literal["auto", "storage-opt", "tmpfs", "none"] = "auto"
    """How to enforce `disk_mb` on Docker: 'auto' picks storage-opt when the engine supports it, else tmpfs."""
    writable_paths: list[str] = Field(default_factory=lambda: ["/tmp", "/home/agent"])
    """With disk_limit 'tmpfs': paths (besides `workdir`) mounted as empty size-limited tmpfs on a read-only root
    (the workdir's tmpfs is seeded with the image's content there)."""
    network: bool = False
    """Give the sandbox network access (off by default)."""
    docker_network: str | None = None
    """docker only: join this existing (internal) Docker network instead, reachable by its other containers as
    `network_alias` (a Harbor docker-compose task's services); `network` is then not used."""
    network_alias: str = "main"
    """docker only: the sandbox's name on `docker_network`."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set for every command."""
    workdir: str = "/workspace"
    """Working directory of commands (created when missing)."""
    user: str | None = "1000:1000"
    """User commands run as ('uid:gid' or a name); None keeps the image's user (often root)."""
    exec_timeout_s: float = Field(default=60.0, gt=0, le=MAX_TIMEOUT_S)
    """Default per-command timeout in seconds; the command and its children are killed at it."""
    max_output_bytes: int = Field(default=1_000_000, gt=0)
    """Per-stream cap on stdout/stderr kept from one command; the rest is read and dropped."""
    max_file_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    """Largest file or directory archive `read_file`/`download` will transfer."""
    shell: list[str] = Field(default_factory=lambda: ["/bin/bash", "-c"])
    """Shell a string command runs under."""
    owner: str | None = None
    """Run id put in the `agentrl.owner` label (default `$AGENTRL_RUN_ID` or pid-<pid>)."""
    startup_timeout_s: float = Field(default=60.0, gt=0, le=MAX_TIMEOUT_S)
    """How long creating a sandbox may take."""
    e2b_api_key: str | None = None
    """e2b only: API key (default `$E2B_API_KEY`)."""
    unenforceable_limits: Literal["warn", "refuse"] = "warn"
    """When the host cannot enforce a limit (no cgroup for bwrap's memory, no seccomp filter under gVisor):
    'warn' once in one line naming it and run without it, or 'refuse' to create the sandbox."""


@dataclass
class RawExecResult:
    """Bytes-level result of one command, as backends produce it."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0


@dataclass
class ExecResult:
    """Result of `Sandbox.exec`: exit code, decoded and capped output, and whether it timed out."""

    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_raw(cls, raw: RawExecResult) -> ExecResult:
        return cls(
            exit_code=raw.exit_code,
            stdout=raw.stdout.decode("utf-8", errors="replace"),
            stderr=raw.stderr.decode("utf-8", errors="replace"),
            stdout_truncated=raw.stdout_truncated,
            stderr_truncated=raw.stderr_truncated,
            timed_out=raw.timed_out,
            duration_s=raw.duration_s,
        )


class CappedBuffer:
    """Keeps the first `limit` bytes written to it and counts (but drops) the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts: list[bytes] = []
        self.kept = 0
        self.total = 0

    def write(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - self.kept
        if room > 0:
            piece = data[:room]
            self._parts.append(piece)
            self.kept += len(piece)

    @property
    def truncated(self) -> bool:
        return self.total > self.kept

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


_warned_limits: set[str] = set()  # what was warned about (a limit, or "network: why"), once per process


def _refuse_or_warn(config: SandboxConfig, message: str, *, key: str, fix: str, instead: str) -> None:
    """Raise `message; fix` if `unenforceable_limits` is 'refuse', else warn `message; instead` once a key."""
    if config.unenforceable_limits == "refuse":
        raise SandboxError(f"{message}; {fix}")
    if key not in _warned_limits:
        _warned_limits.add(key)
        warnings.warn(f"{message}; {instead}", AgentrlWarning, stacklevel=4)


def limit_not_enforced(config: SandboxConfig, limit: str, why: str) -> None:
    """The host cannot enforce `limit`: refuse the sandbox or warn once per limit, as `unenforceable_limits` says."""
    _refuse_or_warn(config, f"sandbox limit {limit} cannot be enforced on this host ({why})", key=limit,
                    fix="fix the host or set sandbox unenforceable_limits='warn' to run without it",
                    instead="running without it")


def network_not_available(config: SandboxConfig, why: str) -> str:
    """The host cannot give the network `config` asks for: refuse or warn once, per `unenforceable_limits`.

    Returns the one-line note the sandbox keeps (`Sandbox.network_note`); it then runs with no network.
    """
    message = f"sandbox network: asked for, but this host gives sandboxes none ({why})"
    _refuse_or_warn(config, message, key=f"network: {why}",
                    fix="give the engine a network or set sandbox unenforceable_limits='warn'",
                    instead="running with no network")
    return f"{message}; ran with no network"


class Sandbox(ABC):
    """An isolated place to run commands; use as `async with create_sandbox(cfg) as sb:`."""

    backend: str = "base"

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self.owner = config.owner or default_owner()
        self.id: str = ""
        self.closed = False
        self.network_note: str | None = None
        """Set when `config.network` asked for network access that this host could not give (one line why)."""

    # --- backend hooks -------------------------------------------------------------
    @abstractmethod
    async def _start(self) -> None:
        """Create and start the sandbox; sets `self.id`."""

    @abstractmethod
    async def _run(
        self, argv: list[str], *, timeout: float, cwd: str, env: dict[str, str], stdin: bytes | None,
        max_output: int,
    ) -> RawExecResult:
        """Run argv inside the sandbox; kill it (and its children) at `timeout` seconds."""

    @abstractmethod
    async def _close(self) -> None:
        """Destroy the sandbox and everything it holds."""

    # --- public API ----------------------------------------------------------------
    async def start(self) -> Sandbox:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> Sandbox:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Destroy the sandbox; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        await self._close()

    def _argv(self, cmd: str | list[str]) -> list[str]:
        return list(cmd) if isinstance(cmd, list) else [*self.config.shell, cmd]

    async def exec_bytes(
        self, cmd: str | list[str], *, timeout: float | None = None, cwd: str | None = None,
        env: dict[str, str] | None = None, stdin: bytes | None = None, max_output: int | None = None,
    ) -> RawExecResult:
        """Run a command (a shell string or an argv list) and return raw bytes output."""
        if self.closed:
            raise SandboxError(f"sandbox {self.id or '?'} is closed")
        if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:  # also NaN
            raise SandboxError(f"exec timeout {timeout!r}: give seconds in (0, {MAX_TIMEOUT_S:g}]")
        started = time.monotonic()
        result = await self._run(
            self._argv(cmd),
            timeout=float(timeout if timeout is not None else self.config.exec_timeout_s),
            cwd=cwd or self.config.workdir,
            env={**self.config.env, **(env or {})},
            stdin=stdin,
            max_output=max_output or self.config.max_output_bytes,
        )
        result.duration_s = time.monotonic() - started
        return result

    async def exec(
        self, cmd: str | list[str], *, timeout: float | None = None, cwd: str | None = None,
        env: dict[str, str] | None = None, stdin: bytes | str | None = None,
    ) -> ExecResult:
        """Run a command; output is decoded as UTF-8 and capped at `max_output_bytes` per stream."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        raw = await self.exec_bytes(cmd, timeout=timeout, cwd=cwd, env=env, stdin=stdin)
        return ExecResult.from_raw(raw)

    # --- files, built on exec ------------------------------------------------------
    def _abs(self, path: str, action: str) -> str:
        """The absolute in-sandbox path (relative paths may not leave the workdir; see `archive.resolve_path`)."""
        return resolve_path(self.config.workdir, path, action=action)

    @abstractmethod
    async def kill_processes(self) -> None:
        """Kill every process earlier commands left running (the agent's background jobs); the sandbox stays usable.

        Call it between the agent's commands and any command whose result must be trusted.
        """

    async def _read_output(self, argv: list[str]) -> RawExecResult:
        """Run an idempotent reading command: first with a small output cap, again with the full one if cut."""
        quick = min(self.config.max_file_bytes, QUICK_READ_BYTES)
        raw = await self.exec_bytes(argv, max_output=quick)
        if raw.stdout_truncated and raw.exit_code == 0 and self.config.max_file_bytes > quick:
            raw = await self.exec_bytes(argv, max_output=self.config.max_file_bytes)
        return raw

    async def read_bytes(self, path: str) -> bytes:
        """The content of a file in the sandbox (NotFound as a SandboxError)."""
        target = self._abs(path, "read_file")
        raw = await self._read_output(["cat", "--", target])
        if raw.exit_code != 0:
            raise SandboxError(f"read_file {target}: {raw.stderr.decode(errors='replace').strip() or 'failed'}")
        if raw.stdout_truncated:
            raise SandboxError(f"read_file {target}: larger than max_file_bytes={self.config.max_file_bytes}")
        return raw.stdout

    async def read_file(self, path: str) -> str:
        """The content of a text file in the sandbox."""
        return (await self.read_bytes(path)).decode("utf-8", errors="replace")

    async def write_file(self, path: str, content: str | bytes, *, mode: int = 0o644) -> None:
        """Create or replace a file in the sandbox (parent folders are created)."""
        data = content.encode() if isinstance(content, str) else content
        target = self._abs(path, "write_file")
        parent = os.path.dirname(target) or "/"
        script = (f"mkdir -p -- {shlex.quote(parent)} && cat > {shlex.quote(target)} "
                  f"&& chmod {mode:o} -- {shlex.quote(target)}")
        raw = await self.exec_bytes(["/bin/sh", "-c", script], stdin=data)
        if raw.exit_code != 0:
            raise SandboxError(f"write_file {target}: {raw.stderr.decode(errors='replace').strip() or 'failed'}")

    async def upload(self, local_dir: str | Path, remote_dir: str) -> None:
        """Copy a local folder's contents into `remote_dir` in the sandbox."""
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise SandboxError(f"upload: {local_dir} is not a folder")
        archive = await asyncio.to_thread(pack_folder, local_dir)
        target = self._abs(remote_dir, "upload")
        script = f"mkdir -p -- {shlex.quote(target)} && tar -x --no-same-owner -C {shlex.quote(target)} -f -"
        raw = await self.exec_bytes(["/bin/sh", "-c", script], stdin=archive)
        if raw.exit_code != 0:
            raise SandboxError(f"upload to {target}: {raw.stderr.decode(errors='replace').strip() or 'failed'}")

    async def download(self, remote_dir: str, local_dir: str | Path) -> list[str]:
        """Copy `remote_dir`'s regular files and folders into a local folder; returns what was left out.

        The archive is made inside the sandbox and checked member by member on the host
        (`archive.extract_archive`): links, devices and unsafe names are never written.
        """
        target = self._abs(remote_dir, "download")
        raw = await self._read_output(["tar", "-c", "-C", target, "-f", "-", "."])
        if raw.exit_code != 0:
            raise SandboxError(f"download {target}: {raw.stderr.decode(errors='replace').strip() or 'failed'}")
        if raw.stdout_truncated:
            raise SandboxError(f"download {target}: larger than max_file_bytes={self.config.max_file_bytes}")
        result = await asyncio.to_thread(extract_archive, raw.stdout, local_dir, max_bytes=self.config.max_file_bytes)
        return result.skipped  # unpacked beside the event loop: a large archive holds no other rollout
