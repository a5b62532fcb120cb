"""Harbor's task.toml as agentrl reads it: each harbor 0.25 field (schema 1.0-1.4) mapped, warned or refused.

`read_harbor_task(folder)` parses a Harbor task folder into a `HarborTask`. Each field set
in task.toml falls in one of three classes (`agentrl.hub.interop.harbor_fields`):

- honoured: mapped onto the sandbox, the episode, the oracle or the verifier (see
  docs/ENVIRONMENTS.md, "Harbor tasks");
- warned: agentrl runs the task without it and says so in one line naming the field
  (`HarborTask.notes`), e.g. `artifacts` (agentrl keeps no trial folders);
- refused: the task cannot run as its author meant (a Windows container, GPUs, remote MCP
  servers, a verifier image of its own); a one-line `ConfigError` names the field.

A field harbor 0.25 does not know is warned as such, never dropped silently.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from agentrl.config import BaseConfig
from agentrl.errors import AgentrlError, ConfigError, NotFoundError
from agentrl.hub.interop.harbor_fields import check_fields
from agentrl.mcp_servers import McpServerSpec

__all__ = ["HarborTask", "HarborStep", "NetworkPolicy", "Healthcheck", "read_harbor_task", "resolve_env",
           "check_carry_paths",
           "SCHEMA_VERSIONS"]

SCHEMA_VERSIONS = ("1.0", "1.1", "1.2", "1.3", "1.4")
NetworkMode = Literal["public", "no-network", "allowlist"]

class NetworkPolicy(BaseConfig):
    """One phase's network policy, as Harbor declares it."""

    mode: NetworkMode = "public"
    """'public' (Harbor's default), 'no-network' or 'allowlist'."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Hosts reachable under 'allowlist'."""


class Healthcheck(BaseConfig):
    """Harbor's healthcheck (Docker HEALTHCHECK semantics), run after the sandbox starts."""

    command: str
    """Shell command; exit 0 means healthy."""
    interval_sec: float = 5.0
    """Seconds between attempts after the start period."""
    timeout_sec: float = 30.0
    """Limit of one attempt."""
    start_period_sec: float = 0.0
    """Grace period during which failures do not count."""
    start_interval_sec: float = 5.0
    """Seconds between attempts during the start period."""
    retries: int = 3
    """Consecutive failures (after the start period) that fail the trial."""


class HarborStep(BaseConfig):
    """One step of a trial: an instruction, its agent phase and its verifier (a single-step task has one)."""

    name: str
    """Step name (`steps/<name>/` holds its instruction, tests, solution, workdir)."""
    instruction: str
    """What the agent is asked to do in this step."""
    folder: str = ""
    """The step's folder relative to the task ('' for a single-step task)."""
    agent_timeout_s: float | None = Field(default=None, gt=0)
    """Total wall-clock budget of the agent in this step (None: unlimited)."""
    agent_user: str | None = None
    """User the agent's commands run as (None: the image's USER)."""
    agent_network: NetworkPolicy = NetworkPolicy()
    """Network of the agent phase."""
    verifier_timeout_s: float = Field(default=600.0, gt=0)
    """Limit of tests/test.sh."""
    verifier_user: str | None = None
    """User the verifier runs as (None: the image's USER)."""
    verifier_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the verifier (templates resolved on the host at run time)."""
    verifier_network: NetworkPolicy = NetworkPolicy()
    """Network of the verifier phase."""
    min_reward: float | dict[str, float] | None = None
    """Abort the remaining steps when this step's rewards fall below it."""
    healthcheck: Healthcheck | None = None
    """A step healthcheck, run after the step's setup and before its agent."""


