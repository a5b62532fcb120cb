"""Hugging Face Hub backend through the real `huggingface_hub` client, against a Hub-compatible server.

FAKE: huggingface.co cannot be reached here, so `tests/fakes/hf_hub_server.py` serves the Hub's
HTTP API on 127.0.0.1 (`HF_ENDPOINT`). The endpoints the pinned huggingface_hub calls for
these operations, and which the fake implements (anything else is recorded and failed by
`test_fake_saw_only_known_routes`):

    POST /api/repos/create                              create_repo (private flag)
    POST /api/validate-yaml                             dataset card metadata check
    POST /api/datasets/{owner}/{name}/preupload/main    upload modes
    POST /api/datasets/{owner}/{name}/commit/main       ndjson commit (files + deletions)
    POST /api/datasets/{owner}/{name}/tag/{commit}      create_tag (the version)
    GET  /api/datasets/{owner}/{name}/refs              list_repo_refs (versions)
    GET  /api/datasets/{owner}/{name}/revision/{rev}    repo_info (snapshot_download)
    GET  /api/datasets/{owner}/{name}/tree/{rev}[/dir]  list_repo_tree (upload_folder deletions, snapshot,
                                                        datasets.load_dataset's data-file resolution)
    GET  /api/datasets?filter=agentrl-environment       list_datasets
    GET  /api/agent-harnesses                           the client's user-agent registry
    HEAD|GET /datasets/{owner}/{name}/resolve/{rev}/{path}   file download (also datasets.load_dataset's probes
                                                        for .huggingface.yaml, dataset_infos.json, <name>.py)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agentrl.errors import NotFoundError
from agentrl.hub.hf import TAG_DELAY_ENV, HFHub
from agentrl.hub.loader import builtin_environments_dir
from agentrl.hub.local import LocalHub
from agentrl.hub.manifest import load_manifest
from agentrl.hub.package import DATASET_DIR, HashMismatchError
from agentrl.hub.publish import VersionConflictError, list_packages, pull_package, push_package
from agentrl.hub.refs import PackageRef
from tests.fakes.hf_hub_server import FakeHubServer
from tests.fakes.hub_fixtures import docker_client, registry, remove_images, tiny_base_image  # noqa: F401
from tests.fakes.toy_package import write_toy_package

pytestmark = pytest.mark.integration
TOKEN = "hf_fake_token_alice"


@pytest.fixture(scope="module")
def fake_hub():
    server = FakeHubServer(tokens={TOKEN: "alice", "hf_fake_token_bob": "bob"}).start()
    yield server
    server.stop()


@pytest.fixture
def hf_env(fake_hub, tmp_path, monkeypatch):
    """Point huggingface_hub at the fake (endpoint, token, a private HF_HOME) and agentrl at a temp hub."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", fake_hub.endpoint)
    # what huggingface_hub computes from HF_ENDPOINT at import time (it may be imported already)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", fake_hub.endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        fake_hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", fake_hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("AGENTRL_HUB", str(tmp_path / "agentrl-hub"))
    return fake_hub


def _bump(package, version):
    manifest = package / "environment.toml"
    manifest.write_text(manifest.read_text().replace('version = "0.1.0"', f'version = "{version}"'))


async def test_builtin_environment_roundtrip_through_hf(hf_env, tmp_path):
    import datasets

    import agentrl
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    hub = HFHub()
    source = builtin_environments_dir() / "reverse_text"
    result = push_package(source, hub=hub, owner="alice")
    assert result.published
    assert not push_package(source, hub=hub, owner="alice").published
    assert [row["ref"] for row in list_packages(hub)] == ["alice/reverse-text"]
    assert [row["ref"] for row in list_packages(hub, tag="toy")] == ["alice/reverse-text"]
    assert list_packages(hub, tag="no-such-tag") == []

    info = hf_env.repos[("dataset", "alice/reverse-text")]
    card = info.card_data(info.tags["0.1.0"])
    assert "agentrl-environment" in card["tags"] and card["agentrl"]["content_hash"] == result.content_hash
    assert {f["split"] for f in card["configs"][0]["data_files"]} == {"train", "test"}

    pulled = pull_package("alice/reverse-text@0.1.0", hub=hub)
    env = agentrl.load_environment(pulled)
    source_env = agentrl.load_environment(source)
    for split in ("train", "test"):
        rows = datasets.Dataset.from_parquet(str(pulled / DATASET_DIR / f"{split}.parquet")).to_list()
        assert rows == source_env.get_dataset(split).to_list() == env.get_dataset(split).to_list()
    # the repo is a regular HF dataset too: `datasets.load_dataset` reads the card's configs
    loaded = datasets.load_dataset("alice/reverse-text", revision="0.1.0", cache_dir=str(tmp_path / "ds-cache"))
    assert sorted(loaded) == ["test", "train"]
    assert loaded["test"].to_list() == source_env.get_dataset("test").to_list()
    task = env.tasks("test", n=1)[0]
    [rollout] = await env.run_group(ScriptedPolicy([task.answer]), task, n=1, sampling=SamplingConfig())
    assert rollout.error is None and rollout.reward > 0.99


