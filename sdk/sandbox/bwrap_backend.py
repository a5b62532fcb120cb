"""Bubblewrap backend, for machines without a Docker engine.

Each command is one `bwrap` process: new user, network, pid, ipc, uts, cgroup and mount
namespaces over the read-only base rootfs (the debootstrap tree of `agentrl-base`), with a
writable workspace, /tmp, home and /dev/shm that persist between commands (processes do
not: each command's pid namespace dies with it). bwrap runs as a host uid of its own (one
per sandbox) and starts with an environment of PATH alone; the command's variables are
set by bwrap (`--clearenv`, `--setenv`), so no process inside sees the host's.

How each limit holds for the sandbox as a whole:

- memory_mb and pids_limit: a cgroup per sandbox (`cgroups.py`: v2, else v1 memory + pids,
  under this process's cgroup) that every command's bwrap joins between fork and exec, so
  the limits count all processes of all commands; memory has no swap beyond it, and a
  process that passes it is killed by the kernel's OOM killer. Without a writable cgroup
  (`unenforceable_limits` says whether to refuse or warn), RLIMIT_AS caps each process
  and RLIMIT_NPROC the sandbox's host uid instead.
- disk_mb: work, tmp, home, shm (and the other `writable_paths`, their mount points made in
  the cached rootfs trees where missing) are folders of one tmpfs of `disk_mb` MiB mounted on the
  host in the sandbox's folder (executable; nosuid, nodev), so the cap is their total. Its
  pages are memory and are charged to the sandbox's cgroup, so files count toward
  memory_mb as well. /dev itself is remounted read-only. If the tmpfs cannot be mounted,
  the folders are on the host disk and RLIMIT_FSIZE caps each file instead.
- user namespaces: `--disable-userns`, so nothing inside can make a nested user namespace
  (and be root in it); a bwrap older than 0.8.0 lacks it (refuse or warn).
- cpus: the cgroup's CPU quota (cpu.max on v2, cpu.cfs_quota_us on v1) caps all the sandbox's
  processes together at `cpus` cores; without a cpu controller `unenforceable_limits` refuses
  or warns. CPU time: RLIMIT_CPU of the command's timeout times `cpus`; no core dumps.
- Left behind: at the first bwrap start of a process, dead owners' workspaces (their
  processes, tmpfs, cgroup and folder) and cgroups are removed, as Docker's orphans are.

A timeout kills the outer bwrap, whose pid-namespace init takes every process of the
command with it; `kill_processes` and `close` also kill whatever the cgroup still holds.
Close kills, unmounts the tmpfs, removes the cgroup and then the folder.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from agentrl.sandbox import cgroups
from agentrl.sandbox.archive import remove_tree
from agentrl.sandbox.base import (
    BASE_IMAGE,
    CappedBuffer,
    RawExecResult,
    Sandbox,
    SandboxConfig,
    SandboxError,
    limit_not_enforced,
    network_not_available,
)
from agentrl.sandbox.base_image import cache_root, rootfs_dir
from agentrl.sandbox.bwrap_workspace import (
    BWRAP_ENV,
    DISK_DIR,
    cgroup_name,
    claim_host_uid,
    unmount,
    workspace_root,
)
from agentrl.sandbox.gc import collect_garbage
from agentrl.sandbox.labels import sandbox_labels

__all__ = ["BwrapSandbox"]
# Output past `max_output_bytes` is read and dropped on the host, outside the sandbox's CPU limit: `cat /dev/zero`
# took 8.5 s of the host's CPU in 10 s (red team, 2026-12-07). Past the cap each read (up to 64 KiB) is followed
# by this pause: the command, blocked on its full pipe, goes on at about 30 MB/s (200 MB of `seq` in 7.8 s instead
# of 0.8 s) and an endless one costs the host a few percent of a core.
_DRAIN_PAUSE_S = 0.002

HOST_UID_BASE = 200_000
HOST_UID_SPAN = 100_000
INNER_UID = 1000
WRITABLE_DIRS = ("work", "tmp", "home", "shm")


@functools.cache
def _bwrap_disables_userns(bwrap: str) -> bool:
    """Whether this bwrap has `--disable-userns` (bubblewrap 0.8.0 and newer)."""
    shown = subprocess.run([bwrap, "--help"], capture_output=True, text=True, env=BWRAP_ENV)
    return "--disable-userns" in shown.stdout + shown.stderr


def _mount_tmpfs(path: Path, *, size_mb: int) -> str | None:
    """Mount a tmpfs of `size_mb` MiB at `path`; None, or why it failed."""
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755,nosuid,nodev", "agentrl-bwrap", str(path)],
            capture_output=True, text=True, env=BWRAP_ENV, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"mount: {error}"
    if done.returncode != 0:
        return (done.stderr.strip() or f"mount exited with {done.returncode}").splitlines()[-1]
    return None


def _seed_workdir(source: Path, work: Path, uid: int) -> None:
    """Copy the image's workdir content into the sandbox's writable workdir, owned by the sandbox's host uid."""
    for command in (["cp", "-a", "--no-preserve=ownership", f"{source}/.", str(work)],
                    ["chown", "-R", "--no-dereference", f"{uid}:{uid}", str(work)]):
        done = subprocess.run(command, capture_output=True, text=True, env=BWRAP_ENV, timeout=300)
        if done.returncode != 0:
            raise SandboxError(f"bwrap: seeding the workdir from the image: {done.stderr.strip()[-200:]}")


