"""Which harbor 0.25 task.toml fields agentrl honours, runs without (one-line warning) or refuses.

`FIELD_POLICY` mirrors harbor 0.25's `TaskConfig` (schema 1.0-1.4) table by table; `check_fields`
walks the fields a task.toml sets: a field marked `refuse:` raises a `ConfigError` naming it, one
marked `warn:` adds a note (agentrl runs the task without it), a field harbor does not know is
noted as such, and the rest are honoured by `agentrl.hub.interop.harbor_config`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError

__all__ = ["FIELD_POLICY", "check_fields"]

_OK = "ok"
_PHASE = {"timeout_sec": _OK, "user": _OK, "network_mode": _OK, "allowed_hosts": _OK}
_VERIFIER = {**_PHASE, "env": _OK, "environment_mode": "mode",
             "environment": "refuse:a verifier environment of its own (another image) is not supported; "
                            "agentrl grades in a fresh sandbox of the task's own environment",
             "collect": "refuse:collect hooks run in docker-compose sidecars, which agentrl does not run"}
_ARTIFACTS = "warn:agentrl keeps no trial artifacts (the verifier's rewards and output are in the rollout)"
_HEALTHCHECK = {"command": _OK, "interval_sec": _OK, "timeout_sec": _OK, "start_period_sec": _OK,
                "start_interval_sec": _OK, "retries": _OK}
FIELD_POLICY: dict[str, Any] = {
    "schema_version": _OK, "version": _OK, "source": _OK, "multi_step_reward_strategy": _OK,
    "task": {"name": _OK, "version": _OK, "description": _OK, "authors": _OK, "keywords": _OK},
    "metadata": "any",
    "verifier": _VERIFIER,
    "agent": _PHASE,
    "solution": {"env": _OK},
    "artifacts": _ARTIFACTS,
    "environment": {
        "build_timeout_sec": "warn:agentrl builds images without a deadline", "docker_image": _OK, "os": "os",
        "cpus": _OK, "memory_mb": _OK,
        "storage_mb": _OK, "memory": _OK, "storage": _OK, "env": _OK, "healthcheck": _HEALTHCHECK,
        "workdir": _OK, "allow_internet": _OK, "network_mode": _OK, "allowed_hosts": _OK,
        "gpus": "gpus", "gpu_types": "refuse:GPU sandboxes are not supported",
        "tpu": "refuse:TPU sandboxes are not supported",
        "mcp_servers": {"name": _OK, "transport": _OK, "command": _OK, "args": _OK, "url": _OK},
        "skills_dir": "warn:agentrl's bash agent loads no skills; the folder stays in the image",
    },
    "steps": {"name": _OK, "agent": _PHASE, "verifier": _VERIFIER, "min_reward": _OK,
              "healthcheck": _HEALTHCHECK, "artifacts": _ARTIFACTS},
}


def _walk(data: dict[str, Any], policy: dict[str, Any], where: str, source: Path,
                  notes: list[str]) -> None:
    """Walk the fields set in task.toml: refuse or note what agentrl cannot honour, note unknown fields."""
    for key, value in data.items():
        field = f"{where}.{key}" if where else key
        rule = policy.get(key)
        if rule is None:
            close = difflib.get_close_matches(str(key), [str(name) for name in policy], n=1, cutoff=0.7)
            hint = f" (did you mean {f'{where}.{close[0]}' if where else close[0]!r}?)" if close else ""
            notes.append(f"{source}: {field} is not a field of Harbor 0.25's task.toml{hint}; ignored")
        elif rule == "any" or rule == _OK:
            continue
        elif isinstance(rule, dict):
            items = value if isinstance(value, list) else [value]
            for index, item in enumerate(items):
                if not isinstance(item, dict):
                    raise ConfigError(f"{source}: {field} must be a table")
                inner = f"{field}[{index}]" if isinstance(value, list) else field
                _walk(item, rule, inner, source, notes)
        elif rule.startswith("refuse:"):
            raise ConfigError(f"{source}: {field} cannot be run by agentrl: {rule[7:]}")
        elif rule.startswith("warn:"):
            if value:
                notes.append(f"{source}: {field} ignored: {rule[5:]}")
        elif rule == "os" and str(value).lower() != "linux":
            raise ConfigError(f"{source}: {field} = {value!r} cannot be run by agentrl: "
                              "its sandboxes are Linux")
        elif rule == "gpus" and value:
            raise ConfigError(f"{source}: {field} = {value!r} cannot be run by agentrl: "
                              "GPU sandboxes are not supported")
        elif rule == "mode" and value == "shared":
            notes.append(f"{source}: {field} = 'shared' runs as 'separate': agentrl grades in a fresh "
                         "sandbox that gets the agent's working directory only")


def check_fields(config: dict[str, Any], source: Path, notes: list[str]) -> None:
    """Refuse what agentrl cannot run and note (in `notes`) what it runs without or does not know."""
    _walk(config, FIELD_POLICY, "", source, notes)
