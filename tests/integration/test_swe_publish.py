"""Publishing the swe environment: its per-project images go to a real registry on 127.0.0.1,
`check_package_images` finds them there by the names the task rows use, and the package
itself is pushed to a local hub, pulled back with verified hashes and loaded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import agentrl
from agentrl.hub.images import check_package_images, registry_has
from agentrl.hub.local import LocalHub
from agentrl.hub.publish import pull_package, push_package
from tests.fakes.hub_fixtures import docker_client, registry, remove_images  # noqa: F401

SWE_DIR = Path(__file__).resolve().parents[2] / "environments" / "swe"
pytestmark = pytest.mark.integration


def test_swe_images_and_package_publish(tmp_path, monkeypatch, registry, remove_images):  # noqa: F811
    sys.path[:0] = [str(SWE_DIR), str(SWE_DIR / "tests")]
    from swe_images import push_images
    from swe_testlib import build_sample_images

    images = build_sample_images()
    pushed = push_images(list(images), registry=registry.address)
    remove_images += [remote for _, remote, _ in pushed]
    for local, remote, digest in pushed:
        assert remote == f"{registry.address}/{local}" and digest.startswith("sha256:")
        assert registry_has(f"{remote.rsplit(':', 1)[0]}@{digest}")

    checks = {check.image: check.present for check in check_package_images(SWE_DIR, registry=registry.address)}
    for _, remote, _ in pushed:
        assert checks[remote] is True
    assert sum(checks.values()) == len(pushed) < len(checks)  # the other projects' images were not pushed

    monkeypatch.setenv("AGENTRL_HUB", str(tmp_path / "hub"))
    hub = LocalHub()
    result = push_package(SWE_DIR, hub=hub, owner="alice")
    assert result.published
    assert not push_package(SWE_DIR, hub=hub, owner="alice").published  # unchanged content: no-op
    pulled = pull_package("alice/swe", hub=hub, destination=tmp_path / "pulled")
    env = agentrl.load_environment(str(pulled))
    assert len(env.get_dataset("test")) == len(agentrl.load_environment("swe").get_dataset("test"))