class HarborTask(BaseConfig):
    """A Harbor task folder, read and checked."""

    folder: str
    """The task folder."""
    task_name: str
    """`[task] name`, else the folder name."""
    description: str
    """`[task] description`, else the instruction's first line."""
    schema_version: str = "1.4"
    """task.toml's schema version."""
    tags: list[str] = Field(default_factory=list)
    """`[metadata] tags` and `[task] keywords`."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """`[metadata]` as written."""
    image: str | None = None
    """`[environment] docker_image`: a pre-built image instead of environment/Dockerfile."""
    workdir: str | None = None
    """`[environment] workdir`, else the Dockerfile's last WORKDIR (None: '/')."""
    cpus: float = Field(default=1.0, gt=0)
    """`[environment] cpus`."""
    memory_mb: int = Field(default=2048, gt=0)
    """`[environment] memory_mb` (or the deprecated `memory`)."""
    storage_mb: int = Field(default=10240, gt=0)
    """`[environment] storage_mb` (or the deprecated `storage`)."""
    env: dict[str, str] = Field(default_factory=dict)
    """`[environment] env`, for every command of the trial."""
    healthcheck: Healthcheck | None = None
    """`[environment] healthcheck`."""
    compose: str | None = None
    """`environment/docker-compose.yaml` (relative to the task) when services run beside the agent."""
    network: NetworkPolicy = NetworkPolicy()
    """`[environment]` network baseline (with the deprecated `allow_internet`)."""
    solution_env: dict[str, str] = Field(default_factory=dict)
    """`[solution] env`, for the oracle's solve.sh."""
    steps: list[HarborStep]
    """The steps, one for a single-step task."""
    multi_step: bool = False
    """Whether task.toml declares `[[steps]]`."""
    reward_strategy: Literal["mean", "final"] = "mean"
    """How a multi-step trial's reward comes from its steps' rewards."""
    primary_reward: str | None = None
    """`[metadata] primary_reward`: the named reward that is the reward (else 'reward', else the mean)."""
    mcp_servers: list[McpServerSpec] = Field(default_factory=list)
    """`[[environment.mcp_servers]]`: stdio servers run in the agent's sandbox, streamable-HTTP ones are
    compose services of the trial; their tools are offered beside bash."""
    notes: list[str] = Field(default_factory=list)
    """One line per field agentrl runs the task without."""


def _size_mb(value: Any, field: str, source: Path) -> int | None:
    """Harbor sizes: `memory_mb = 2048` or the deprecated `memory = "4G"` / "512M"."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(value), re.IGNORECASE)
    if not match:
        raise ConfigError(f"{source}: [environment] {field} = {value!r} is not a size like '4G' or '512M'")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}[unit])


def _dockerfile_workdir(dockerfile: Path) -> str | None:
    workdir = None
    if not dockerfile.is_file():
        return None
    for line in dockerfile.read_text().splitlines():
        match = re.match(r"^\s*WORKDIR\s+(\S+)", line, re.IGNORECASE)
        if match:
            path = match.group(1).strip("\"'")
            workdir = path if path.startswith("/") else f"{(workdir or '').rstrip('/')}/{path}"
    return workdir


def _policy(table: dict[str, Any], base: NetworkPolicy, source: Path, where: str) -> NetworkPolicy:
    """A phase's network policy: its own `network_mode` when set, else `base`."""
    mode = table.get("network_mode")
    hosts = table.get("allowed_hosts")
    if mode is None and "allow_internet" in table and where == "environment":
        mode = "public" if table["allow_internet"] else "no-network"
    if mode is None:
        if hosts is not None:
            raise ConfigError(f"{source}: [{where}] allowed_hosts is only valid with "
                              "network_mode = 'allowlist'")
        return base
    if mode not in ("public", "no-network", "allowlist"):
        raise ConfigError(f"{source}: [{where}] network_mode = {mode!r}; "
                          "use 'public', 'no-network' or 'allowlist'")
    if hosts and mode != "allowlist":
        raise ConfigError(f"{source}: [{where}] allowed_hosts is only valid with "
                          "network_mode = 'allowlist'")
    return NetworkPolicy(mode=mode, allowed_hosts=[str(h).strip().lower() for h in hosts or []])


def _timeout(table: dict[str, Any], default: float | None) -> Any:
    """The table's `timeout_sec` (checked as a number by the models), else `default`."""
    value = table.get("timeout_sec")
    return default if value is None else value


