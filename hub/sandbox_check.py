"""Before a run starts: the sandboxes its environment needs are on this machine, else one line with the command
that makes them.

`check_sandboxes(env)` looks at an environment's sandbox config (a `SandboxEnv`'s; other
environments need none): for Docker, every image its task rows name (else the config's image)
must be in the local engine (a sandbox never pulls); for bubblewrap, the base root filesystem
must exist. What is missing raises `NotFoundError` naming the first missing image, how many
are missing, and the exact command that builds them:

- the base image / rootfs (`agentrl-base:bookworm`): `agentrl sandbox build-base`;
- a package whose manifest names a build script (`[sandbox] build_script`, e.g. swe's
  `swe_images.py`): `python3 <package>/<script>` (after `agentrl sandbox build-base` when the
  base image is missing too);
- a package with a Dockerfile: `agentrl env build <package>`;
- otherwise (images from elsewhere, e.g. SWE-bench's): pull or build them; `agentrl env check` lists them.

A Harbor package's environment gives a sandbox config per task (`sandbox_config(task)`) and its
images by `image(task)`; those are checked the same way under Docker. `agentrl train` and
`agentrl eval` run it before anything slow starts (no run folder is written), so a fresh
clone's `agentrl train --env swe` stops at once with the command instead of failing every
rollout of its first steps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from agentrl.errors import NotFoundError

__all__ = ["build_command", "check_sandboxes", "missing_images"]


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is under it (a checkout's `environments/swe/...`)."""
    path = path.resolve()
    return os.path.relpath(path) if path.is_relative_to(Path.cwd().resolve()) else str(path)


def _wanted_images(env: Any, config: Any) -> list[str]:
    """The images the task rows name (one per task in swe), else the one the sandbox config starts from."""
    from agentrl.hub.images import row_images

    wanted: dict[str, None] = {}
    for split in env.splits:
        for row in env.get_dataset(split):
            wanted.update(dict.fromkeys(row_images(row)))
    return list(wanted) or [config.image]


def missing_images(images: list[str]) -> list[str]:
    """The images the local Docker engine lacks (one-line error when no engine answers)."""
    import docker

    from agentrl.sandbox.docker_engine import docker_client

    client = docker_client()
    missing = []
    for image in images:
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            missing.append(image)
    return missing


def build_command(env: Any, missing: list[str]) -> str | None:
    """The command that builds `missing` images of `env`'s package (None: it has no recipe for them)."""
    from agentrl.sandbox.base import BASE_IMAGE

    base = "agentrl sandbox build-base"
    manifest = getattr(env, "manifest", None)
    spec = manifest.sandbox if manifest is not None else None
    folder = Path(env.path) if getattr(env, "path", None) else None
    if all(image == BASE_IMAGE for image in missing):
        return base
    prefix = f"{base} && " if BASE_IMAGE in missing else ""
    if spec is not None and folder is not None and spec.build_script:
        return f"{prefix}python3 {_shown(folder / spec.build_script)}"
    if spec is not None and folder is not None and spec.dockerfile:
        return f"{prefix}agentrl env build {_shown(folder)}"
    return None


def check_sandboxes(env: Any) -> None:
    """Raise `NotFoundError` (one line, with the build command) when `env`'s sandboxes cannot start here."""
    from agentrl.sandbox import SandboxConfig

    config = getattr(env, "sandbox_config", None)
    images = None
    if callable(config) and callable(getattr(env, "image", None)):  # Harbor's: a config per task and phase
        tasks = [task for split in env.splits for task in env.tasks(split)]
        if not tasks:
            return
        config, images = config(tasks[0]), list(dict.fromkeys(env.image(task) for task in tasks))
        if config.type != "docker":  # bwrap runs the task image's exported tree; its export says what is missing
            return
    if not isinstance(config, SandboxConfig):
        return
    name = getattr(env, "name", "?")
    if config.type == "bwrap":
        from agentrl.sandbox.base_image import rootfs_dir

        rootfs = Path(config.rootfs) if config.rootfs else rootfs_dir()
        if not (rootfs / "bin" / "sh").exists():
            raise NotFoundError(f"env {name!r}: the bubblewrap root filesystem {rootfs} is missing; "
                                "build it: agentrl sandbox build-base")
        return
    if config.type != "docker":
        return
    images = images or _wanted_images(env, config)
    missing = missing_images(images)
    if missing:
        command = build_command(env, missing)
        folder = getattr(env, "path", None)
        hint = getattr(env, "missing_image_hint", None)  # an environment that knows where its images come from
        said = hint(missing[0]) if command is None and callable(hint) else None
        fix = (f"build them: {command}" if command else said or
               f"pull or build them (agentrl env check {_shown(Path(folder)) if folder else name} lists them)")
        raise NotFoundError(f"env {name!r}: {len(missing)} of {len(images)} sandbox images are not in the local "
                            f"Docker engine (first: {missing[0]}); {fix}")
