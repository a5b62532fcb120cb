"""Sandbox images: build from a package's Dockerfile, push to an OCI registry, pull by digest, check presence.

Builds and pushes go through the Docker engine (docker SDK). Presence checks ask the
registry directly (`HEAD /v2/<repository>/manifests/<tag or digest>`, the OCI distribution
API) so `agentrl env check` works without pulling anything; images named without a
registry are looked up in the local engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentrl.errors import AgentrlError, NotFoundError

__all__ = ["ImageRef", "parse_image", "build_image", "push_image", "pull_image_by_digest", "registry_has",
           "ImageCheck", "check_package_images", "docker_client", "row_images"]

_MANIFEST_TYPES = ", ".join([
    "application/vnd.oci.image.manifest.v1+json", "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json", "application/vnd.docker.distribution.manifest.list.v2+json",
])


@dataclass(frozen=True)
class ImageRef:
    """An image reference split into registry (None: local engine / Docker Hub), repository, tag, digest."""

    registry: str | None
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        base = f"{self.registry}/{self.repository}" if self.registry else self.repository
        return base + (f"@{self.digest}" if self.digest else f":{self.tag or 'latest'}")


def parse_image(text: str) -> ImageRef:
    """Split `[registry/]repository[:tag][@digest]`."""
    rest, digest = (text.split("@", 1) + [None])[:2] if "@" in text else (text, None)
    first, _, remainder = rest.partition("/")
    registry = None
    if remainder and ("." in first or ":" in first or first == "localhost"):
        registry, rest = first, remainder
    tag = None
    last = rest.rsplit("/", 1)[-1]
    if ":" in last:
        rest, tag = rest.rsplit(":", 1)
    if not rest:
        raise AgentrlError(f"image {text!r}: no repository name")
    return ImageRef(registry, rest, tag, digest)


def docker_client():
    """A docker SDK client, or a one-line error saying the engine is not reachable."""
    import docker

    try:
        client = docker.from_env(timeout=300)
        client.ping()
    except Exception as error:  # noqa: BLE001 - any failure means the engine is unusable
        raise AgentrlError(f"Docker engine not reachable ({type(error).__name__}); start dockerd "
                           "(scripts/start-dockerd.sh) or set DOCKER_HOST") from None
    return client


def build_image(context_dir: str | Path, *, dockerfile: str, tag: str, network: bool = False) -> str:
    """Build `dockerfile` (relative to `context_dir`; its folder is the build context) as `tag`; returns the id."""
    import docker

    client = docker_client()
    dockerfile_path = Path(context_dir) / dockerfile  # the build context is the Dockerfile's folder (as Harbor's)
    if not dockerfile_path.is_file():
        raise NotFoundError(f"{dockerfile_path}: Dockerfile not found")
    try:
        image, _ = client.images.build(
            path=str(dockerfile_path.parent),
            dockerfile=dockerfile_path.name,
            tag=tag,
            rm=True,
            forcerm=True,
            network_mode=None if network else "none",
        )
    except docker.errors.BuildError as error:
        lines = [str(chunk.get("stream") or chunk.get("error") or "").strip() for chunk in error.build_log]
        tail = " | ".join(line for line in lines if line)[-400:]
        raise AgentrlError(f"{Path(context_dir) / dockerfile}: image build failed: {error.msg} ({tail})") from None
    except docker.errors.APIError as error:
        raise AgentrlError(f"{Path(context_dir) / dockerfile}: image build failed: {error.explanation}") from None
    return image.id


def push_image(local_tag: str, *, registry: str) -> tuple[str, str]:
    """Tag `local_tag` into `registry` and push it; returns (remote reference, manifest digest)."""
    import docker

    client = docker_client()
    ref = parse_image(local_tag)
    repository = f"{registry}/{ref.repository}"
    tag = ref.tag or "latest"
    try:
        client.images.get(local_tag).tag(repository, tag=tag)
    except docker.errors.ImageNotFound:
        raise NotFoundError(f"image {local_tag!r} is not in the local engine; build it first") from None
    digest = None
    for chunk in client.images.push(repository, tag=tag, stream=True, decode=True):
        if "error" in chunk:
            raise AgentrlError(f"push of {repository}:{tag} failed: {chunk['error']} (is the registry "
                               f"{registry} running?)")
        digest = (chunk.get("aux") or {}).get("Digest", digest)
    if digest is None:
        raise AgentrlError(f"push of {repository}:{tag} reported no digest")
    return f"{repository}:{tag}", digest


def pull_image_by_digest(image: str, digest: str) -> str:
    """Pull `repository@digest` and check the engine reports that digest; returns the reference."""
    import docker

    ref = parse_image(image)
    base = f"{ref.registry}/{ref.repository}" if ref.registry else ref.repository
    reference = f"{base}@{digest}"
    client = docker_client()
    try:
        pulled = client.images.pull(reference)
    except docker.errors.APIError as error:
        raise NotFoundError(f"image {reference}: pull failed: {error.explanation}") from None
    if not any(entry.endswith("@" + digest) for entry in pulled.attrs.get("RepoDigests", [])):
        raise AgentrlError(f"image {reference}: the engine reports digests {pulled.attrs.get('RepoDigests')}, "
                           f"not {digest}")
    return reference


def registry_has(image: str | ImageRef) -> bool:
    """Whether the image exists: in its registry (HTTP HEAD on the manifest), else in the local engine."""
    import httpx

    ref = parse_image(image) if isinstance(image, str) else image
    if ref.registry is None:
        import docker

        try:
            docker_client().images.get(str(ref))
            return True
        except docker.errors.ImageNotFound:
            return False
    host = ref.registry.split(":")[0]
    scheme = "http" if host in ("127.0.0.1", "localhost") else "https"
    url = f"{scheme}://{ref.registry}/v2/{ref.repository}/manifests/{ref.reference}"
    try:
        response = httpx.head(url, headers={"Accept": _MANIFEST_TYPES}, timeout=10)
    except httpx.HTTPError as error:
        raise AgentrlError(f"registry {ref.registry} not reachable ({type(error).__name__}); is it running?") from None
    if response.status_code == 200:
        return True
    if response.status_code == 404:
        return False
    raise AgentrlError(f"registry {ref.registry}: HTTP {response.status_code} for {ref}")


@dataclass
class ImageCheck:
    """One image a package needs and whether it was found."""

    image: str
    source: str
    """Where the package names it: 'manifest' or 'rows <split>'."""
    present: bool
    where: str
    """Which registry (or 'local engine') was asked."""


def row_images(row: dict) -> list[str]:
    """The images a task row names (`image_name`, `image`, in the row or its info)."""
    import json

    names = [row.get("image_name"), row.get("image")]
    info = row.get("info")
    if isinstance(info, str) and info.strip().startswith("{"):
        info = json.loads(info)
    if isinstance(info, dict):
        names += [info.get("image_name"), info.get("image")]
    return [name for name in names if isinstance(name, str) and name]


def check_package_images(target: str | Path, *, registry: str | None = None) -> list[ImageCheck]:
    """Every image named by a package's manifest or task rows, with whether it exists."""
    from agentrl.hub.install import resolve_package_dir
    from agentrl.hub.manifest import load_manifest
    from agentrl.hub.package import build_dataset

    folder = resolve_package_dir(target)
    manifest = load_manifest(folder)
    wanted: dict[str, str] = {}
    if manifest.sandbox is not None:
        image = manifest.sandbox.image
        if manifest.sandbox.digest:
            ref = parse_image(image)
            image = str(ImageRef(ref.registry, ref.repository, None, manifest.sandbox.digest))
        wanted[image] = "manifest"
    for split, dataset in sorted(build_dataset(folder, manifest=manifest).items()):
        for row in dataset:
            for name in row_images(row):
                wanted.setdefault(name, f"rows {split}")
    results = []
    for name, source in wanted.items():
        ref = parse_image(name)
        if ref.registry is None and registry:
            ref = ImageRef(registry, ref.repository, ref.tag, ref.digest)
        results.append(ImageCheck(str(ref), source, registry_has(ref), ref.registry or "local engine"))
    return results
