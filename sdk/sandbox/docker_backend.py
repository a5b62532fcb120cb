"""Docker backend: one container per sandbox, locked down, driven through the docker SDK.

Containers run with `--network none`, CPU/memory/pids limits, `no-new-privileges`, every
capability dropped but the three the command server needs (CAP_SETUID, CAP_SETGID,
CAP_KILL), the runc or gVisor (`runsc`) runtime, Docker's init, no log driver, and labels
naming the owning run and process (see `agentrl.sandbox.gc`). The main process is
`sandboxd` (`sandboxd.py`), a command server running as root that the host talks to over
the container's attach socket (`docker_server.py`); every command drops to the sandbox
user (`SandboxConfig.user`, else the image's user) and, as root, to no capabilities, so
nothing a command starts can read or write the server's channel. A command costs a fork
inside the sandbox instead of a runc exec. Without python3 in the image, or once the
server is gone, commands fall back to `docker exec` (`docker_exec.py`) as the sandbox user.

agentrl's seccomp profile (`seccomp.py`: Docker's default refusals, ptrace's too) refuses new user namespaces
to processes without CAP_SYS_ADMIN; gVisor applies it only when runsc runs with `--oci-seccomp`
(scripts/start-dockerd.sh registers it so), otherwise the missing filter is reported per
`unenforceable_limits`.

The disk limit uses `--storage-opt size=` where the engine supports it (overlay2 on xfs
with pquota, devicemapper, btrfs, zfs); elsewhere the root filesystem is read-only and the
working directory plus `writable_paths` are size-limited tmpfs mounts (executable,
nosuid, nodev), the working directory seeded with the image's content there.

What the backend reads from the image first (its user, a user name as uid:gid for the tmpfs
owners, the working directory's content) is in `docker_image.py`; the shared client, thread
pool, engine probes and the removal of leftover containers are in `docker_engine.py`.
"""
from __future__ import annotations

import asyncio
import base64
import os
import time

from agentrl.errors import NotFoundError, ProcessesSurvived, require
from agentrl.sandbox.base import (
    BASE_IMAGE,
    RawExecResult,
    Sandbox,
    SandboxConfig,
    SandboxError,
    limit_not_enforced,
    network_not_available,
)
from agentrl.sandbox.docker_engine import (
    docker_client,
    in_thread,
    live_containers,
    mark_storage_opt_unsupported,
    network_unavailable,
    runsc_applies_seccomp,
    startup_gc,
    storage_opt_supported,
)
from agentrl.sandbox.docker_exec import (
    HARD_DEADLINE_GRACE_S,
    exec_via_docker,
    kill_all_via_docker,
    kill_exec_processes,
)
from agentrl.sandbox.docker_image import image_user, numeric_user, workdir_seed
from agentrl.sandbox.docker_server import SERVER_MAX_OUTPUT_BYTES, ServerConnection, server_command
from agentrl.sandbox.gvisor_compat import SHIM_TARGET, statx_shim
from agentrl.sandbox.labels import sandbox_labels
from agentrl.sandbox.sandboxd import USER_VARIABLE
from agentrl.sandbox.seccomp import profile_json

# docker_client, in_thread, network_unavailable and storage_opt_supported live in docker_engine;
# they are re-exported here, where hub/ and the sandbox tools import them from.
__all__ = ["DockerSandbox", "docker_client", "in_thread", "network_unavailable", "storage_opt_supported"]

# gVisor's own host threads count against the container's pids limit: the Sentry's, the
# gofer's and, on the ptrace platform (Debian's runsc), a stub process per guest process with a
# stub thread for each Sentry thread that ran it. Five guest processes already took 170 host
# pids here; when a stub cannot be created the Sentry panics ("error initializing first thread:
# resource temporarily unavailable") and the whole sandbox dies with exit code 2. So runsc gets
# twice the limit plus this headroom. A fork bomb past it still kills the whole gVisor sandbox
# (instead of failing fork()), which stops it.
RUNSC_PIDS_HEADROOM = 384
SERVER_MAX_STDIN_BYTES = 8 * 1024 * 1024
SERVER_CAPABILITIES = ["SETUID", "SETGID", "KILL"]  # sandboxd's, never a command's


def _explain(error) -> str:
    return str(getattr(error, "explanation", None) or error).split("\n")[0][:300]


