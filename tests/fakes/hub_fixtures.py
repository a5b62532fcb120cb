"""Pytest fixtures for the hub's integration tests: a real registry, a tiny base image, docker clean-up.

Import the fixtures into a test module (`from tests.fakes.hub_fixtures import registry, ...`).
Nothing here is fake: the registry is Debian's `docker-registry` on 127.0.0.1 (its own config
and storage under a temporary folder, stopped by its handle) and the images are built by the
real Docker engine. The base image is a 3-byte `docker import` of one file, so builds and
pushes take about a second; the image code does not depend on what the base contains.
"""

from __future__ import annotations

import io
import tarfile

import pytest

TINY_BASE = "agentrl-hubtest-base:tiny"


def _docker_or_skip():
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"no Docker engine: {error}")
    return client


@pytest.fixture(scope="session")
def docker_client():
    """The Docker engine (skips when none runs)."""
    return _docker_or_skip()


@pytest.fixture(scope="session")
def tiny_base_image(docker_client) -> str:
    """A one-file image made with `docker import` (no registry needed)."""
    import docker

    try:
        docker_client.images.get(TINY_BASE)
        return TINY_BASE
    except docker.errors.ImageNotFound:
        pass
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        data = b"hi\n"
        info = tarfile.TarInfo("hello.txt")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    repository, tag = TINY_BASE.split(":")
    docker_client.api.import_image_from_data(buffer.getvalue(), repository=repository, tag=tag)
    return TINY_BASE


@pytest.fixture(scope="session")
def registry(tmp_path_factory, docker_client):
    """Debian's docker-registry on 127.0.0.1 (port 5000, or a free one when taken)."""
    from agentrl.hub.registry import LocalRegistry

    server = LocalRegistry(tmp_path_factory.mktemp("registry"), port=5000)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def remove_images(docker_client):
    """Collects image references; removes them from the engine after the test."""
    import docker

    names: list[str] = []
    yield names
    for name in names:
        try:
            docker_client.images.remove(name, force=True)
        except docker.errors.APIError:
            pass