def _table(config: dict[str, Any], key: str, source: Path) -> dict[str, Any]:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: [{key}] must be a table")
    return value


def _user(value: Any) -> str | None:
    return None if value is None else str(value)


_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)


def _instruction(path: Path) -> str:
    if not path.is_file():
        raise NotFoundError(f"{path.parent}: not a Harbor task, {path.name} is missing")
    lines = path.read_text().splitlines()
    while lines and (_CANARY.match(lines[0].strip()) or not lines[0].strip()):  # Harbor hides canary lines
        lines.pop(0)
    text = "\n".join(lines).strip()
    if not text:
        raise ConfigError(f"{path}: the instruction is empty")
    return text


def _healthcheck(table: dict[str, Any] | None, source: Path, where: str) -> Healthcheck | None:
    if not table:
        return None
    try:
        return Healthcheck(**table)
    except (ValidationError, TypeError) as error:
        problem = error.errors()[0] if isinstance(error, ValidationError) else {"loc": (), "msg": str(error)}
        field = ".".join([where, *(str(part) for part in problem["loc"])])
        raise ConfigError(f"{source}: {field}: {problem['msg']}") from None


def _env(table: dict[str, Any]) -> dict[str, str]:
    return {str(key): str(value) for key, value in (table.get("env") or {}).items()}


def _read_steps(config: dict[str, Any], folder: Path, source: Path,
                baseline: NetworkPolicy) -> list[HarborStep]:
    """`[[steps]]`, the task's [agent]/[verifier] as their defaults (as Harbor merges them); else one step."""
    agent, verifier = _table(config, "agent", source), _table(config, "verifier", source)
    agent_base = _policy(agent, baseline, source, "agent")
    verifier_base = _policy(verifier, baseline, source, "verifier")
    raw_steps = config.get("steps")
    if raw_steps is None:
        if not (folder / "tests" / "test.sh").is_file():
            raise NotFoundError(f"{folder}: not a Harbor task, tests/test.sh is missing")
        return [HarborStep(
            name="main", instruction=_instruction(folder / "instruction.md"),
            agent_timeout_s=_timeout(agent, None),
            agent_user=_user(agent.get("user")), agent_network=agent_base,
            verifier_timeout_s=_timeout(verifier, 600.0), verifier_user=_user(verifier.get("user")),
            verifier_env=_env(verifier), verifier_network=verifier_base,
            healthcheck=None)]
    if not isinstance(raw_steps, list) or not raw_steps:
        raise ConfigError(f"{source}: steps must be a non-empty array of tables ([[steps]])")
    steps = []
    for index, step in enumerate(raw_steps):
        name = str(step.get("name") or "")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ConfigError(f"{source}: steps[{index}].name = {name!r} must be a folder name "
                              "(letters, digits, . _ -)")
        step_dir = folder / "steps" / name
        if not (step_dir / "tests" / "test.sh").is_file() and not (folder / "tests" / "test.sh").is_file():
            raise NotFoundError(f"{step_dir}: not a Harbor task, tests/test.sh is missing")
        own_agent, own_verifier = step.get("agent") or {}, step.get("verifier") or {}
        steps.append(HarborStep(
            name=name, instruction=_instruction(step_dir / "instruction.md"), folder=f"steps/{name}",
            agent_timeout_s=_timeout(own_agent, _timeout(agent, None)),
            agent_user=_user(own_agent.get("user", agent.get("user"))),
            agent_network=_policy(own_agent, agent_base, source, f"steps[{index}].agent"),
            verifier_timeout_s=_timeout(own_verifier, 600.0),  # a step's own default, as in Harbor
            verifier_user=_user(own_verifier.get("user", verifier.get("user"))),
            verifier_env={**_env(verifier), **_env(own_verifier)},
            verifier_network=_policy(own_verifier, verifier_base, source, f"steps[{index}].verifier"),
            min_reward=step.get("min_reward"),
            healthcheck=_healthcheck(step.get("healthcheck"), source, f"steps[{index}].healthcheck"),
        ))
    for index, step in enumerate(steps[1:], start=1):  # one agent sandbox serves every step
        if step.agent_user != steps[0].agent_user:
            raise ConfigError(f"{source}: steps[{index}].agent.user = {step.agent_user!r} differs from the "
                              "first step's; agentrl's sandbox keeps one user for the whole trial")
        if step.agent_network != steps[0].agent_network:
            raise ConfigError(f"{source}: steps[{index}].agent.network_mode differs from the first step's; "
                              "agentrl cannot change a sandbox's network after it starts")
    return steps


