"""`agentrl env import harbor PATH`: Harbor tasks (one, a dataset folder, a registry list) become a package.

A Harbor task (harborframework.com/docs/tasks) is a folder with `task.toml`, `instruction.md`
(or `steps/<name>/instruction.md` per step), `environment/Dockerfile` (or `[environment]
docker_image`), `tests/test.sh` (writes `/logs/verifier/reward.json` or `reward.txt`) and
optionally `solution/solve.sh`. `agentrl.hub.interop.harbor_config` reads task.toml (every field
of harbor 0.25: honoured, warned in one line, or refused in one line).

The package keeps each task's files as they are (one task: at the package root; a dataset:
under `tasks/<name>/`), one row per task (the first step's instruction as the prompt, the
task folder and image in `info`), `environment.toml` (the first task's image, limits and
agent-phase network), a README, and an entrypoint returning
`agentrl.hub.interop.harbor_env.HarborTaskEnv`.

PATH may be a task folder, a dataset folder (its sub-folders holding task.toml), or a
registry-style JSON list (Harbor's registry.json: datasets with `tasks` of `name` and
`path`; tasks with a `git_url` are refused: nothing is downloaded).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

from agentrl.errors import AgentrlError, AgentrlWarning, ConfigError, NotFoundError
from agentrl.hub.interop.harbor_config import HarborTask, check_allow_env, check_carry_paths, read_harbor_task
from agentrl.hub.tree_copy import copy_tree, package_folder

__all__ = ["read_harbor_task", "import_harbor_task", "find_harbor_tasks", "build_harbor_images",
           "ENTRY_MODULE"]

ENTRY_MODULE = "harbor_task"
_COPIED = ("task.toml", "instruction.md", "environment", "tests", "solution", "steps")

_ENTRY = '''"""Entrypoint of a package imported from Harbor tasks (see agentrl.hub.interop.harbor_env)."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def load_environment(**kwargs):
    from agentrl.hub.interop.harbor_env import load_harbor_environment

    return load_harbor_environment(PACKAGE_DIR, **kwargs)


def oracle_policy():
    from agentrl.hub.interop.harbor_env import harbor_oracle_policy

    return harbor_oracle_policy(PACKAGE_DIR)
