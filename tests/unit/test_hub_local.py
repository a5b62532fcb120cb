"""Local hub: immutable versions, no-op re-push, refused collisions, verified pulls, atomic and concurrent pushes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from agentrl.errors import AgentrlError
from agentrl.hub.local import LocalHub
from agentrl.hub.package import LOCK_NAME, HashMismatchError
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


def _tampered(hub, tmp_path, change) -> str:
    """Push the toy package, change its stored version with `change(folder)`, and return pull's error."""
    push_package(write_toy_package(tmp_path / "pkg"), hub=hub, owner="alice")
    change(hub.packages_dir / "alice" / "toy-echo" / "0.1.0")
    with pytest.raises(HashMismatchError) as error:
        pull_package("alice/toy-echo@0.1.0", hub=hub, destination=tmp_path / "pulled")
    assert not (tmp_path / "pulled").exists() and not list(tmp_path.glob(".pull-*")), "nothing half-pulled"
    assert "\n" not in str(error.value)
    return str(error.value)


def _lock(folder, edit):
    lock = json.loads((folder / LOCK_NAME).read_text())
    edit(lock)
    (folder / LOCK_NAME).write_text(json.dumps(lock))


def _hidden_pyc(folder):
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "toy_echo.cpython-311.pyc").write_bytes(b"not reviewed")


def _outside_path(folder):
    _lock(folder, lambda lock: lock["files"].update({"../outside.txt": "0" * 64}))


@pytest.mark.parametrize(("change", "message"), [
    # a file the lock does not list, even where packaging skips caches: it would run instead of the reviewed source
    (_hidden_pyc, r"__pycache__/toy_echo\.cpython-311\.pyc: file not in the published package"),
    (lambda folder: (folder / "dataset" / "notes.txt").write_text("x"), r"dataset/notes\.txt: file not in the"),
    # the lock's own fields, each checked: one line, never a traceback
    (_outside_path, r"unreadable lock file \(files names '\.\./outside\.txt', not a path inside the package\)"),
    (lambda folder: _lock(folder, lambda lock: lock["files"].update({"/etc/hostname": "0" * 64})),
     r"files names '/etc/hostname'"),
    (lambda folder: _lock(folder, lambda lock: lock.update(files=list(lock["files"]))), r"\(files is list\)"),
    (lambda folder: _lock(folder, lambda lock: lock["files"].update({"toy_echo.py": 5})),
     r"files\['toy_echo\.py'\] is not a sha256"),
    (lambda folder: _lock(folder, lambda lock: lock.update(content_hash=5)), r"\(content_hash is int\)"),
    # links and special files in the hub's copy: refused before anything is copied (no host file read)
    (lambda folder: (folder / "dataset" / "leak").symlink_to("/etc/hostname"),
     r"dataset/leak: a symbolic link in a published package"),
    (lambda folder: (folder / "dataset" / "usr").symlink_to("/usr"), r"dataset/usr: a symbolic link"),
    (lambda folder: os.mkfifo(folder / "dataset" / "pipe"), r"dataset/pipe: not a regular file or folder"),
], ids=["pycache", "unlisted", "dotdot", "absolute", "files-list", "sha-int", "hash-int", "link-file",
        "link-folder", "fifo"])
def test_a_tampered_hub_copy_is_refused_in_one_line(hub, tmp_path, change, message):
    assert re.search(message, _tampered(hub, tmp_path, change))


@pytest.mark.parametrize(("field", "value"), [
    ("splits", "/etc/private/heldout.jsonl"), ("splits", "../private/heldout.jsonl"),
    ("splits", ".git/train.jsonl"),  # packaging skips .git, so a link there was read and its rows published
    ("dockerfile", "../Dockerfile"),
])
def test_files_the_manifest_names_must_be_inside_the_package(hub, tmp_path, field, value):
    """A split file outside the package (or reached through a link) would publish a host file's rows."""
    package = write_toy_package(tmp_path / "pkg", base_image="agentrl-base:bookworm" if field == "dockerfile" else None)
    if value.startswith(".git/"):
        (package / ".git").mkdir()
        (package / ".git" / "train.jsonl").symlink_to(package / "data" / "train.jsonl")
    manifest = package / "environment.toml"
    text = manifest.read_text()
    if field == "splits":
        text = text.replace('train = "data/train.jsonl"', f'train = "{value}"')
    else:
        text = re.sub(r'dockerfile = "[^"]*"', f'dockerfile = "{value}"', text)
    manifest.write_text(text)
    with pytest.raises(AgentrlError, match=r"must be a path inside the package|is a symbolic link") as error:
        push_package(package, hub=hub, owner="alice")
    assert "\n" not in str(error.value) and not hub.versions(PackageRef("alice", "toy-echo"))


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
