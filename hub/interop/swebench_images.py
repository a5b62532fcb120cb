"""`agentrl env swebench-image`: get or build the image of SWE-bench rows, one command.

    agentrl env swebench-image ROWS [--instance ID ...]                         # pull the published image
    agentrl env swebench-image ROWS --task-repo REPO [--network]                 # build swebench's own Dockerfile
    agentrl env swebench-image ROWS --source GIT --env-image IMAGE              # build from the row itself

ROWS is what `agentrl env import swebench` takes (a .jsonl of rows or a `save_to_disk` folder) or the package
it wrote; every row is read as the `swe` environment reads it, so the image built or pulled is the one its
rollouts start (the row's `image`, else `<namespace>/sweb.eval.x86_64.<id>:latest`).

- pull (default): `docker pull` of that image (Docker Hub's `swebench/...` ones are SWE-bench's published images).
- `--task-repo`: swebench 5's task repo (a local folder or a GitHub `owner/repo`, resolved by swebench's own
  `resolve_task_repo`) holds each instance's Dockerfile and build context (`swebench.task.repo.load_dockerfiles`,
  `task_paths`): that Dockerfile is built and tagged as the row's image, with the network only with `--network`
  (a task repo's Dockerfile usually clones the project and installs its environment).
- `--source GIT --env-image IMAGE`: no task repo: the project is cloned on this machine from GIT (a URL, or a
  local mirror, which needs no network) and checked out at the row's `base_commit` (a one-line error when the
  source lacks it) into `/testbed` of IMAGE, the image holding the project's environment (SWE-bench's env image,
  or any with its conda env `testbed`); the build itself has no network. The row's `eval_script` grades as
  before: it is the row's own.

`swebench_image_hint` is the line a missing image's error carries.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, NotFoundError

__all__ = ["get_swebench_images", "swebench_image_hint", "swebench_instances"]


def swebench_image_hint(source: str | Path, instance_id: str) -> str:
    """The command that pulls or builds a row's image (for a missing image's error)."""
    return (f"get it with `agentrl env swebench-image {source} --instance {instance_id}` (pulls SWE-bench's published "
            "image; add --task-repo REPO, or --source GIT --env-image IMAGE, to build it from the row)")


def swebench_instances(source: str | Path, *, namespace: str | None = None) -> list[Any]:
    """The rows of SOURCE (rows file/folder, or a package `agentrl env import swebench` wrote) as SweInstances."""
    from agentrl.hub.interop.swebench import _swe_attr, read_swebench_rows

    source = Path(source)
    checked = _swe_attr("checked_instances")
    if (source / "environment.toml").is_file():
        files = sorted({*source.glob("data/*.jsonl")})
        if not files:
            raise NotFoundError(f"{source}: a package without data/*.jsonl rows")
        rows = [json.loads(line)["info"] for path in files for line in path.read_text().splitlines() if line.strip()]
        rows = [json.loads(row) if isinstance(row, str) else row for row in rows]
        found = {row["instance_id"]: row for row in rows}
        return checked(list(found.values()), where=str(source), namespace=namespace)
    return [instance for part, rows in read_swebench_rows(source).items()
            for instance in checked(rows, where=f"{source}[{part}]", namespace=namespace)]


def _pull(image: str) -> str:
    import docker

    from agentrl.sandbox.docker_engine import docker_client

    try:
        docker_client().images.pull(image)
    except docker.errors.APIError as error:
        raise AgentrlError(f"could not pull {image}: {error.explanation or error}; build it instead with "
                           "--task-repo REPO or --source GIT --env-image IMAGE") from None
    return image


def _build_from_task_repo(instance: Any, task_repo: str, *, network: bool) -> str:
    from swebench.image_builder.prepare_images import resolve_task_repo
    from swebench.task.repo import load_dockerfiles, task_paths

    from agentrl.hub.images import build_image

    try:
        with resolve_task_repo(task_repo) as repo:
            dockerfiles = load_dockerfiles(repo, [instance.instance_id])
            if instance.instance_id not in dockerfiles:
                raise NotFoundError(f"{task_repo}: the task repo has no tasks/{instance.instance_id}/ with a task.yaml "
                                    "and a Dockerfile")
            context = task_paths(repo, [instance.instance_id])[instance.instance_id]
            build_image(context, dockerfile="Dockerfile", tag=instance.image_name, network=network)
    except (FileNotFoundError, RuntimeError) as error:
        raise AgentrlError(f"swebench task repo {task_repo}: {error}") from None
    return instance.image_name


def _git(*args: str, where: str) -> str:
    result = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise AgentrlError(f"{where}: git {args[0]} failed: {(result.stderr or result.stdout).strip()[-300:]}")
    return result.stdout


DOCKERFILE = """# Built by `agentrl env swebench-image` from the row {instance_id}: {repo} at {base_commit} over {env_image}.
FROM {env_image}
COPY testbed /testbed
RUN git config --global --add safe.directory /testbed
WORKDIR /testbed
"""  # noqa: E501 (the image's Dockerfile, as it is written)


def _build_from_source(instance: Any, source: str, env_image: str) -> str:
    from agentrl.hub.images import build_image

    where = f"{instance.instance_id} from {source}"
    with tempfile.TemporaryDirectory(prefix="agentrl-swebench-") as folder:
        testbed = Path(folder) / "testbed"
        _git("clone", "--quiet", "--no-checkout", source, str(testbed), where=where)
        known = subprocess.run(["git", "-C", str(testbed), "cat-file", "-e", f"{instance.base_commit}^{{commit}}"],
                               capture_output=True, check=False)
        if known.returncode != 0:
            raise AgentrlError(f"{where}: the source has no commit {instance.base_commit} (the row's base_commit); "
                               "give a mirror of the project that holds it")
        _git("-C", str(testbed), "checkout", "--quiet", "--detach", instance.base_commit, where=where)
        _git("-C", str(testbed), "remote", "remove", "origin", where=where)
        (Path(folder) / "Dockerfile").write_text(DOCKERFILE.format(
            instance_id=instance.instance_id, repo=instance.repo, base_commit=instance.base_commit,
            env_image=env_image))
        build_image(folder, dockerfile="Dockerfile", tag=instance.image_name, network=False)
    return instance.image_name


def get_swebench_images(source: str | Path, *, instances: list[str] | None = None, task_repo: str | None = None,
                        git_source: str | None = None, env_image: str | None = None, network: bool = False,
                        namespace: str | None = None, log: Callable[[str], None] = lambda line: None) -> list[str]:
    """Pull, or build, the image of each row of `source` (those named by `instances`); returns the images."""
    if (git_source is None) != (env_image is None):
        raise AgentrlError("--source and --env-image go together: the project's git source and the image holding "
                           "its environment")
    if task_repo is not None and git_source is not None:
        raise AgentrlError("give --task-repo or --source/--env-image, not both")
    rows = swebench_instances(source, namespace=namespace)
    if instances:
        known = {row.instance_id for row in rows}
        missing = [name for name in instances if name not in known]
        if missing:
            raise NotFoundError(f"{source}: no row {missing[0]!r} (it has {', '.join(sorted(known)[:5])}...)")
        rows = [row for row in rows if row.instance_id in instances]
    built = []
    for row in rows:
        if task_repo is not None:
            image = _build_from_task_repo(row, task_repo, network=network)
            log(f"built {image} from the task repo {task_repo}")
        elif git_source is not None:
            if shutil.which("git") is None:
                raise AgentrlError("--source needs git on this machine")
            image = _build_from_source(row, git_source, env_image)
            log(f"built {image}: {row.repo} at {row.base_commit[:12]} over {env_image}")
        else:
            image = _pull(row.image_name)
            log(f"pulled {image}")
        built.append(image)
    return built
