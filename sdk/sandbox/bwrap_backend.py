"""Bubblewrap backend, for machines without a Docker engine.

Each command is one `bwrap` process: new user, network, pid, ipc, uts and mount
namespaces over the read-only base rootfs (the debootstrap tree of `agentrl-base`), with a
writable workspace, /tmp and home that live in a per-sandbox host folder and persist
between commands (processes do not: each command's pid namespace dies with it). The
bwrap process runs as a host uid of its own (one per sandbox, so the process limit is per
sandbox), with rlimits for memory (address space), CPU time, processes and file size
(`disk_mb` caps each file). A timeout kills the outer bwrap, whose pid-namespace init
takes every process of the command with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox.base import CappedBuffer, RawExecResult, Sandbox, SandboxConfig, SandboxError
from agentrl.sandbox.labels import sandbox_labels

__all__ = ["BwrapSandbox", "list_workspaces", "workspace_root"]

HOST_UID_BASE = 200_000
HOST_UID_SPAN = 100_000
INNER_UID = 1000
LABELS_FILE = "labels.json"


def workspace_root() -> Path:
    """Host folder holding the bwrap sandboxes' writable trees."""
    from agentrl.sandbox.base_image import cache_root

    return cache_root() / "bwrap"


@dataclass
class Workspace:
    """A bwrap sandbox's host folder and its labels."""

    path: Path
    labels: dict[str, str]


def list_workspaces() -> list[Workspace]:
    """All bwrap sandbox folders on this machine."""
    root = workspace_root()
    found = []
    if root.is_dir():
        for path in sorted(root.iterdir()):
            try:
                labels = json.loads((path / LABELS_FILE).read_text())
            except (OSError, ValueError):
                labels = {}
            found.append(Workspace(path=path, labels=labels))
    return found


class BwrapSandbox(Sandbox):
    """A sandbox made of bubblewrap namespaces over a read-only rootfs."""

    backend = "bwrap"

    def __init__(self, config: SandboxConfig) -> None:
        super().__init__(config)
        self.root: Path | None = None
        self.host_uid = 0
        self._procs: set[asyncio.subprocess.Process] = set()

    async def _start(self) -> None:
        from agentrl.sandbox.base_image import rootfs_dir

        cfg = self.config
        if shutil.which("bwrap") is None:
            raise SandboxError("sandbox type 'bwrap': bubblewrap is not installed; run: apt-get install bubblewrap")
        rootfs = Path(cfg.rootfs) if cfg.rootfs else rootfs_dir()
        if not (rootfs / "bin" / "sh").exists():
            raise SandboxError(
                f"sandbox type 'bwrap': rootfs {rootfs} is missing or not a root filesystem; "
                "build it with: agentrl sandbox build-base (or set sandbox.rootfs)"
            )
        if os.geteuid() != 0:
            raise SandboxError("sandbox type 'bwrap': needs root to run each sandbox under its own host uid")
        self.rootfs = rootfs
        base = workspace_root()
        base.mkdir(parents=True, exist_ok=True)
        safe_owner = re.sub(r"[^A-Za-z0-9_.-]", "_", self.owner)[:40]
        self.root = Path(tempfile.mkdtemp(prefix=f"{safe_owner}-{os.getpid()}-", dir=base))
        self.root.chmod(0o755)
        self.id = self.root.name
        self.host_uid = HOST_UID_BASE + int.from_bytes(os.urandom(4), "big") % HOST_UID_SPAN
        for name in ("work", "tmp", "home"):
            (self.root / name).mkdir()
            os.chown(self.root / name, self.host_uid, self.host_uid)
        (self.root / LABELS_FILE).write_text(json.dumps(sandbox_labels(owner=self.owner, backend="bwrap")))

    def _bwrap_argv(self, argv: list[str], *, cwd: str, env: dict[str, str]) -> list[str]:
        cfg = self.config
        args = [
            "bwrap", "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
            "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--hostname", "sandbox",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", str(self.rootfs), "/", "--dev", "/dev", "--proc", "/proc",
            "--bind", str(self.root / "work"), cfg.workdir,
            "--bind", str(self.root / "tmp"), "/tmp",
            "--bind", str(self.root / "home"), "/home/agent",
            "--chdir", cwd, "--clearenv",
        ]
        if not cfg.network:
            args.insert(1, "--unshare-net")
        base_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/home/agent",
                    "LANG": "C.UTF-8", "USER": "agent"}
        for key, value in {**base_env, **env}.items():
            args += ["--setenv", key, value]
        return [*args, "--", *argv]

    def _limits(self, timeout: float):
        cfg = self.config
        uid = self.host_uid
        cpu_seconds = int(timeout * max(cfg.cpus, 1.0)) + 2
        memory = cfg.memory_mb * 1024 * 1024
        fsize = cfg.disk_mb * 1024 * 1024

        def apply() -> None:  # runs in the child between fork and exec
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
            resource.setrlimit(resource.RLIMIT_NPROC, (cfg.pids_limit, cfg.pids_limit))
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

        return apply

    async def _run(
        self, argv: list[str], *, timeout: float, cwd: str, env: dict[str, str], stdin: bytes | None,
        max_output: int,
    ) -> RawExecResult:
        if self.root is None:
            raise SandboxError("bwrap sandbox is not started")
        loop = asyncio.get_running_loop()
        started = loop.time()
        # bwrap's options (host paths, environment) go through a pipe (`--args FD`), so the
        # sandbox's /proc/1/cmdline shows only the command.
        full = self._bwrap_argv(argv, cwd=cwd, env=env)
        split = full.index("--")
        options = b"".join(arg.encode() + b"\0" for arg in full[1:split])
        read_end, write_end = os.pipe()
        try:
            if len(options) > 60000:  # beyond a pipe's buffer: keep them on the command line
                command = full
            else:
                os.write(write_end, options)
                command = ["bwrap", "--args", str(read_end), *full[split:]]
            os.close(write_end)
            write_end = -1
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                preexec_fn=self._limits(timeout), start_new_session=True, pass_fds=(read_end,),
            )
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        self._procs.add(proc)
        out, err = CappedBuffer(max_output), CappedBuffer(max_output)

        async def pump(stream: asyncio.StreamReader, buffer: CappedBuffer) -> None:
            while chunk := await stream.read(65536):
                buffer.write(chunk)

        async def feed() -> None:
            if stdin is not None and proc.stdin is not None:
                try:
                    proc.stdin.write(stdin)
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    proc.stdin.close()

        timed_out = False
        work = asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err), feed(), proc.wait())
        try:
            await asyncio.wait_for(asyncio.shield(work), timeout=timeout)
        except TimeoutError:
            timed_out = True
            self._kill(proc)
            await work
        except BaseException:
            self._kill(proc)
            raise
        finally:
            self._procs.discard(proc)
        code = proc.returncode if proc.returncode is not None else -1
        exit_code = 128 - code if code < 0 else code  # a signal death reads like a shell's 128+N
        return RawExecResult(
            exit_code=exit_code, stdout=out.getvalue(), stderr=err.getvalue(), stdout_truncated=out.truncated,
            stderr_truncated=err.truncated, timed_out=timed_out, duration_s=loop.time() - started,
        )

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap and its pid-namespace init; the rest follow
        except ProcessLookupError:
            pass

    async def _close(self) -> None:
        for proc in list(self._procs):
            self._kill(proc)
        if self.root is not None:
            await asyncio.to_thread(shutil.rmtree, self.root, True)
