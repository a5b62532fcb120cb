"""Local hub: immutable versions, no-op re-push, refused collisions, verified pulls, atomic and concurrent pushes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agentrl.hub.local import LocalHub
from agentrl.hub.package import HashMismatchError
from agentrl.hub.publish import STAGE_DELAY_ENV, VersionConflictError, list_packages, pull_package, push_package
from agentrl.hub.refs import PackageRef, find_installed
from tests.fakes.toy_package import write_toy_package


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_HUB", str(tmp_path / "hub"))
    return LocalHub()


def _cli(*args, env_extra=None, hub_root=None, **kwargs):
    env = dict(os.environ, **(env_extra or {}))
    if hub_root is not None:
        env["AGENTRL_HUB"] = str(hub_root)
    return subprocess.Popen([sys.executable, "-m", "agentrl.cli", "env", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_push_list_pull_roundtrip(hub, tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    result = push_package(package, hub=hub, owner="alice")
    assert result.published and result.ref == PackageRef("alice", "toy-echo", "0.1.0")
    assert hub.versions(PackageRef("alice", "toy-echo")) == ["0.1.0"]
    rows = list_packages(hub, tag="toy")
    assert [r["ref"] for r in rows] == ["alice/toy-echo"]
    assert list_packages(hub, search="no-such-thing") == []
    target = pull_package("alice/toy-echo", hub=hub)
    assert target == find_installed("alice/toy-echo") == find_installed("alice/toy-echo@0.1.0")
    assert (target / "data" / "train.jsonl").read_text() == (package / "data" / "train.jsonl").read_text()


def test_unchanged_push_is_noop_and_changed_content_is_refused(hub, tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    first = push_package(package, hub=hub, owner="alice")
    stored = hub.packages_dir / "alice" / "toy-echo" / "0.1.0"
    mtime = stored.stat().st_mtime_ns
    again = push_package(package, hub=hub, owner="alice")
    assert not again.published and again.content_hash == first.content_hash
    assert stored.stat().st_mtime_ns == mtime
    (package / "toy_echo.py").write_text("# different\n" + (package / "toy_echo.py").read_text())
    with pytest.raises(VersionConflictError, match="already published with content hash"):
        push_package(package, hub=hub, owner="alice")
    # a new version of the changed content is fine; the old version is untouched
    (package / "environment.toml").write_text((package / "environment.toml").read_text().replace("0.1.0", "0.2.0"))
    assert push_package(package, hub=hub, owner="alice").published
    assert hub.versions(PackageRef("alice", "toy-echo")) == ["0.1.0", "0.2.0"]
    assert "# different" not in (stored / "toy_echo.py").read_text()


def test_corrupted_file_in_hub_fails_pull(hub, tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    push_package(package, hub=hub, owner="alice")
    stored = hub.packages_dir / "alice" / "toy-echo" / "0.1.0" / "dataset" / "train.parquet"
    stored.write_bytes(stored.read_bytes()[:-8] + b"garbage!")
    with pytest.raises(HashMismatchError, match="train.parquet: sha256"):
        pull_package("alice/toy-echo@0.1.0", hub=hub)
    assert not (hub.root / "installed" / "alice" / "toy-echo" / "0.1.0").exists(), "nothing half-installed"
    assert not any(p.name.startswith(".pull-") for p in (hub.root / "installed" / "alice" / "toy-echo").iterdir())


def test_push_killed_midway_leaves_no_partial_version(hub, tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    process = _cli("push", str(package), "--repo", "alice/toy-echo", hub_root=hub.root,
                   env_extra={STAGE_DELAY_ENV: "30"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the push is midway through staging
            staged = list(hub.staging_root.glob("*/*")) if hub.staging_root.is_dir() else []
            if staged:
                break
            assert process.poll() is None, process.communicate()
            time.sleep(0.1)
        else:
            pytest.fail("push never started staging")
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert hub.versions(PackageRef("alice", "toy-echo")) == []
    assert not (hub.packages_dir / "alice" / "toy-echo" / "0.1.0").exists()
    # the next push sweeps the dead push's staging folder and publishes the whole version
    assert push_package(package, hub=hub, owner="alice").published
    assert list(hub.staging_root.iterdir()) == []
    pull_package("alice/toy-echo", hub=hub)


def test_concurrent_pushes_publish_once(hub, tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    processes = [_cli("push", str(package), "--repo", "alice/toy-echo", hub_root=hub.root) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    states = sorted(out.strip().splitlines()[-1].split(":")[0] for out, _ in outputs)
    assert states == ["published", "unchanged"], outputs
    assert hub.versions(PackageRef("alice", "toy-echo")) == ["0.1.0"]
    pull_package("alice/toy-echo", hub=hub)


def test_concurrent_pushes_of_different_content_one_refused(hub, tmp_path):
    first = write_toy_package(tmp_path / "a", rows=3)
    second = write_toy_package(tmp_path / "b", rows=4)
    processes = [_cli("push", str(p), "--repo", "alice/toy-echo", hub_root=hub.root) for p in (first, second)]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert sorted(p.returncode for p in processes) == [0, 2], outputs
    refused = next(err for (out, err), p in zip(outputs, processes) if p.returncode == 2)
    assert "versions are immutable" in refused and "Traceback" not in refused


def test_cli_errors_are_one_line(hub, tmp_path):
    package = write_toy_package(tmp_path / "pkg", extra_manifest="colour = 1")
    process = _cli("validate", str(package), hub_root=hub.root)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2 and "unknown key 'colour'" in err and len(err.strip().splitlines()) == 1
    process = _cli("pull", "alice/nothing", hub_root=hub.root)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 2 and "no such package" in err and len(err.strip().splitlines()) == 1
    process = _cli("versions", "alice/nothing", hub_root=hub.root)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and "no published versions" in err
