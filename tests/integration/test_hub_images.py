"""Images: build from the package Dockerfile, push to a real registry on 127.0.0.1, digest recorded, pull by
digest, and `agentrl env check` reporting missing images. Real Docker engine, real `docker-registry`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agentrl.hub.images import parse_image, registry_has
from agentrl.hub.local import LocalHub
from agentrl.hub.manifest import load_manifest
from agentrl.hub.publish import pull_package, push_package
from tests.fakes.hub_fixtures import docker_client, registry, remove_images, tiny_base_image  # noqa: F401
from tests.fakes.toy_package import write_toy_package

pytestmark = pytest.mark.integration


def _cli(*args, hub_root):
    env = dict(os.environ, AGENTRL_HUB=str(hub_root))
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "env", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_push_records_digest_and_pull_by_digest(tmp_path, monkeypatch, registry, tiny_base_image, docker_client,
                                                remove_images):
    monkeypatch.setenv("AGENTRL_HUB", str(tmp_path / "hub"))
    hub = LocalHub()
    package = write_toy_package(tmp_path / "pkg", name="toy-img", base_image=tiny_base_image)
    remote = f"{registry.address}/toy-img:0.1.0"
    remove_images += ["toy-img:0.1.0", remote]
    result = push_package(package, hub=hub, owner="alice", registry=registry.address)
    assert result.published and result.image == remote and result.image_digest.startswith("sha256:")
    assert registry_has(f"{registry.address}/toy-img@{result.image_digest}")

    # the published manifest carries the digest; the local engine's copy reports the same digest
    pulled = pull_package("alice/toy-img", hub=hub)
    sandbox = load_manifest(pulled).sandbox
    assert sandbox.digest == result.image_digest and sandbox.image == remote
    docker_client.images.remove(remote, force=True)
    docker_client.images.remove("toy-img:0.1.0", force=True)
    pull_package("alice/toy-img", hub=hub, pull_image=True)
    by_digest = f"{registry.address}/toy-img@{result.image_digest}"
    remove_images.append(by_digest)
    image = docker_client.images.get(by_digest)
    assert f"{registry.address}/toy-img@{result.image_digest}" in image.attrs["RepoDigests"]

    # unchanged re-push: no rebuild, no new digest
    again = push_package(package, hub=hub, owner="alice", registry=registry.address)
    assert not again.published and again.image_digest == result.image_digest


def test_env_check_reports_missing_images(tmp_path, registry, tiny_base_image, remove_images):
    package = write_toy_package(tmp_path / "pkg", name="toy-check", base_image=tiny_base_image)
    remove_images += ["toy-check:0.1.0", f"{registry.address}/toy-check:0.1.0"]
    # two rows name images: one that will be pushed, one that never exists
    rows = [json.loads(line) for line in (package / "data" / "train.jsonl").read_text().splitlines()]
    rows[0]["image_name"] = f"{registry.address}/toy-check:0.1.0"
    rows[1]["image_name"] = f"{registry.address}/swe-task-1234:latest"
    rows[2]["image_name"] = ""
    rows[2]["info"]["image"] = f"{registry.address}/never-built:1"
    (package / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    before = _cli("check", str(package), hub_root=tmp_path / "hub")
    assert before.returncode == 2
    assert "MISSING toy-check:0.1.0" in before.stdout  # manifest image, not built yet, local engine asked
    assert "3 of 4 images missing" in before.stderr or "4 of 4 images missing" in before.stderr

    pushed = _cli("push", str(package), "--repo", "alice/toy-check", "--registry", registry.address,
                  hub_root=tmp_path / "hub")
    assert pushed.returncode == 0, pushed.stderr
    installed = _cli("pull", "alice/toy-check", hub_root=tmp_path / "hub")
    assert installed.returncode == 0, installed.stderr
    after = _cli("check", "alice/toy-check", hub_root=tmp_path / "hub")
    assert after.returncode == 2, after.stdout
    lines = after.stdout.splitlines()
    assert any(line.startswith("ok") and "toy-check@sha256:" in line for line in lines), lines
    assert any(line.startswith("ok") and "toy-check:0.1.0" in line and "rows train" in line for line in lines)
    missing = sorted(line.split()[1] for line in lines if line.startswith("MISSING"))
    assert missing == [f"{registry.address}/never-built:1", f"{registry.address}/swe-task-1234:latest"]
    assert "2 of 4 images missing" in after.stderr and len(after.stderr.strip().splitlines()) == 1


def test_image_reference_parsing():
    assert parse_image("127.0.0.1:5000/a/b:1").registry == "127.0.0.1:5000"
    assert parse_image("agentrl-base:bookworm") == parse_image("agentrl-base:bookworm")
    ref = parse_image("agentrl/swe@sha256:abc")
    assert (ref.registry, ref.repository, ref.digest) == (None, "agentrl/swe", "sha256:abc")


def test_local_registry_takes_a_free_port_when_the_wanted_one_is_busy(tmp_path):
    import socket

    import httpx

    from agentrl.hub.registry import LocalRegistry

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        server = LocalRegistry(tmp_path / "registry", port=taken)
        assert server.port != taken
        with server:
            assert httpx.get(f"http://{server.address}/v2/", timeout=5).status_code == 200
            process = server.process
        assert server.process is None and process.poll() is not None