def test_both_backends_give_identical_rows_and_image_digests(hf_env, tmp_path, registry, tiny_base_image,
                                                             remove_images):
    import datasets

    package = write_toy_package(tmp_path / "pkg", name="toy-both", base_image=tiny_base_image, rows=6)
    remove_images += ["toy-both:0.1.0", f"{registry.address}/toy-both:0.1.0"]
    local_hub, hf_hub = LocalHub(), HFHub()
    local = push_package(package, hub=local_hub, owner="alice", registry=registry.address)
    remote = push_package(package, hub=hf_hub, owner="alice", registry=registry.address)
    assert local.content_hash == remote.content_hash
    assert local.image_digest == remote.image_digest and local.image_digest.startswith("sha256:")
    from_local = pull_package("alice/toy-both", hub=local_hub, destination=tmp_path / "from-local")
    from_hf = pull_package("alice/toy-both", hub=hf_hub, destination=tmp_path / "from-hf")
    assert load_manifest(from_local).sandbox.digest == load_manifest(from_hf).sandbox.digest == local.image_digest
    read = lambda folder: datasets.Dataset.from_parquet(str(folder / DATASET_DIR / "train.parquet")).to_list()  # noqa
    assert read(from_local) == read(from_hf) and len(read(from_hf)) == 6
    import asyncio

    import agentrl
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    for folder in (from_local, from_hf):  # both pulled copies load and score the same way
        env = agentrl.load_environment(folder)
        task = env.tasks("test")[4]
        [right] = asyncio.run(env.run_group(ScriptedPolicy([task.answer]), task, n=1, sampling=SamplingConfig()))
        assert right.error is None and right.reward == 1.0


def test_versions_are_tags_and_each_holds_a_whole_package(hf_env, tmp_path):
    hub = HFHub()
    package = write_toy_package(tmp_path / "pkg", name="toy-versions")
    (package / "old_helper.py").write_text("X = 1\n")
    push_package(package, hub=hub, owner="alice")
    (package / "old_helper.py").unlink()
    _bump(package, "0.2.0")
    push_package(package, hub=hub, owner="alice")
    assert hub.versions(PackageRef("alice", "toy-versions")) == ["0.1.0", "0.2.0"]
    old = pull_package("alice/toy-versions@0.1.0", hub=hub)
    new = pull_package("alice/toy-versions", hub=hub)
    assert (old / "old_helper.py").is_file() and not (new / "old_helper.py").exists()
    assert load_manifest(new).version == "0.2.0"
    with pytest.raises(NotFoundError, match="no version '9.9.9'"):
        pull_package("alice/toy-versions@9.9.9", hub=hub)


def test_collision_with_different_content_is_refused(hf_env, tmp_path):
    hub = HFHub()
    package = write_toy_package(tmp_path / "pkg", name="toy-collide")
    push_package(package, hub=hub, owner="alice")
    (package / "toy_echo.py").write_text("# changed\n" + (package / "toy_echo.py").read_text())
    with pytest.raises(VersionConflictError, match="versions are immutable"):
        push_package(package, hub=hub, owner="alice")
    assert hub.versions(PackageRef("alice", "toy-collide")) == ["0.1.0"]


def test_corrupted_file_on_the_hub_fails_the_hash_check(hf_env, tmp_path):
    hub = HFHub()
    package = write_toy_package(tmp_path / "pkg", name="toy-corrupt")
    push_package(package, hub=hub, owner="alice")
    hf_env.corrupt_file("alice/toy-corrupt", "data/train.jsonl", revision="0.1.0")
    with pytest.raises(HashMismatchError, match="train.jsonl: sha256 .* does not match"):
        pull_package("alice/toy-corrupt", hub=hub)
    assert not (tmp_path / "agentrl-hub" / "installed" / "alice" / "toy-corrupt" / "0.1.0").exists()


def test_private_repo_needs_the_owner_token(hf_env, tmp_path, monkeypatch):
    package = write_toy_package(tmp_path / "pkg", name="toy-private")
    push_package(package, hub=HFHub(private=True), owner="alice")
    assert hf_env.repos[("dataset", "alice/toy-private")].private
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_bob")
    with pytest.raises(NotFoundError, match="no such package on the Hugging Face Hub"):
        pull_package("alice/toy-private", hub=HFHub())
    assert "alice/toy-private" not in [row["ref"] for row in list_packages(HFHub())]
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert pull_package("alice/toy-private", hub=HFHub()).is_dir()


