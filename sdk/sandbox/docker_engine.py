"""This process's link to the Docker engine: shared client, thread pool, engine probes, leftovers.

Every Docker sandbox of a process shares one docker SDK client (`docker_client`, a one-line
error naming bubblewrap when no engine answers) and one thread pool for the SDK's blocking
calls (`in_thread`, large enough for 64+ sandboxes). What the engine can do is asked once
and cached: whether `--storage-opt size=` works (`storage_opt_supported`), whether runsc
loads the OCI seccomp profile (`runsc_applies_seccomp`), and why a runtime's sandboxes get
no network (`network_unavailable`). The containers this process created are tracked in
`live_containers` and removed at interpreter exit when never closed; containers of dead
processes are removed once, at the first sandbox start (`startup_gc`; `labelled_containers` and
`remove_orphan_containers` serve `agentrl.sandbox.gc` too).
"""
from __future__ import annotations

import asyncio
import atexit
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

from agentrl.errors import require
from agentrl.sandbox.base import SandboxError
from agentrl.sandbox.labels import MARKER, owner_alive

__all__ = [
    "docker_client", "in_thread", "labelled_containers", "live_containers", "mark_storage_opt_unsupported",
    "network_unavailable", "remove_container", "remove_orphan_containers", "runsc_applies_seccomp", "startup_gc",
    "storage_opt_supported",
]

_EXECUTOR = ThreadPoolExecutor(max_workers=256, thread_name_prefix="agentrl-sandbox")
_client_lock = threading.Lock()
_client = None
_storage_opt: bool | None = None
_runsc_seccomp: bool | None = None
_startup_gc_done = False
live_containers: set[str] = set()
"""Containers this process created and has not removed yet."""


async def in_thread(fn, /, *args, **kwargs):
    """Run a blocking docker call on the sandbox thread pool (large enough for 64+ sandboxes)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_EXECUTOR, functools.partial(fn, *args, **kwargs))


def docker_client():
    """A shared docker SDK client, or a one-line error when no engine answers."""
    global _client
    with _client_lock:
        if _client is not None:
            return _client
        docker = require("docker", "cpu")
        try:
            client = docker.from_env(timeout=120, max_pool_size=256)
            _one_connection_pool(client)
            client.ping()
        except Exception as error:  # docker raises DockerException/ConnectionError variants
            reason = str(error).split("\n")[0][:160]
            raise SandboxError(
                f"sandbox type 'docker': no Docker engine answers ({reason}); start dockerd "
                "(scripts/start-dockerd.sh) or set sandbox type = 'bwrap' to use bubblewrap"
            ) from None
        _client = client
        return client


def _one_connection_pool(client) -> None:
    """Send every request of `client` over one unix-socket connection pool. docker-py (7.1) keys its pools by
    request URL and keeps 25, closing the least recently used: with dozens of sandboxes at once, a pool another
    thread had just taken was closed under it ("UnixHTTPConnectionPool(...): Pool is closed.", one rollout of an
    eval lost, 2026-12-07). Every URL reaches the same socket, so one pool of `max_pool_size` serves them all.
    Engines reached over TCP or SSH keep docker-py's own pooling."""
    from docker.transport import UnixHTTPAdapter

    adapter = client.api.adapters.get("http+docker://")
    if isinstance(adapter, UnixHTTPAdapter):
        by_url = adapter.get_connection
        adapter.get_connection = lambda url, proxies=None: by_url("http+docker://localhost", proxies)


def storage_opt_supported(client) -> bool:
    """Whether `--storage-opt size=` works on this engine (it needs xfs+pquota on overlay2)."""
    global _storage_opt
    if _storage_opt is None:
        info = client.info()
        driver = info.get("Driver", "")
        backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem", "")
        _storage_opt = driver in ("devicemapper", "btrfs", "zfs") or (driver == "overlay2" and backing == "xfs")
    return _storage_opt


def mark_storage_opt_unsupported() -> None:
    """The engine refused `--storage-opt`: `storage_opt_supported` answers False from now on."""
    global _storage_opt
    _storage_opt = False


def runsc_applies_seccomp(client) -> bool:
    """Whether the engine's runsc runtime loads the OCI seccomp profile (`--oci-seccomp`)."""
    global _runsc_seccomp
    if _runsc_seccomp is None:
        runtime = (client.info().get("Runtimes") or {}).get("runsc") or {}
        _runsc_seccomp = "--oci-seccomp" in (runtime.get("runtimeArgs") or [])
    return _runsc_seccomp


def network_unavailable(client, runtime: str) -> str | None:
    """Why `runtime`'s sandboxes on this engine get no network even when asked (None: they get the bridge)."""
    docker = require("docker", "cpu")
    if runtime == "runsc":
        args = ((client.info().get("Runtimes") or {}).get("runsc") or {}).get("runtimeArgs") or []
        if "--network=none" in args:
            return "the engine registers runsc with --network=none"
    try:
        client.api.inspect_network("bridge")
    except docker.errors.NotFound:
        return "the Docker engine has no 'bridge' network: dockerd runs with --bridge=none"
    return None


@atexit.register
def _remove_leftovers() -> None:
    """At interpreter exit, remove sandboxes that were never closed (a crash is left to gc)."""
    if not live_containers or _client is None:
        return
    for container_id in list(live_containers):
        try:
            _client.api.remove_container(container_id, force=True, v=True)
        except Exception:  # already gone, or the engine went away first
            pass
    live_containers.clear()


def startup_gc(client) -> None:
    """Once per process: remove labelled containers whose owning process is dead."""
    global _startup_gc_done
    if _startup_gc_done:
        return
    _startup_gc_done = True
    try:
        remove_orphan_containers(client)
    except Exception:  # best effort: never block a sandbox on garbage collection
        pass


def labelled_containers(client) -> list:
    """Every container with agentrl's sandbox label (running or not)."""
    return client.containers.list(all=True, filters={"label": f"{MARKER}=1"})


def remove_container(client, container_id: str) -> bool:
    """Force-remove a container; False when it was already gone or another process is removing it."""
    import docker.errors

    try:
        client.api.remove_container(container_id, force=True, v=True)
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as error:
        if "already in progress" in str(error) or error.status_code == 409:
            return False
        raise
    return True


def remove_orphan_containers(client, *, owner: str | None = None, everything: bool = False) -> list[str]:
    """Remove labelled containers whose owner died (or of `owner`, or all); returns their ids."""
    removed = []
    for container in labelled_containers(client):
        labels = container.labels or {}
        if everything or (owner is not None and labels.get("agentrl.owner") == owner) or (
            owner is None and not owner_alive(labels)
        ):
            if not remove_container(client, container.id):
                continue
            removed.append(container.id[:12])
    return removed