'''


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9\-_]+", "-", text.split("/")[-1].lower()).strip("-_")


def _env_name(task_name: str) -> str:
    name = _slug(task_name)
    if not name:
        raise AgentrlError(f"Harbor task name {task_name!r} gives no usable environment name; pass --name")
    return ("harbor-" + name)[:64] if not name.startswith("harbor") else name[:64]


def _registry_tasks(path: Path, skipped: list[tuple[str, str]] | None = None) -> list[Path]:
    """The local task folders a registry-style JSON list names (paths relative to the file); a task that lives
    in a git repository is refused, or, given `skipped`, listed there with the reason."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: not a readable Harbor registry JSON ({error})") from None
    datasets = data if isinstance(data, list) else data.get("datasets") if isinstance(data, dict) else None
    if not isinstance(datasets, list):
        raise ConfigError(f"{path}: a Harbor registry is a JSON list of datasets (or {{'datasets': [...]}})")
    folders = []
    for index, dataset in enumerate(datasets):
        tasks = dataset.get("tasks") if isinstance(dataset, dict) else None
        if not isinstance(tasks, list):
            raise ConfigError(f"{path}: datasets[{index}].tasks must be a list of {{name, path}}")
        for number, task in enumerate(tasks):
            where = f"{path}: datasets[{index}].tasks[{number}]"
            if not isinstance(task, dict) or not task.get("path"):
                raise ConfigError(f"{where} has no path")
            if task.get("git_url"):
                problem = (f"{where} lives in {task['git_url']}; agentrl downloads nothing: clone it "
                           "and import the local folder (or give a registry whose paths are local)")
                if skipped is None:
                    raise ConfigError(problem)
                skipped.append((str(task.get("name") or task["path"]), problem))
                continue
            folders.append((path.parent / task["path"]).resolve())
    if not folders and not skipped:
        raise ConfigError(f"{path}: the registry names no tasks")
    return folders


def find_harbor_tasks(path: str | Path, skipped: list[tuple[str, str]] | None = None) -> list[Path]:
    """The task folders PATH stands for: a task, a dataset folder of tasks, or a registry JSON list."""
    path = Path(path)
    if path.is_file() and path.suffix == ".json":
        return _registry_tasks(path, skipped)
    if not path.is_dir():
        raise NotFoundError(f"{path}: no such Harbor task folder, dataset folder or registry JSON")
    if (path / "task.toml").is_file():
        return [path]
    folders = sorted(child for child in path.iterdir() if (child / "task.toml").is_file())
    if not folders:
        raise NotFoundError(f"{path}: not a Harbor task (task.toml is missing) nor a dataset folder of tasks")
    return folders


def _read_tasks(folders: list[Path], *, single: bool, skipped: list[tuple[str, str]]) -> list[HarborTask]:
    """Each folder's task; in a dataset, a task agentrl refuses goes to `skipped` with its one-line reason."""
    tasks = []
    for folder in folders:
        try:
            tasks.append(read_harbor_task(folder))
        except AgentrlError as error:
            if single:
                raise
            skipped.append((folder.name, str(error)))
    return tasks


def _row(task: HarborTask, *, env_name: str, folder: str, image: str, dockerfile: str | None) -> dict:
    return {"prompt": [{"role": "user", "content": task.steps[0].instruction}], "answer": "",
            "info": {"harbor_task": task.task_name, "harbor_dir": folder, "image": image,
                     "dockerfile": dockerfile, "difficulty": task.metadata.get("difficulty"),
                     "category": task.metadata.get("category")},
            "task": env_name, "example_id": task.task_name}


def _write_package(staging: Path, tasks: list[HarborTask], rows: list[dict], manifest, *, single: bool, path: Path,
                   env_name: str, skipped: list[tuple[str, str]]) -> None:
    """The package's files in the staging folder: each task's files (links checked), manifest, entry, rows, README."""
    from agentrl.config import dump_config

    first = tasks[0]
    for task, row in zip(tasks, rows, strict=True):
        destination = staging / row["info"]["harbor_dir"]
        destination.mkdir(parents=True, exist_ok=True)
        copy_tree(Path(task.folder), destination, only=_COPIED)
    origin = (f"the Harbor task {first.task_name!r}" if single
              else f"{len(tasks)} Harbor tasks of {Path(path).name}")
    (staging / "environment.toml").write_text(f"# Imported from {origin} by `agentrl env import harbor`.\n"
                                             + dump_config(manifest))
    (staging / f"{ENTRY_MODULE}.py").write_text(_ENTRY)
    (staging / "data").mkdir(exist_ok=True)
    (staging / "data" / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    listing = "\n".join(f"- `{task.task_name}` ({row['info']['harbor_dir']}, image `{row['info']['image']}`)"
                        for task, row in zip(tasks, rows, strict=True))
    (staging / "README.md").write_text(
        f"# {env_name}\n\nImported from {origin}.\n\n{listing}\n\n"
        "The agent works in each task's container through a `bash` tool; the reward is what the task's "
        "`tests/test.sh` writes to `/logs/verifier/reward.json` (or `reward.txt`) when run in a fresh "
        "sandbox after the episode. `agentrl env import harbor --build` (or `build_harbor_images`) builds "
        "every task's image.\n"
        + ("\n## Skipped at import\n\n" + "\n".join(f"- `{n}`: {p}" for n, p in skipped) + "\n" if skipped else "")
    )


def import_harbor_task(path: str | Path, *, out: str | Path | None = None, name: str | None = None,
                       writable_root: str = "never", carry_paths: list[str] | None = None,
                       allow_env: list[str] | None = None, log: Callable[[str], None] | None = None) -> Path:
    """Write the agentrl package for a Harbor task, dataset folder or registry list; returns its folder.

    `writable_root` ('never', 'verifier' or 'always'): the phases whose sandbox gets a writable root
    filesystem (for a test.sh that installs its tools); `carry_paths`: folders besides the working
    directory that the verifier gets from the agent's sandbox (Harbor's verifier sees the whole
    container); `allow_env`: host variables the tasks' `${VAR}` env templates may take (none by default: a
    template takes its default, or is refused when it has none); the task's files are copied without
    following links (links out of the task and loops refused) into a folder that appears whole or not at
    all (hub/tree_copy.py); `log` gets one line per field run without (default: a warning).
    """
    from agentrl.hub.manifest import DatasetSpec, Manifest, RewardSpec, SandboxLimits, SandboxSpec

    if writable_root not in ("never", "verifier", "always"):
        raise ConfigError(f"writable_root = {writable_root!r}; use 'never', 'verifier' or 'always'")
    say = log or (lambda line: warnings.warn(line, AgentrlWarning, stacklevel=3))
    carry = check_carry_paths(list(carry_paths or []))
    allowed = check_allow_env(list(allow_env or []))
    single = Path(path).is_dir() and (Path(path) / "task.toml").is_file()
    skipped: list[tuple[str, str]] = []
    tasks = _read_tasks(find_harbor_tasks(path, None if single else skipped), single=single, skipped=skipped)
    for task in tasks:
        for note in task.notes:
            say(note)
    if skipped:
        for task_name, problem in skipped:
            say(f"skipped {task_name}: {problem}")
        if not tasks:
            raise ConfigError(f"{path}: none of its {len(skipped)} Harbor tasks can run here (each one's reason "
                              f"is above); the first: {skipped[0][1]}")
        say(f"{path}: imported {len(tasks)} of {len(tasks) + len(skipped)} tasks; skipped {len(skipped)} "
            f"({', '.join(task_name for task_name, _ in skipped)}), each for the reason above")
    env_name = name or _env_name(tasks[0].task_name if single else Path(path).stem)
    target = Path(out) if out is not None else Path(env_name)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise AgentrlError(f"{target}: folder exists and is not empty; pick another --out")
    rows, seen = [], set()
    for task in tasks:
        slug = _slug(task.task_name) or "task"
        if slug in seen:
            raise ConfigError(f"{task.folder}: two tasks are named {task.task_name!r}; names must differ")
        seen.add(slug)
        folder = "." if single else f"tasks/{slug}"
        dockerfile = None if task.image else (f"{folder}/environment/Dockerfile" if not single
                                              else "environment/Dockerfile")
        image = task.image or (f"{env_name}:0.1.0" if single else f"{env_name}-{slug}:0.1.0")
        rows.append(_row(task, env_name=env_name, folder=folder, image=image, dockerfile=dockerfile))
    first, first_info = tasks[0], rows[0]["info"]
    step = first.steps[0]
    try:
        manifest = Manifest(
            name=env_name, version="0.1.0", description=first.description if single else
            f"{len(tasks)} Harbor tasks imported from {Path(path).name}",
            tags=sorted({"harbor", "sandbox", "multi-turn", *(t for task in tasks for t in task.tags)}),
            entrypoint=f"{ENTRY_MODULE}:load_environment",
            reward=RewardSpec(description="Harbor verifier: tests/test.sh runs in a fresh sandbox after the "
                                          "episode and writes /logs/verifier/reward.json (named rewards) or "
                                          "reward.txt"),
            dataset=DatasetSpec(splits={"train": "data/tasks.jsonl", "test": "data/tasks.jsonl"}),
            sandbox=SandboxSpec(
                image=first_info["image"], dockerfile=first_info["dockerfile"],
                network=step.agent_network.mode == "public", workdir=first.workdir or "/app",
                user=step.agent_user,
                limits=SandboxLimits(cpus=first.cpus, memory_mb=first.memory_mb, disk_mb=first.storage_mb,
                                     timeout_s=600.0),
            ),
            env_args={"writable_root": writable_root, "carry_paths": ",".join(carry), "allow_env": ",".join(allowed)},
        )
    except Exception as error:  # pydantic ValidationError: report the first problem on one line
        raise ConfigError(f"{Path(first.folder) / 'task.toml'}: cannot map to environment.toml: "
                          f"{str(error).splitlines()[0]}") from None
    with package_folder(target) as staging:
        _write_package(staging, tasks, rows, manifest, single=single, path=Path(path), env_name=env_name,
                       skipped=skipped)
    return target


def build_harbor_images(package_dir: str | Path) -> list[str]:
    """Build each row's image (and compose services') from its Dockerfile's folder; returns the tags."""
    from agentrl.hub.images import build_image
    from agentrl.hub.interop.harbor_compose import read_compose, service_image
    from agentrl.sandbox.docker_backend import docker_client, network_unavailable

    package_dir = Path(package_dir)
    network = network_unavailable(docker_client(), "runc") is None  # Harbor builds with the network if any
    built = []
    for line in (package_dir / "data" / "tasks.jsonl").read_text().splitlines():
        info = (json.loads(line).get("info") or {}) if line.strip() else {}
        if info.get("dockerfile") and info["image"] not in built:
            build_image(package_dir, dockerfile=info["dockerfile"], tag=info["image"], network=network)
            built.append(info["image"])
        task = read_harbor_task(package_dir / (info.get("harbor_dir") or "."))
        for service in read_compose(Path(task.folder) / task.compose)[0] if task.compose else []:
            tag = service_image(info["image"], service)
            if service.build_context is not None and tag not in built:
                dockerfile = Path(task.folder, "environment", service.build_context, service.dockerfile)
                build_image(package_dir, dockerfile=str(dockerfile.relative_to(package_dir)), tag=tag,
                            network=network)
                built.append(tag)
    return built