def test_push_killed_between_commit_and_tag_leaves_no_version(hf_env, tmp_path):
    package = write_toy_package(tmp_path / "pkg", name="toy-killed")
    env = dict(os.environ, **{TAG_DELAY_ENV: "60"})
    process = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "env", "push", str(package), "--hub", "hf",
                                "--repo", "alice/toy-killed"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while ("POST", "/api/datasets/alice/toy-killed/commit/main") not in hf_env.requests:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "push never committed"
            time.sleep(0.1)
        time.sleep(0.3)  # the commit has been answered; the tag is not created yet
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    hub = HFHub()
    assert hub.versions(PackageRef("alice", "toy-killed")) == []
    with pytest.raises(NotFoundError):
        pull_package("alice/toy-killed", hub=hub)
    assert push_package(package, hub=hub, owner="alice").published  # a second push completes the version
    assert pull_package("alice/toy-killed", hub=hub).is_dir()


@pytest.mark.parametrize("same_content", [True, False])
def test_concurrent_pushes_tag_once(hf_env, tmp_path, monkeypatch, same_content):
    """Two pushes of one version race; the tag decides: the loser is a no-op (same content) or refused."""
    import threading

    name = f"toy-race-{same_content}".lower()
    first = write_toy_package(tmp_path / "a", name=name, rows=3)
    second = write_toy_package(tmp_path / "b", name=name, rows=3 if same_content else 5)
    monkeypatch.setenv(TAG_DELAY_ENV, "4")  # both commits land before either tag
    outcome = {}

    def push_first():
        try:
            outcome["first"] = push_package(first, hub=HFHub(), owner="alice").published
        except Exception as error:  # noqa: BLE001 - recorded for the assertion
            outcome["first"] = error

    thread = threading.Thread(target=push_first)
    thread.start()
    deadline = time.monotonic() + 60
    while ("POST", f"/api/datasets/alice/{name}/commit/main") not in hf_env.requests:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    monkeypatch.setenv(TAG_DELAY_ENV, "6")  # the second push tags after the first
    if same_content:
        assert push_package(second, hub=HFHub(), owner="alice").published is False
    else:
        with pytest.raises(VersionConflictError):
            push_package(second, hub=HFHub(), owner="alice")
    thread.join(timeout=60)
    assert outcome["first"] is True
    # the second push got past the early hash check and lost the race at the tag (HTTP 409)
    assert hf_env.requests.count(("POST", f"/api/datasets/alice/{name}/preupload/main")) == 2
    assert HFHub().versions(PackageRef("alice", name)) == ["0.1.0"]
    pulled = pull_package(f"alice/{name}", hub=HFHub())
    assert len((pulled / "data" / "train.jsonl").read_text().splitlines()) == 3


def test_cli_push_list_versions_info_through_hf(hf_env, tmp_path):
    package = write_toy_package(tmp_path / "pkg", name="toy-cli")
    env = dict(os.environ)

    def run(*args):
        out = subprocess.run([sys.executable, "-m", "agentrl.cli", "env", *args], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "published: alice/toy-cli@0.1.0" in run("push", str(package), "--hub", "hf", "--repo", "alice/toy-cli")
    assert "alice/toy-cli" in run("list", "--hub", "hf", "--search", "toy-cli")
    assert run("versions", "alice/toy-cli", "--hub", "hf").split() == ["0.1.0"]
    assert 'name = "toy-cli"' in run("info", "alice/toy-cli", "--hub", "hf")
    env["HF_TOKEN"] = "hf_not_a_token"
    failed = subprocess.run([sys.executable, "-m", "agentrl.cli", "env", "push", str(package), "--hub", "hf",
                             "--repo", "alice/toy-cli2"], env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and "HF_TOKEN" in failed.stderr and len(failed.stderr.strip().splitlines()) == 1


def test_token_from_huggingface_login(hf_env, tmp_path):
    """`huggingface_hub.login` (validated with whoami against the fake) stores the token the CLI then uses."""
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env["HF_HOME"] = str(tmp_path / "login-home")
    package = write_toy_package(tmp_path / "pkg", name="toy-login")
    command = [sys.executable, "-m", "agentrl.cli", "env", "push", str(package), "--hub", "hf", "--repo", "alice/toy-login"]
    anonymous = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert anonymous.returncode == 2 and "HF_TOKEN" in anonymous.stderr, anonymous.stderr
    login = subprocess.run([sys.executable, "-c", f"from huggingface_hub import login; login(token={TOKEN!r})"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert login.returncode == 0, login.stderr
    assert (tmp_path / "login-home" / "token").read_text().strip() == TOKEN
    pushed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert pushed.returncode == 0 and "published: alice/toy-login@0.1.0" in pushed.stdout, pushed.stderr


def test_fake_saw_only_known_routes(fake_hub):
    """Runs last in this module: the client called nothing the fake does not implement."""
    assert fake_hub.requests, "the tests above talked to the fake"
    assert fake_hub.unhandled == [], json.dumps(fake_hub.unhandled)