_HARBOR_NAMES = {"agent_timeout_s": "[agent] timeout_sec", "verifier_timeout_s": "[verifier] timeout_sec",
                 "agent_user": "[agent] user", "verifier_user": "[verifier] user",
                 "cpus": "[environment] cpus", "memory_mb": "[environment] memory_mb",
                 "storage_mb": "[environment] storage_mb",
                 "min_reward": "steps.min_reward", "primary_reward": "[metadata] primary_reward",
                 "image": "[environment] docker_image", "workdir": "[environment] workdir"}


def _mcp_servers(environment: dict[str, Any], service_hosts: set[str], source: Path) -> list[McpServerSpec]:
    """`[[environment.mcp_servers]]` as specs: stdio (in the agent's sandbox) or streamable-http on a compose
    service; the SSE transport and servers off the trial's network are refused in one line."""
    from agentrl.mcp_servers import check_local

    specs = []
    for index, entry in enumerate(environment.get("mcp_servers") or []):
        where = f"{source}: environment.mcp_servers[{index}]"
        if entry.get("transport") == "sse":
            raise ConfigError(f"{where}: transport 'sse' cannot be run by agentrl (its MCP relay speaks stdio and "
                              "streamable-http)")
        try:
            spec = McpServerSpec.model_validate(entry)
        except ValidationError as error:
            problem = error.errors()[0]
            raise ConfigError(f"{where}.{'.'.join(str(p) for p in problem['loc'])}: {problem['msg']}") from None
        try:
            check_local(spec, service_hosts=service_hosts, where=where)
        except AgentrlError as error:
            raise ConfigError(str(error)) from None
        specs.append(spec)
    return specs


