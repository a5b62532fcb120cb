"""Harbor docker-compose tasks: the task's extra services as containers on an internal network with the agent.

Harbor runs `environment/docker-compose.yaml` merged over its own `main` service (the agent's
container). agentrl reads the file (`read_compose`), keeps the agent in its own locked-down
sandbox as `main` (`SandboxConfig.docker_network`), and starts every other service as a container
on one internal Docker network of the trial (`ComposeServices`): no route out, the service name
as its DNS name, the task's cpu/memory limits, `no-new-privileges`, the sandbox's runtime, agentrl
labels (the sandbox gc removes what a crash leaves). The verifier's fresh sandbox joins the same
network: what the agent did to the services is what the verifier sees, as in Harbor.

What a service may say is checked key by key: `image`, `build`, `command`, `entrypoint`,
`environment`, `working_dir`, `user`, `expose`, `depends_on` (start order), `healthcheck`
(waited for), `restart` and `container_name` (ignored); anything else (host `ports` or `volumes`,
`privileged`, capabilities, devices, other networks) is refused in one line naming it. gVisor as
registered here (`runsc --network=none`) has no container networking: compose trials are refused
under it in one line.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from pydantic import Field

from agentrl.config import BaseConfig
from agentrl.errors import ConfigError, SandboxError

__all__ = ["ComposeService", "ComposeServices", "read_compose", "service_image", "COMPOSE_FILES"]

COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
MAIN = "main"
_SERVICE_KEYS = {"image", "build", "command", "entrypoint", "environment", "working_dir", "user", "expose",
                 "depends_on", "healthcheck", "restart", "container_name"}
_MAIN_KEYS = {"build", "image", "environment", "depends_on", "command", "working_dir"}
HEALTHY_WAIT_S = 120.0


class ComposeService(BaseConfig):
    """One service of a task's docker-compose.yaml other than `main`."""

    name: str
    """The service name (its DNS name on the trial's network)."""
    image: str | None = None
    """Image to run (or the tag its `build` is built as)."""
    build_context: str | None = None
    """Build context relative to the task's environment/ folder."""
    dockerfile: str = "Dockerfile"
    """Dockerfile within the build context."""
    command: list[str] | str | None = None
    """The container's command."""
    entrypoint: list[str] | str | None = None
    """The container's entrypoint."""
    environment: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the service."""
    working_dir: str | None = None
    """Working directory of the service."""
    user: str | None = None
    """User the service runs as."""
    depends_on: list[str] = Field(default_factory=list)
    """Services started before this one."""
    healthcheck: dict[str, Any] | None = None
    """Docker healthcheck (`test`, `interval`, ...); the trial waits until it is healthy."""


def _environment(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, list):
        pairs = [str(item).partition("=") for item in value]
        return {key: val for key, _, val in pairs}
    if isinstance(value, dict):
        return {str(k): "" if v is None else str(v) for k, v in value.items()}
    raise ConfigError(f"{where}.environment must be a list or a mapping")


def _duration_ns(value: Any) -> int:
    """Compose durations ('1s', '500ms', '1m30s') in nanoseconds."""
    import re

    if isinstance(value, (int, float)):
        return int(value * 1e9)
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|us|s|m|h)", str(value)):
        total += float(number) * {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}[unit]
    return int(total * 1e9)


def read_compose(path: Path) -> tuple[list[ComposeService], dict[str, str]]:
    """The services other than `main` (in start order) and `main`'s extra environment; one-line errors."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: malformed YAML: {str(error).splitlines()[0]}") from None
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict):
        raise ConfigError(f"{path}: no services: mapping")
    for key in data:
        if key not in ("services", "version", "name"):
            raise ConfigError(f"{path}: top-level {key!r} cannot be run by agentrl (only services)")
    main_env: dict[str, str] = {}
    found: dict[str, ComposeService] = {}
    for name, spec in services.items():
        where = f"{path}: services.{name}"
        spec = spec or {}
        if not isinstance(spec, dict):
            raise ConfigError(f"{where} must be a mapping")
        allowed = _MAIN_KEYS if name == MAIN else _SERVICE_KEYS
        for key in spec:
            if key not in allowed:
                raise ConfigError(f"{where}.{key} cannot be run by agentrl (its services may use "
                                  f"{', '.join(sorted(allowed))})")
        if name == MAIN:
            main_env = _environment(spec.get("environment"), where)
            continue
        build = spec.get("build")
        context, dockerfile = (build, "Dockerfile") if isinstance(build, str) else \
            ((build or {}).get("context"), (build or {}).get("dockerfile", "Dockerfile"))
        if not spec.get("image") and context is None:
            raise ConfigError(f"{where} has neither image nor build")
        depends = spec.get("depends_on") or []
        found[name] = ComposeService(
            name=name, image=spec.get("image"), build_context=context, dockerfile=dockerfile,
            command=spec.get("command"), entrypoint=spec.get("entrypoint"),
            environment=_environment(spec.get("environment"), where), working_dir=spec.get("working_dir"),
            user=None if spec.get("user") is None else str(spec["user"]),
            depends_on=[d for d in (depends if isinstance(depends, list) else list(depends)) if d != MAIN],
            healthcheck=spec.get("healthcheck"),
        )
    ordered: list[ComposeService] = []

    def visit(name: str, trail: tuple[str, ...]) -> None:
        if name in trail:
            cycle = " -> ".join((*trail, name))
            raise ConfigError(f"{path}: services depend on each other in a cycle: {cycle}")
        if name not in found:
            raise ConfigError(f"{path}: depends_on names {name!r}, which is not a service")
        for dependency in found[name].depends_on:
            visit(dependency, (*trail, name))
        if found[name] not in ordered:
            ordered.append(found[name])

    for name in found:
        visit(name, ())
    return ordered, main_env