class DockerSandbox(Sandbox):
    """A sandbox in a Docker container (runc or gVisor)."""

    backend = "docker"

    def __init__(self, config: SandboxConfig) -> None:
        super().__init__(config)
        self.client = None
        self.disk_mode = "none"
        self._server: ServerConnection | None = None
        self.command_user = config.user or "0"
        """Who commands run as: `config.user`, else the image's user, else root."""
        self._default_env: dict[str, str] = {}
        self.server_execs = 0
        """Commands answered by the in-container server (the rest went through docker exec)."""

    # --- creation ------------------------------------------------------------------
    def _disk_mode(self) -> str:
        mode = self.config.disk_limit
        if mode == "auto":
            mode = "storage-opt" if storage_opt_supported(self.client) else "tmpfs"
        return mode

    def _tmpfs_paths(self) -> list[str]:
        paths = [self.config.workdir, *self.config.writable_paths]
        return list(dict.fromkeys(p.rstrip("/") or "/" for p in paths))

    def _create_args(self) -> tuple[dict, dict]:
        """(create_container kwargs, host config kwargs) for this sandbox."""
        cfg = self.config
        host: dict = {
            "init": True,
            "network_mode": cfg.docker_network or ("bridge" if cfg.network and not self.network_note
                                                 else "none"),
            "nano_cpus": int(cfg.cpus * 1e9),
            "mem_limit": f"{cfg.memory_mb}m",
            "memswap_limit": f"{cfg.memory_mb}m",
            "pids_limit": 2 * cfg.pids_limit + RUNSC_PIDS_HEADROOM if cfg.runtime == "runsc" else cfg.pids_limit,
            # Docker's refusals plus ptrace and cross-process memory (seccomp.py; gVisor refuses those itself, and
            # takes the profile without its clone3 rule, under which no thread starts there)
            "security_opt": ["no-new-privileges", f"seccomp={profile_json(gvisor=cfg.runtime == 'runsc')}"],
            "cap_drop": ["ALL"],
            "cap_add": SERVER_CAPABILITIES,
            "runtime": cfg.runtime,
        }
        if self.disk_mode == "storage-opt":
            host["storage_opt"] = {"size": f"{cfg.disk_mb}M"}
        elif self.disk_mode == "tmpfs":
            owner_user = numeric_user(self.client, cfg.image, self.command_user, owner=self.owner)
            uid, _, gid = owner_user.partition(":")
            gid = gid or uid
            owned = f",uid={uid},gid={gid}" if uid.isdigit() and gid.isdigit() else ""
            host["read_only"] = True
            host["tmpfs"] = {  # Docker's tmpfs default is noexec: a task's own scripts must run
                path: f"size={cfg.disk_mb}m,exec,nosuid,nodev,mode=" + ("1777" if path == "/tmp" else f"0755{owned}")
                for path in self._tmpfs_paths()
            }
            if "/home/agent" in self._tmpfs_paths() and "HOME" not in cfg.env:
                self._default_env["HOME"] = "/home/agent"  # writable even when the image lacks the user
        host["log_config"] = {"Type": "none", "Config": {}}  # commands' output is not kept on the host's disk
        environment = {**cfg.env, USER_VARIABLE: self.command_user}
        if cfg.runtime == "runsc":
            shim = statx_shim()
            if shim is not None:  # see gvisor_compat: makes ls/stat work under Debian's gVisor
                host["binds"] = {str(shim): {"bind": SHIM_TARGET, "mode": "ro"}}
                environment.setdefault("LD_PRELOAD", SHIM_TARGET)
        create = {
            "image": cfg.image,
            "command": server_command(),
            "user": "0:0",  # sandboxd; commands drop to command_user
            "stdin_open": True,
            "hostname": "sandbox",
            "labels": sandbox_labels(owner=self.owner, backend="docker"),
            "working_dir": cfg.workdir,
            "environment": environment,
        }
        return create, host

    def _limits(self) -> str:
        cfg = self.config
        return (
            f"image={cfg.image}, runtime={cfg.runtime}, cpus={cfg.cpus}, memory_mb={cfg.memory_mb}, "
            f"pids_limit={cfg.pids_limit}, disk_mb={cfg.disk_mb} ({self.disk_mode})"
        )

    def _start_blocking(self) -> None:
        docker = require("docker", "cpu")
        self.client = docker_client()
        api = self.client.api
        startup_gc(self.client)
        if self.config.runtime == "runsc" and not runsc_applies_seccomp(self.client):
            limit_not_enforced(self.config, "user namespaces (gVisor)",
                               "runsc is registered without --oci-seccomp, so Docker's seccomp profile is not applied; "
                               "add it to the runtimeArgs in /etc/docker/daemon.json")
        if self.config.user is None:
            self.command_user = image_user(self.client, self.config.image) or "0"
        self.disk_mode = self._disk_mode()
        if self.config.network and self.config.docker_network is None:
            why = network_unavailable(self.client, self.config.runtime)
            if why is not None:
                self.network_note = network_not_available(self.config, why)
        create, host = self._create_args()
        try:
            if self.config.docker_network:
                endpoint = api.create_endpoint_config(aliases=[self.config.network_alias])
                network = {self.config.docker_network: endpoint}
                create["networking_config"] = api.create_networking_config(network)
            self.id = api.create_container(host_config=api.create_host_config(**host), **create)["Id"]
            live_containers.add(self.id)
        except docker.errors.ImageNotFound:
            fix = ("build it: agentrl sandbox build-base" if self.config.image == BASE_IMAGE else
                   "build it (`agentrl env check ENV` names the command, `agentrl env build PKG` builds a "
                   "package's Dockerfile) or docker pull/load it")
            raise NotFoundError(
                f"sandbox image {self.config.image!r} is not in the local Docker engine; {fix}") from None
        except docker.errors.APIError as error:
            text = _explain(error)
            if "storage-opt" in text and self.config.disk_limit == "auto":
                mark_storage_opt_unsupported()
                return self._start_blocking()
            if "runtime" in text:
                raise SandboxError(
                    f"sandbox runtime {self.config.runtime!r} is not registered with dockerd ({text}); "
                    "register runsc in /etc/docker/daemon.json (scripts/start-dockerd.sh does) or use runtime='runc'"
                ) from None
            raise SandboxError(f"the Docker engine refused the sandbox ({self._limits()}): {text}") from None
        seed = None
        if self.disk_mode == "tmpfs":
            seed = workdir_seed(self.client, self.id, image=self.config.image, workdir=self.config.workdir)
        self._server = ServerConnection(api, self.id)
        try:
            self._server.attach()
        except docker.errors.APIError:
            self._server = None  # commands go through docker exec
        try:
            api.start(self.id)
        except docker.errors.APIError as error:
            raise SandboxError(
                f"the Docker engine could not start the sandbox ({self._limits()}): {_explain(error)}"
            ) from None
        if seed is not None:
            result = self._exec_blocking(
                ["tar", "-x", "-C", self.config.workdir, "-f", "-"], timeout=self.config.startup_timeout_s,
                cwd="/", env={}, stdin=seed, max_output=65536,
            )
            if result.exit_code != 0:
                raise SandboxError(
                    f"sandbox: copying the image's {self.config.workdir} failed: {result.stderr.decode()[:200]}"
                )

    async def _start(self) -> None:
        try:
            await asyncio.wait_for(in_thread(self._start_blocking), timeout=self.config.startup_timeout_s)
        except TimeoutError:
            raise SandboxError(
                f"sandbox did not start within startup_timeout_s={self.config.startup_timeout_s} ({self._limits()})"
            ) from None

    # --- exec ----------------------------------------------------------------------
    def _exec_blocking(
        self, argv: list[str], *, timeout: float, cwd: str, env: dict[str, str], stdin: bytes | None,
        max_output: int,
    ) -> RawExecResult:
        server = self._server
        env = {**self._default_env, **env}
        # Large stdin or output (uploads, image seeds, big reads) streams through docker exec
        # instead of travelling as one JSON line.
        if (server is not None and server.alive and max_output <= SERVER_MAX_OUTPUT_BYTES
                and (stdin is None or len(stdin) <= SERVER_MAX_STDIN_BYTES)):
            # No need to wait for the server's hello: requests queue on its stdin meanwhile.
            result = self._exec_via_server(server, argv, timeout=timeout, cwd=cwd, env=env, stdin=stdin,
                                           max_output=max_output)
            if result is not None:
                return result
        return self._exec_via_docker(argv, timeout=timeout, cwd=cwd, env=env, stdin=stdin, max_output=max_output)

    def _exec_via_server(
        self, server: ServerConnection, argv: list[str], *, timeout: float, cwd: str, env: dict[str, str],
        stdin: bytes | None, max_output: int,
    ) -> RawExecResult | None:
        """Run through sandboxd; None when it turned out never to have served (fall back)."""
        marker = os.urandom(8).hex()
        answer = server.request(argv=argv, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output,
                                marker=marker, wait=timeout + HARD_DEADLINE_GRACE_S + 2.0)
        if answer is None and not server.hello.is_set() and not server.alive:
            self._server = None  # it never served (no python3 in the image): nothing ran, use docker exec
            return None
        if answer is None and server.tampered:
            self._server = None
            return RawExecResult(exit_code=-1, stdout=b"", stderr=(
                b"sandbox command channel received an answer nobody asked for; the command server is no longer "
                b"used (commands go through docker exec)\n"))
        if answer is None:
            for _ in range(10 if not server.alive else 1):  # dockerd may lag behind a crashed sandbox
                dead = self._why_dead()
                if dead:
                    raise SandboxError(f"sandbox {self.id[:12]}: {dead}")
                time.sleep(0.2)
            self._kill_exec_processes(marker)
            if server.alive:  # it did not answer in time: treat as a timeout
                return RawExecResult(exit_code=137, stdout=b"", stderr=b"", timed_out=True)
            self._server = None  # the server is gone (killed from inside): docker exec from now on
            return RawExecResult(
                exit_code=-1, stdout=b"", stderr=b"sandbox command server stopped during the command\n"
            )
        if "error" in answer:
            return RawExecResult(exit_code=126, stdout=b"", stderr=base64.b64decode(answer["error"]) + b"\n")
        self.server_execs += 1
        out, err = base64.b64decode(answer["stdout"]), base64.b64decode(answer["stderr"])
        return RawExecResult(
            exit_code=int(answer["exit_code"]), stdout=out, stderr=err,
            stdout_truncated=answer["stdout_total"] > len(out), stderr_truncated=answer["stderr_total"] > len(err),
            timed_out=bool(answer["timed_out"]),
        )

    def _exec_via_docker(
        self, argv: list[str], *, timeout: float, cwd: str, env: dict[str, str], stdin: bytes | None,
        max_output: int,
    ) -> RawExecResult:
        return exec_via_docker(
            self.client.api, self.id, user=self.command_user, argv=argv, timeout=timeout, cwd=cwd, env=env,
            stdin=stdin, max_output=max_output, why_dead=self._why_dead,
        )

    def _kill_exec_processes(self, marker: str) -> None:
        kill_exec_processes(self.client.api, self.id, user=self.command_user, marker=marker)

    def _kill_processes_blocking(self, within_s: float) -> None:
        server = self._server
        # A server still starting must be waited for: docker exec's kill-all would kill it too (it is the
        # launcher's child), and the next command, sent to it, would find it gone.
        if server is not None and server.alive and server.wait_ready(self.config.startup_timeout_s):
            answer = server.kill_all(wait=within_s + 20.0, within_s=within_s)
            if answer is not None and "killed" in answer:
                if answer.get("survivors"):
                    raise ProcessesSurvived(
                        f"sandbox {self.id[:12]}: {answer['survivors']} processes still ran after {within_s:g} s of "
                        "SIGKILL (forks outpacing the kill); nothing may be graded beside them",
                        count=int(answer["survivors"]))
                return
        kill_all_via_docker(self.client.api, self.id)

    async def kill_processes(self, *, within_s: float = 10.0) -> None:
        """Kill every process but the container's init, its launcher and the command server; `ProcessesSurvived`
        when some still run after `within_s` of trying."""
        await in_thread(self._kill_processes_blocking, within_s)

    async def _run(
        self, argv: list[str], *, timeout: float, cwd: str, env: dict[str, str], stdin: bytes | None,
        max_output: int,
    ) -> RawExecResult:
        docker = require("docker", "cpu")
        try:
            return await in_thread(
                self._exec_blocking, argv, timeout=timeout, cwd=cwd, env=env, stdin=stdin, max_output=max_output
            )
        except docker.errors.APIError as error:
            why = await in_thread(self._why_dead)
            raise SandboxError(f"sandbox {self.id[:12]}: {why or 'exec failed: ' + _explain(error)}") from None

    def _why_dead(self) -> str | None:
        """Why the container cannot run commands any more, or None when it still runs."""
        docker = require("docker", "cpu")
        try:
            state = self.client.api.inspect_container(self.id)["State"]
        except docker.errors.NotFound:
            return "the container was removed"
        if state.get("Running"):
            return None
        return f"the container stopped (exit code {state.get('ExitCode')}, OOM killed: {state.get('OOMKilled')})"

    # --- teardown ------------------------------------------------------------------
    def _close_blocking(self) -> None:
        docker = require("docker", "cpu")
        if self._server is not None:
            self._server.close()
        if not self.id or self.client is None:
            return
        live_containers.discard(self.id)
        try:
            self.client.api.remove_container(self.id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as error:
            if error.status_code != 409:  # 409: another process (a gc) is already removing it
                raise

    async def _close(self) -> None:
        # Shielded: a cancelled rollout must still remove its container.
        await asyncio.shield(in_thread(self._close_blocking))

