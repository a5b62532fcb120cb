"""`agentrl train` stops before anything starts when the environment's sandbox images (or the bubblewrap root
filesystem) are missing, in one line naming the exact command that builds them (issue 36 item 5)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from sandbox_backends import docker_ok

import agentrl
from agentrl.errors import NotFoundError
from agentrl.hub.manifest import load_manifest
from agentrl.hub.sandbox_check import build_command, check_sandboxes
from agentrl.sandbox.base import BASE_IMAGE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(not docker_ok(), reason="no Docker engine")]

ROOT = Path(__file__).resolve().parents[2]
MISSING = "agentrl-swe/inflection:missing-in-this-test"


@pytest.fixture
def swe_copy(tmp_path):
    """The swe package with every row naming an image no engine has."""
    folder = tmp_path / "swe"
    shutil.copytree(ROOT / "environments" / "swe", folder, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    for split in ("train", "test"):
        path = folder / "data" / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for row in rows:
            row["image_name"] = MISSING
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_present_images_pass():
    check_sandboxes(agentrl.load_environment("key-hunt"))  # agentrl-base:bookworm is built here


def test_missing_images_name_the_build_script(swe_copy):
    env = agentrl.load_environment(str(swe_copy))
    with pytest.raises(NotFoundError) as error:
        check_sandboxes(env)
    message = str(error.value)
    assert "\n" not in message and f"(first: {MISSING})" in message and "1 of 1 sandbox images" in message
    assert message.endswith(f"build them: python3 {swe_copy / 'swe_images.py'}")


def test_missing_image_without_a_build_recipe_and_missing_rootfs(tmp_path):
    env = agentrl.load_environment("key-hunt", sandbox={"image": "agentrl-none/missing:0"})
    with pytest.raises(NotFoundError, match=r"1 of 1 sandbox images .*first: agentrl-none/missing:0.*"
                                            r"pull or build them \(agentrl env check .*key_hunt lists them\)"):
        check_sandboxes(env)
    bwrap = agentrl.load_environment("key-hunt", sandbox={"type": "bwrap", "rootfs": str(tmp_path / "none")})
    with pytest.raises(NotFoundError, match="root filesystem .* is missing; build it: agentrl sandbox build-base$"):
        check_sandboxes(bwrap)


def test_build_command_puts_the_base_image_first(swe_copy):
    env = SimpleNamespace(name="swe", path=swe_copy, manifest=load_manifest(swe_copy))
    script = f"python3 {swe_copy / 'swe_images.py'}"
    assert build_command(env, [BASE_IMAGE]) == "agentrl sandbox build-base"
    assert build_command(env, [BASE_IMAGE, MISSING]) == f"agentrl sandbox build-base && {script}"
    assert build_command(env, [MISSING]) == script


def test_train_stops_before_start_up_with_one_line(swe_copy, tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "--env", str(swe_copy), "--model", "tiny-moe",
         "-o", str(run_dir)], capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "RAY_ADDRESS": ""})
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2, lines[-20:]
    assert len([line for line in lines if "error" in line.lower()]) == 1, lines
    assert f"build them: python3 {swe_copy / 'swe_images.py'}" in lines[-1]
    assert not run_dir.exists()  # nothing written, nothing started
    assert time.monotonic() - started < 120


def test_a_harbor_package_whose_image_is_not_built_stops_eval_and_train_in_one_line(tmp_path, capsys):
    """A Harbor package imported without --build (or whose build failed) started Ray, vLLM and the trainer (56 s)
    or eval's server (30 s) and then failed every rollout, with a hint about agentrl-base (a walk-through)."""
    import harbor_tasks

    from agentrl.cli import main
    from agentrl.hub.interop.harbor import import_harbor_task

    package = import_harbor_task(harbor_tasks.named(tmp_path / "task"), out=tmp_path / "pkg",
                                 name=f"agentrl-test-unbuilt-{os.getpid()}")
    env = agentrl.load_environment(str(package))
    with pytest.raises(NotFoundError, match=rf"1 of 1 sandbox images .*; build them: agentrl env build {package}$"):
        check_sandboxes(env)
    started = time.monotonic()
    assert main(["eval", "--env", str(package), "-n", "1", "-o", str(tmp_path / "eval")]) == 2
    assert main(["train", "--env", str(package), "--model", "tiny-moe", "-o", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count(f"build them: agentrl env build {package}") == 2 and err.count("\n") == 2, err
    assert not (tmp_path / "eval").exists() and not (tmp_path / "run").exists()
    assert time.monotonic() - started < 60  # no server, no Ray