def service_image(task_image: str, service: ComposeService) -> str:
    """The image a service runs: its own `image` unless it is built, then `<task image repo>-<service>`."""
    if service.build_context is None:
        return service.image
    tagged = ":" in task_image.split("/")[-1]
    repository, _, tag = task_image.rpartition(":") if tagged else (task_image, "", "")
    return service.image or f"{repository}-{service.name.lower()}:{tag or 'latest'}"


class ComposeServices:
    """One trial's services: an internal network and a container per service; `close()` removes them."""

    def __init__(self, services: list[ComposeService], *, task_image: str, runtime: str, cpus: float,
                 memory_mb: int, owner: str | None = None) -> None:
        self.services = services
        self.task_image = task_image
        self.runtime = runtime
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.owner = owner
        self.network = f"agentrl-compose-{uuid.uuid4().hex[:12]}"
        """The trial's internal Docker network (the sandboxes join it as `main`)."""
        self._containers: list[str] = []
        self._network_id: str | None = None

    def _start_blocking(self) -> None:
        from agentrl.sandbox.base import default_owner
        from agentrl.sandbox.docker_backend import docker_client, network_unavailable
        from agentrl.sandbox.labels import sandbox_labels

        client = docker_client()
        if self.runtime == "runsc" and network_unavailable(client, "runsc"):
            raise SandboxError("a docker-compose task needs container networking, and this engine registers "
                               "runsc with --network=none; run it with runtime='runc'")
        api = client.api
        labels = sandbox_labels(owner=self.owner or default_owner(), backend="docker")
        self._network_id = api.create_network(self.network, driver="bridge", internal=True,
                                              labels=labels)["Id"]
        for service in self.services:
            healthcheck = None
            if service.healthcheck:
                check = service.healthcheck
                test = check.get("test")
                healthcheck = {"test": test if isinstance(test, list) else ["CMD-SHELL", str(test)],
                               "interval": _duration_ns(check.get("interval", "1s")),
                               "timeout": _duration_ns(check.get("timeout", "30s")),
                               "retries": int(check.get("retries", 3)),
                               "start_period": _duration_ns(check.get("start_period", "0s"))}
            host = api.create_host_config(
                network_mode=self.network, nano_cpus=int(self.cpus * 1e9), mem_limit=f"{self.memory_mb}m",
                pids_limit=1024, security_opt=["no-new-privileges"], runtime=self.runtime, init=True,
                log_config={"Type": "none", "Config": {}},
            )
            networking = api.create_networking_config({self.network: api.create_endpoint_config(
                aliases=[service.name])})
            try:
                container = api.create_container(
                    image=service_image(self.task_image, service), command=service.command,
                    entrypoint=service.entrypoint, environment=service.environment,
                    working_dir=service.working_dir,
                    user=service.user, labels=labels, host_config=host, networking_config=networking,
                    hostname=service.name, healthcheck=healthcheck,
                )["Id"]
            except Exception as error:  # docker.errors: a missing image, a refused option
                reason = str(error).splitlines()[0][:300]
                raise SandboxError(f"compose service {service.name!r}: {reason}") from None
            self._containers.append(container)
            api.start(container)
            if healthcheck:
                self._wait_healthy(api, container, service.name)

    @staticmethod
    def _wait_healthy(api, container: str, name: str) -> None:
        import time

        deadline = time.monotonic() + HEALTHY_WAIT_S
        while time.monotonic() < deadline:
            state = api.inspect_container(container)["State"]
            status = (state.get("Health") or {}).get("Status")
            if status == "healthy":
                return
            if status == "unhealthy" or not state.get("Running"):
                break
            time.sleep(0.2)
        raise SandboxError(f"compose service {name!r} did not become healthy within {HEALTHY_WAIT_S:g} s")

    def _close_blocking(self) -> None:
        from agentrl.sandbox.docker_backend import docker_client

        api = docker_client().api
        for container in reversed(self._containers):
            try:
                api.remove_container(container, force=True, v=True)
            except Exception:  # already gone
                pass
        self._containers.clear()
        if self._network_id is not None:
            try:
                api.remove_network(self._network_id)
            except Exception:  # a sandbox still attached is removed by its own close; gc takes the rest
                pass
            self._network_id = None

    async def start(self) -> ComposeServices:
        from agentrl.sandbox.docker_backend import in_thread

        try:
            await in_thread(self._start_blocking)
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        from agentrl.sandbox.docker_backend import in_thread

        await asyncio.shield(in_thread(self._close_blocking))