_startup_gc_lock: asyncio.Lock | None = None
_startup_gc_done = False


async def _startup_gc() -> None:
    """Once per process, at the first bwrap start: remove dead owners' workspaces (processes, tmpfs, cgroup,
    folder) and cgroups, as the Docker backend removes dead owners' containers (best effort)."""
    global _startup_gc_done, _startup_gc_lock
    if _startup_gc_done:
        return
    _startup_gc_lock = _startup_gc_lock or asyncio.Lock()
    async with _startup_gc_lock:
        if _startup_gc_done:
            return
        _startup_gc_done = True
        try:
            await asyncio.to_thread(collect_garbage, docker=False, bwrap=True)
        except Exception:  # never block a sandbox on garbage collection
            pass


class BwrapSandbox(Sandbox):
    """A sandbox made of bubblewrap namespaces over a read-only rootfs."""

    backend = "bwrap"

    def __init__(self, config: SandboxConfig, *, cgroup_root: Path = cgroups.CGROUP_ROOT) -> None:
        super().__init__(config)
        self.cgroup_root = cgroup_root
        self.root: Path | None = None
        self.disk: Path | None = None
        self.bwrap = "bwrap"
        self.host_uid = 0
        self.cgroup: cgroups.Cgroup | None = None
        self.disk_mounted = False
        self.disable_userns = False
        self._procs: set[asyncio.subprocess.Process] = set()
        self.image_env: dict[str, str] = {}
        """The image's ENV (another image than the base): set under the sandbox's own variables."""

    async def _start(self) -> None:
        await _startup_gc()
        cfg = self.config
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxError("sandbox type 'bwrap': bubblewrap is not installed; run: apt-get install bubblewrap")
        self.bwrap = bwrap
        if cfg.network:  # bwrap's only network is the host's own namespace: its 127.0.0.1, its abstract sockets
            self.network_note = network_not_available(
                cfg, "bubblewrap has no network of its own, only the host's, with its 127.0.0.1 services")
        if cfg.rootfs or cfg.image == BASE_IMAGE:
            rootfs = Path(cfg.rootfs) if cfg.rootfs else rootfs_dir()
        else:  # another local Docker image: its exported tree, ENV and workdir content
            from agentrl.sandbox.image_rootfs import image_rootfs

            exported = await asyncio.to_thread(image_rootfs, cfg.image)
            rootfs, self.image_env = exported.path, exported.env
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
        self.host_uid = await asyncio.to_thread(claim_host_uid, self.root,
                                                sandbox_labels(owner=self.owner, backend="bwrap"),
                                                base=HOST_UID_BASE, span=HOST_UID_SPAN)

        self.disable_userns = await asyncio.to_thread(_bwrap_disables_userns, bwrap)
        if not self.disable_userns:
            limit_not_enforced(cfg, "user namespaces", f"{bwrap} lacks --disable-userns; bubblewrap 0.8.0 has it")
        try:
            self.cgroup = await asyncio.to_thread(
                cgroups.create, cgroup_name(self.id), memory_bytes=cfg.memory_mb * 1024 * 1024,
                pids=cfg.pids_limit, cpus=cfg.cpus, root=self.cgroup_root)
        except cgroups.CgroupUnavailable as error:
            limit_not_enforced(cfg, "memory_mb and pids_limit", str(error))
        if self.cgroup is None or not self.cgroup.cpu_limited:
            limit_not_enforced(cfg, "cpus", self.cgroup.cpu_unavailable if self.cgroup else "no cgroup")
        self.disk = self.root / DISK_DIR
        self.disk.mkdir(mode=0o755)
        failed = await asyncio.to_thread(_mount_tmpfs, self.disk, size_mb=cfg.disk_mb)
        if failed:
            limit_not_enforced(cfg, "disk_mb", f"no tmpfs for the sandbox's files: {failed}")
        else:
            self.disk_mounted = True
        for name in WRITABLE_DIRS:
            (self.disk / name).mkdir()
            os.chown(self.disk / name, self.host_uid, self.host_uid)
        for index, path in enumerate(self._extra_writable()):
            (self.disk / f"extra{index}").mkdir()
            os.chown(self.disk / f"extra{index}", self.host_uid, self.host_uid)
            point = self.rootfs / path.lstrip("/")
            if not point.is_dir() and self.rootfs.is_relative_to(cache_root()):  # a mount point in our own tree
                point.mkdir(parents=True, exist_ok=True)
        seed = self.rootfs / cfg.workdir.lstrip("/")
        if cfg.workdir.strip("/") and not seed.is_dir() and not seed.is_symlink():
            # bwrap cannot make the workdir's mount point on the read-only root ("Can't mkdir /app: Read-only file
            # system" on every command): made in a tree exported here, else refused in one line
            inside = seed.parent.resolve().is_relative_to(self.rootfs.resolve())  # no parent link out of the tree
            if not self.rootfs.is_relative_to(cache_root()) or seed.exists() or not inside:
                raise SandboxError(f"sandbox type 'bwrap': workdir {cfg.workdir} is not a folder of the root "
                                   f"filesystem {self.rootfs}; create it in the image (WORKDIR {cfg.workdir}) or use "
                                   "sandbox type 'docker'")
            seed.mkdir(parents=True, exist_ok=True)
        if cfg.workdir.strip("/") and seed.is_dir() and not seed.is_symlink():  # the image's workdir content
            await asyncio.to_thread(_seed_workdir, seed, self.disk / "work", self.host_uid)

    def _extra_writable(self) -> list[str]:
        """`writable_paths` besides the workdir, /tmp and home: empty folders of the sandbox's tmpfs."""
        fixed = {"/tmp", "/home/agent", self.config.workdir.rstrip("/") or "/"}
        paths = [path.rstrip("/") for path in self.config.writable_paths]
        return [path for path in dict.fromkeys(paths) if path and path not in fixed]

    def _bwrap_argv(self, argv: list[str], *, cwd: str, env: dict[str, str]) -> list[str]:
        cfg = self.config
        assert self.disk is not None
        args = [
            self.bwrap, "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
            "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--hostname", "sandbox",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", str(self.rootfs), "/", "--dev", "/dev", "--proc", "/proc",
            "--bind", str(self.disk / "work"), cfg.workdir,
            "--bind", str(self.disk / "tmp"), "/tmp",
            "--bind", str(self.disk / "home"), "/home/agent",
            "--bind", str(self.disk / "shm"), "/dev/shm",
            "--remount-ro", "/dev",  # bwrap's /dev is a tmpfs of its own, writable and unlimited
        ]
        for index, path in enumerate(self._extra_writable()):
            if (self.rootfs / path.lstrip("/")).is_dir():
                args += ["--bind", str(self.disk / f"extra{index}"), path]
        args += ["--chdir", cwd, "--clearenv"]
        if self.disable_userns:
            args.insert(2, "--disable-userns")
        args.insert(1, "--unshare-net")  # always: see _start
        base_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/home/agent",
                    "LANG": "C.UTF-8", "USER": "agent"}
        for key, value in {**base_env, **self.image_env, **env}.items():
            args += ["--setenv", key, value]
        return [*args, "--", *argv]

    def _limits(self, timeout: float):
        cfg = self.config
        uid = self.host_uid
        cgroup = self.cgroup
        rlimits = [
            (resource.RLIMIT_CPU, int(timeout * max(cfg.cpus, 1.0)) + 2),
            (resource.RLIMIT_CORE, 0),
        ]
        if cgroup is None:  # the fallback: per process and per host uid
            rlimits += [(resource.RLIMIT_AS, cfg.memory_mb * 1024 * 1024), (resource.RLIMIT_NPROC, cfg.pids_limit)]
        if not self.disk_mounted:  # the fallback: per file
            rlimits.append((resource.RLIMIT_FSIZE, cfg.disk_mb * 1024 * 1024))

        def apply() -> None:  # runs in the child between fork and exec
            if cgroup is not None:
                cgroup.join(os.getpid())
            for which, value in rlimits:
                resource.setrlimit(which, (value, value))
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
                command = [self.bwrap, "--args", str(read_end), *full[split:]]
            os.close(write_end)
            write_end = -1
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=BWRAP_ENV,
                preexec_fn=self._limits(timeout), start_new_session=True, pass_fds=(read_end,),
            )
        except subprocess.SubprocessError as error:
            raise SandboxError(f"bwrap sandbox {self.id}: cannot start the command ({error})") from None
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        self._procs.add(proc)
        out, err = CappedBuffer(max_output), CappedBuffer(max_output)

        async def pump(stream: asyncio.StreamReader, buffer: CappedBuffer) -> None:
            while chunk := await stream.read(65536):
                buffer.write(chunk)
                if buffer.truncated:  # past the cap the bytes are dropped here, on the host's CPU: at most
                    await asyncio.sleep(_DRAIN_PAUSE_S)  # 64 KiB a pause, the command waits on its full pipe

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

    async def _kill_everything(self) -> None:
        """SIGKILL every command still running and every process in the cgroup; wait until they are gone."""
        procs = list(self._procs)
        for proc in procs:
            self._kill(proc)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill_all)
        if procs:
            await asyncio.wait([asyncio.ensure_future(proc.wait()) for proc in procs], timeout=10)

    async def kill_processes(self) -> None:
        """Kill every process in the sandbox (normally none is left: a command's processes end with it).

        A command still running is killed too and returns as killed by SIGKILL; the sandbox stays usable.
        """
        if self.closed:
            raise SandboxError(f"sandbox {self.id or '?'} is closed")
        await self._kill_everything()

    async def _close(self) -> None:
        problems = []
        try:
            await self._kill_everything()
        except SandboxError as error:
            problems.append(str(error))
        if self.disk is not None and self.disk_mounted:
            try:
                await asyncio.to_thread(unmount, self.disk)
            except SandboxError as error:
                problems.append(str(error))
        if self.cgroup is not None:
            try:
                await asyncio.to_thread(self.cgroup.remove)
            except SandboxError as error:
                problems.append(str(error))
        if self.root is not None:
            if self.disk is not None and os.path.ismount(self.disk):
                problems.append(f"left {self.root} in place: its tmpfs is still mounted")
            else:
                try:
                    await asyncio.to_thread(remove_tree, self.root)
                except OSError as error:
                    problems.append(f"removing {self.root}: {error}")
        if problems:
            raise SandboxError(f"closing bwrap sandbox {self.id}: {'; '.join(problems)}")
