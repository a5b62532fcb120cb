"""`agentrl env import harbor PATH`: turn a Harbor task folder into an agentrl environment package.

A Harbor task (harborframework.com/docs/tasks) is a folder with `task.toml` (metadata,
`[verifier]`/`[agent]` timeouts, `[environment]` resources and `allow_internet`),
`instruction.md`, `environment/Dockerfile`, `tests/test.sh` (writes the reward to
`/logs/verifier/reward.txt` or `reward.json`) and optionally `solution/solve.sh`.

The package written keeps those files as they are and adds `environment.toml` (sandbox image
built from `environment/Dockerfile`, limits and network from `[environment]`), one task row
(the instruction as the user prompt), a README, and a two-line entrypoint module that
returns `agentrl.hub.harbor_env.HarborTaskEnv`, whose reward runs `tests/test.sh` in the
sandbox after the episode.
"""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, ConfigError, NotFoundError

__all__ = ["read_harbor_task", "import_harbor_task", "ENTRY_MODULE"]

ENTRY_MODULE = "harbor_task"
_COPIED = ("task.toml", "instruction.md", "environment", "tests", "solution")

_ENTRY = '''"""Entrypoint of a package imported from a Harbor task (see agentrl.hub.harbor_env)."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def load_environment(**kwargs):
    from agentrl.hub.harbor_env import load_harbor_environment

    return load_harbor_environment(PACKAGE_DIR, **kwargs)


def oracle_policy():
    from agentrl.hub.harbor_env import harbor_oracle_policy

    return harbor_oracle_policy(PACKAGE_DIR)
'''