def read_harbor_task(path: str | Path) -> HarborTask:
    """Parse and check a Harbor task folder (raises a one-line error naming the file or field)."""
    from agentrl.hub.interop.harbor_compose import COMPOSE_FILES, read_compose

    folder = Path(path)
    if not folder.is_dir():
        raise NotFoundError(f"{folder}: no such Harbor task folder")
    source = folder / "task.toml"
    if not source.is_file():
        raise NotFoundError(f"{folder}: not a Harbor task, task.toml is missing")
    try:
        config = tomllib.loads(source.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{source}: malformed TOML: {error}") from None
    notes: list[str] = []
    check_fields(config, source, notes)
    schema = str(config.get("schema_version", config.get("version", "1.4")))
    if schema not in SCHEMA_VERSIONS:
        notes.append(f"{source}: schema_version = {schema!r} is not one of Harbor 0.25's "
                     f"{', '.join(SCHEMA_VERSIONS)}; read as 1.4")
    metadata, task_info = _table(config, "metadata", source), _table(config, "task", source)
    environment = _table(config, "environment", source)
    compose = next((name for name in COMPOSE_FILES if (folder / "environment" / name).is_file()), None)
    services, main_env = read_compose(folder / "environment" / compose) if compose else ([], {})
    mcp_servers = _mcp_servers(environment, {service.name for service in services}, source)
    image = environment.get("docker_image")
    if not image and not (folder / "environment" / "Dockerfile").is_file():
        raise NotFoundError(f"{folder}: not a Harbor task, environment/Dockerfile is missing "
                            "(or set [environment] docker_image)")
    baseline = _policy(environment, NetworkPolicy(), source, "environment")
    memory = _size_mb(environment.get("memory_mb", environment.get("memory")), "memory", source)
    storage = _size_mb(environment.get("storage_mb", environment.get("storage")), "storage", source)
    tags = list(metadata.get("tags") or []) + list(task_info.get("keywords") or [])
    strategy = config.get("multi_step_reward_strategy") or "mean"
    if strategy not in ("mean", "final"):
        raise ConfigError(f"{source}: multi_step_reward_strategy = {strategy!r}; use 'mean' or 'final'")
    try:
        steps = _read_steps(config, folder, source, baseline)
        first_line = steps[0].instruction.splitlines()[0].lstrip("# ").strip()
        return HarborTask(
            folder=str(folder), task_name=str(task_info.get("name") or folder.name),
            description=str(task_info.get("description") or first_line)[:200], schema_version=schema,
            tags=[str(t) for t in tags], metadata=metadata, image=image,
            workdir=environment.get("workdir") or _dockerfile_workdir(folder / "environment" / "Dockerfile"),
            cpus=environment.get("cpus", 1), memory_mb=2048 if memory is None else memory,
            storage_mb=10240 if storage is None else storage,
            env={**main_env, **_env(environment)}, compose=f"environment/{compose}" if compose else None,
            healthcheck=_healthcheck(environment.get("healthcheck"), source, "environment.healthcheck"),
            network=baseline, solution_env=_env(_table(config, "solution", source)),
            steps=steps, multi_step="steps" in config, reward_strategy=strategy,
            primary_reward=metadata.get("primary_reward"), mcp_servers=mcp_servers, notes=notes,
        )
    except ValidationError as error:  # the first problem on one line, named as task.toml names it
        problem = error.errors()[0]
        loc = [str(part) for part in problem["loc"]]
        if loc[0] == "steps" and len(loc) > 2:  # a step's field: `[verifier] timeout_sec`, with its step if several
            where = ("" if "steps" not in config else f"steps[{loc[1]}] ") + _HARBOR_NAMES.get(loc[2], loc[2])
        else:
            where = _HARBOR_NAMES.get(loc[0], ".".join(loc))
        said = problem["msg"].replace("Input should be ", "must be ")
        shown = f" = {problem['input']!r}" if not isinstance(problem.get("input"), (dict, list)) else ""
        raise ConfigError(f"{source}: {where}{shown}: {said}") from None


_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?\}")


def resolve_env(values: dict[str, str], *, where: str, allowed: Collection[str] = ()) -> dict[str, str]:
    """Harbor's env templates: `${VAR}` / `${VAR:-default}` from the host's environment, only for the variables in
    `allowed` (the package's `allow_env`, `agentrl env import harbor --allow-env VAR`); others take their default,
    and one without a default is a one-line error. Literals stay."""
    resolved = {}
    for key, value in values.items():
        match = _TEMPLATE.fullmatch(value)
        if not match:
            resolved[key] = value
        elif match.group(1) in allowed and match.group(1) in os.environ:
            resolved[key] = os.environ[match.group(1)]
        elif match.group(2) is not None:
            resolved[key] = match.group(2)
        elif match.group(1) not in allowed:
            raise ConfigError(f"{where}: {key} = {value!r} takes the host variable {match.group(1)}, which this "
                              f"package does not let through; import it with --allow-env {match.group(1)} "
                              "(or give the environment allow_env)")
        else:
            raise ConfigError(f"{where}: {key} = {value!r} needs the host environment variable "
                              f"{match.group(1)}; set it")
    return resolved


def check_allow_env(names: Collection[str]) -> list[str]:
    """Host variable names a package lets into templates; one-line error for a name that is not one."""
    checked = []
    for name in (n.strip() for n in names):
        if not name:
            continue
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"allow_env {name!r}: not an environment variable name")
        checked.append(name)
    return checked


def check_carry_paths(paths: list[str]) -> list[str]:
    """Absolute folders (not `/`) to carry to the verifier besides the working directory; one-line errors."""
    checked = []
    for path in (p.strip() for p in paths):
        if not path:
            continue
        if not path.startswith("/") or path.rstrip("/") == "" or ".." in path.split("/"):
            raise ConfigError(f"carry path {path!r}: give an absolute folder other than / (e.g. /root)")
        checked.append(path.rstrip("/"))
    return checked
