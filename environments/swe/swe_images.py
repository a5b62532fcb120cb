"""Build the per-project sandbox images of the `swe` environment, cached by content.

    python3 environments/swe/swe_images.py [PROJECT ...] [--base-image IMAGE] [--push REGISTRY]

Each image is `FROM agentrl-base:bookworm` (override with `--base-image` or
$AGENTRL_SWE_BASE_IMAGE) plus the project's sdist unpacked into `/testbed` (see
`Dockerfile`). The image carries a label with a hash of everything that went into it
(Dockerfile, sdist digest, source root, base image id); a build whose hash matches the
existing image's label is skipped, so running this again costs a second. With `--push
127.0.0.1:5000` every image is also pushed to that registry (through `agentrl.hub.images`)
and the digests are printed, one `image remote digest` line each.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

from agentrl import env_vars
from agentrl.hub.images import push_image

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from swe_projects import PROJECTS, Project, fetch_sdist, get_project

from agentrl.errors import AgentrlError, NotFoundError

__all__ = ["CONTENT_LABEL", "DEFAULT_BASE_IMAGE", "base_image", "build_cached_image", "build_folder_image", "build_images",
           "build_project_image"]

PACKAGE_DIR = Path(__file__).resolve().parent
DOCKERFILE = PACKAGE_DIR / "Dockerfile"
DEFAULT_BASE_IMAGE = "agentrl-base:bookworm"
CONTENT_LABEL = "agentrl.swe.content"


def base_image() -> str:
    """The base image the project images start from ($AGENTRL_SWE_BASE_IMAGE or agentrl-base:bookworm)."""
    return env_vars.SWE_BASE_IMAGE.get() or DEFAULT_BASE_IMAGE


def _docker_client():
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # docker raises several unrelated types here
        raise AgentrlError(f"swe: no Docker engine reachable ({exc.__class__.__name__}); start dockerd") from exc
    return client


def _content_hash(project: Project, base_id: str) -> str:
    digest = hashlib.sha256()
    for part in (DOCKERFILE.read_bytes(), project.sha256.encode(), project.source_root.encode(), base_id.encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def _base_image_id(client, base: str) -> str:
    import docker

    try:
        return client.images.get(base).id
    except docker.errors.ImageNotFound:
        raise NotFoundError(
            f"swe: base image {base} not found; build it with 'agentrl sandbox build-base' "
            f"or set AGENTRL_SWE_BASE_IMAGE"
        ) from None


def _is_current(client, tag: str, content: str) -> bool:
    """Whether the image `tag` exists and carries the `content` hash."""
    import docker

    try:
        return (client.images.get(tag).labels or {}).get(CONTENT_LABEL) == content
    except docker.errors.ImageNotFound:
        return False


def build_cached_image(client, *, tag: str, context: str | Path, content: str, buildargs: dict[str, str],
                       labels: dict[str, str] | None = None) -> str:
    """Build `context` as `tag` (no network) unless the image already carries the `content` hash; returns `tag`."""
    import docker

    if _is_current(client, tag, content):
        return tag
    try:
        client.images.build(path=str(context), tag=tag, rm=True, forcerm=True, network_mode="none",
                            buildargs=buildargs, labels={CONTENT_LABEL: content, **(labels or {})})
    except docker.errors.BuildError as exc:
        log = "".join(str(chunk.get("stream", "")) for chunk in exc.build_log)[-400:]
        raise AgentrlError(f"swe: building {tag} failed: {' '.join(log.split())}") from None
    return tag


def build_folder_image(folder: str | Path, *, tag: str, base: str | None = None, client=None) -> str:
    """Build (or reuse, by a hash of the folder's files and the base image id) the image of a folder holding a
    Dockerfile whose `FROM ${BASE_IMAGE}` is the base image; returns `tag`."""
    client = client or _docker_client()
    base = base or base_image()
    folder = Path(folder)
    digest = hashlib.sha256(_base_image_id(client, base).encode())
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(b"\0" + str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return build_cached_image(client, tag=tag, context=folder, content=digest.hexdigest()[:32],
                              buildargs={"BASE_IMAGE": base})


def build_project_image(project: Project, *, base: str | None = None, client=None) -> str:
    """Build (or reuse) the project's image and return its name."""
    client = client or _docker_client()
    base = base or base_image()
    content = _content_hash(project, _base_image_id(client, base))
    if _is_current(client, project.image_name, content):  # before fetching the sdist
        return project.image_name
    sdist = fetch_sdist(project)
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-build-") as context:
        shutil.copy(DOCKERFILE, Path(context) / "Dockerfile")
        shutil.copy(sdist, Path(context) / project.sdist)
        return build_cached_image(
            client, tag=project.image_name, context=context, content=content,
            buildargs={"BASE_IMAGE": base, "SDIST": project.sdist, "SOURCE_ROOT": project.source_root},
            labels={"agentrl.swe.project": project.name, "agentrl.swe.version": project.version})


def build_images(names: list[str] | None = None, *, base: str | None = None,
                 progress=None) -> list[str]:
    """Build the images of the named projects (all when None); return their names. `progress(line)` hears of
    each image before its build (and whether the cache has it)."""
    projects = [get_project(name) for name in names] if names else list(PROJECTS)
    client = _docker_client()
    built = []
    for index, project in enumerate(projects, start=1):
        if progress is not None:
            cached = _is_current(client, project.image_name,
                                 _content_hash(project, _base_image_id(client, base or base_image())))
            progress(f"[{index}/{len(projects)}] {project.image_name}: "
                     + ("cached" if cached else "building (pip download of the sdist, then docker build)"))
        built.append(build_project_image(project, base=base, client=client))
    return built


def push_images(names: list[str], *, registry: str) -> list[tuple[str, str, str]]:
    """Push built images to `registry`; returns (local image, remote reference, digest) for each."""
    return [(name, *push_image(name, registry=registry)) for name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the swe environment's per-project sandbox images.")
    parser.add_argument("projects", nargs="*", help="project names (default: all)")
    parser.add_argument("--base-image", default=None, help=f"base image (default: {DEFAULT_BASE_IMAGE})")
    parser.add_argument("--push", default=None, metavar="REGISTRY", help="also push the images to this registry")
    args = parser.parse_args(argv)
    try:
        names = build_images(args.projects or None, base=args.base_image,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
        if args.push:
            for name, remote, digest in push_images(names, registry=args.push):
                print(name, remote, digest)
        else:
            for name in names:
                print(name)
    except AgentrlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