def _size_mb(value: Any, field: str, source: Path) -> int | None:
    """Harbor sizes: `memory_mb = 2048` or `memory = "4G"` / "512M"."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(value), re.IGNORECASE)
    if not match:
        raise ConfigError(f"{source}: [environment] {field} = {value!r} is not a size like '4G' or '512M'")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}[unit])


def _dockerfile_workdir(dockerfile: Path) -> str:
    workdir = "/"
    for line in dockerfile.read_text().splitlines():
        match = re.match(r"^\s*WORKDIR\s+(\S+)", line, re.IGNORECASE)
        if match:
            path = match.group(1).strip("\"'")
            workdir = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    return workdir


def read_harbor_task(path: str | Path) -> dict[str, Any]:
    """Parse and check a Harbor task folder; returns its parts (raises a one-line error on a problem)."""
    folder = Path(path)
    if not folder.is_dir():
        raise NotFoundError(f"{folder}: no such Harbor task folder")
    for required in ("task.toml", "instruction.md", "environment/Dockerfile", "tests/test.sh"):
        if not (folder / required).is_file():
            raise NotFoundError(f"{folder}: not a Harbor task, {required} is missing")
    source = folder / "task.toml"
    try:
        config = tomllib.loads(source.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{source}: malformed TOML: {error}") from None
    metadata = config.get("metadata") or {}
    task = config.get("task") or {}
    environment = config.get("environment") or {}
    for section in ("metadata", "task", "environment", "verifier", "agent"):
        if section in config and not isinstance(config[section], dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
    instruction = (folder / "instruction.md").read_text().strip()
    if not instruction:
        raise ConfigError(f"{folder / 'instruction.md'}: the instruction is empty")
    tags = list(metadata.get("tags") or []) + list(task.get("keywords") or [])
    return {
        "folder": folder,
        "task_name": str(task.get("name") or folder.name),
        "description": str(task.get("description") or instruction.splitlines()[0].lstrip("# ").strip())[:200],
        "instruction": instruction,
        "tags": [str(t) for t in tags],
        "difficulty": metadata.get("difficulty"),
        "category": metadata.get("category"),
        "verifier_timeout_s": float((config.get("verifier") or {}).get("timeout_sec", 120.0)),
        "agent_timeout_s": float((config.get("agent") or {}).get("timeout_sec", 600.0)),
        "cpus": float(environment.get("cpus", 1)),
        "memory_mb": _size_mb(environment.get("memory_mb", environment.get("memory")), "memory", source) or 2048,
        "storage_mb": _size_mb(environment.get("storage_mb", environment.get("storage")), "storage", source) or 10240,
        "network": bool(environment.get("allow_internet", False)),
        "workdir": _dockerfile_workdir(folder / "environment" / "Dockerfile"),
    }


def _env_name(task_name: str) -> str:
    name = re.sub(r"[^a-z0-9\-_]+", "-", task_name.split("/")[-1].lower()).strip("-_")
    if not name:
        raise AgentrlError(f"Harbor task name {task_name!r} gives no usable environment name; pass --name")
    return ("harbor-" + name)[:64] if not name.startswith("harbor") else name[:64]


def import_harbor_task(path: str | Path, *, out: str | Path | None = None, name: str | None = None) -> Path:
    """Write the agentrl package for a Harbor task; returns its folder."""
    from agentrl.config import dump_config
    from agentrl.hub.manifest import (
        DatasetSpec, Manifest, RewardSpec, SandboxLimits, SandboxSpec,
    )

    task = read_harbor_task(path)
    env_name = name or _env_name(task["task_name"])
    target = Path(out) if out is not None else Path(env_name)
    if target.exists() and any(target.iterdir()):
        raise AgentrlError(f"{target}: folder exists and is not empty; pick another --out")
    try:
        manifest = Manifest(
            name=env_name, version="0.1.0", description=task["description"],
            tags=sorted({"harbor", "sandbox", "multi-turn", *task["tags"]}), entrypoint=f"{ENTRY_MODULE}:load_environment",
            reward=RewardSpec(description="Harbor verifier: tests/test.sh runs in the sandbox after the episode and "
                                          "writes the reward to /logs/verifier/reward.txt (or reward.json)"),
            dataset=DatasetSpec(splits={"train": "data/tasks.jsonl", "test": "data/tasks.jsonl"}),
            sandbox=SandboxSpec(
                image=f"{env_name}:0.1.0", dockerfile="environment/Dockerfile", network=task["network"],
                workdir=task["workdir"], user=None,
                limits=SandboxLimits(cpus=task["cpus"], memory_mb=task["memory_mb"], disk_mb=task["storage_mb"],
                                     timeout_s=min(task["agent_timeout_s"], 600.0)),
            ),
            env_args={"verifier_timeout_s": task["verifier_timeout_s"]},
        )
    except Exception as error:  # pydantic ValidationError: report the first problem on one line
        raise ConfigError(f"{task['folder'] / 'task.toml'}: cannot map to environment.toml: "
                          f"{str(error).splitlines()[0]}") from None
    target.mkdir(parents=True, exist_ok=True)
    for item in _COPIED:
        source = task["folder"] / item
        if source.is_dir():
            shutil.copytree(source, target / item)
        elif source.is_file():
            shutil.copyfile(source, target / item)
    (target / "environment.toml").write_text(
        f"# Imported from the Harbor task {task['task_name']!r} by `agentrl env import harbor`.\n"
        + dump_config(manifest)
    )
    (target / f"{ENTRY_MODULE}.py").write_text(_ENTRY)
    (target / "data").mkdir(exist_ok=True)
    row = {"prompt": [{"role": "user", "content": task["instruction"]}], "answer": "",
           "info": {"harbor_task": task["task_name"], "difficulty": task["difficulty"], "category": task["category"],
                    "verifier_timeout_s": task["verifier_timeout_s"], "agent_timeout_s": task["agent_timeout_s"]},
           "task": env_name, "example_id": task["task_name"]}
    (target / "data" / "tasks.jsonl").write_text(json.dumps(row) + "\n")
    (target / "README.md").write_text(
        f"# {env_name}\n\nImported from the Harbor task `{task['task_name']}`.\n\n{task['description']}\n\n"
        "The agent works in the task's container through a `bash` tool; the reward is what the task's "
        "`tests/test.sh` writes to `/logs/verifier/reward.txt` when run in that container after the episode.\n"
    )
    return target
