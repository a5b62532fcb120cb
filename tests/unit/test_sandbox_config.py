"""Sandbox config validation, output capping, ownership labels, backend choice and CLI errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentrl.config import config_from_dict
from agentrl.errors import ConfigError
from agentrl.sandbox import SandboxConfig, create_sandbox
from agentrl.sandbox.base import CappedBuffer
from agentrl.sandbox.base_image import BASE_RECIPE, recipe_hash
from agentrl.sandbox.labels import owner_alive, process_start_time, sandbox_labels


def test_defaults_are_locked_down():
    config = SandboxConfig()
    assert config.type == "docker" and config.network is False
    assert config.user == "1000:1000" and config.image == "agentrl-base:bookworm"
    assert config.memory_mb > 0 and config.pids_limit > 0 and config.disk_mb > 0


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"type": "kubernetes"}, r"type = 'kubernetes': must be 'docker', 'bwrap' or 'e2b'"),
        ({"memory_mb": 0}, r"memory_mb = 0: must be greater than 0"),
        ({"runtime": "kata"}, r"runtime = 'kata'"),
        ({"cpu": 2}, r"unknown key 'cpu'"),
    ],
)
def test_bad_config_is_one_line(data, pattern):
    with pytest.raises(ConfigError, match=pattern) as caught:
        config_from_dict(SandboxConfig, data, source="sandbox.toml")
    assert "\n" not in str(caught.value)


def test_create_sandbox_picks_backend_without_starting():
    assert type(create_sandbox({"type": "bwrap"})).__name__ == "BwrapSandbox"
    assert type(create_sandbox(SandboxConfig(type="e2b"))).__name__ == "E2BSandbox"
    docker = create_sandbox(memory_mb=64)
    assert type(docker).__name__ == "DockerSandbox" and docker.config.memory_mb == 64 and docker.id == ""


def test_capped_buffer_keeps_prefix_and_counts_rest():
    buffer = CappedBuffer(10)
    for piece in (b"hello ", b"world", b"!" * 1000):
        buffer.write(piece)
    assert buffer.getvalue() == b"hello worl"
    assert buffer.truncated and buffer.total == 1011
    exact = CappedBuffer(5)
    exact.write(b"12345")
    assert exact.getvalue() == b"12345" and not exact.truncated


def test_labels_identify_live_and_dead_owners():
    labels = sandbox_labels(owner="run-1", backend="docker")
    assert labels["agentrl.owner"] == "run-1" and labels["agentrl.pid"] == str(os.getpid())
    assert owner_alive(labels)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not owner_alive({**labels, "agentrl.pid": str(child.pid), "agentrl.pid_start": "1"})
    # A reused pid (same number, other start time) counts as dead.
    assert not owner_alive({**labels, "agentrl.pid_start": str(int(process_start_time(os.getpid())) + 1)})
    # Another host's sandbox is never judged from here.
    assert owner_alive({**labels, "agentrl.host": "elsewhere", "agentrl.pid": "999999999"})


def test_recipe_hash_is_stable_and_sensitive():
    assert recipe_hash() == recipe_hash(dict(BASE_RECIPE))
    assert recipe_hash({**BASE_RECIPE, "packages": [*BASE_RECIPE["packages"], "curl"]}) != recipe_hash()


def test_cli_run_without_command_is_one_line_error():
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", "run"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: sandbox run: no command given; usage: agentrl sandbox run --image IMG -- CMD [ARGS...]"
    bad_env = subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", "run", "--env", "NOEQUALS", "--", "true"],
                             capture_output=True, text=True)
    assert bad_env.returncode == 2 and "--env 'NOEQUALS': expected KEY=VALUE" in bad_env.stderr
    bad = subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", "gc", "--type", "lxc"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "expected docker or bwrap" in bad.stderr
    for command in ("run", "build-base", "gc", "ls"):
        help_text = subprocess.run([sys.executable, "-m", "agentrl.cli", "sandbox", command, "--help"],
                                   capture_output=True, text=True)
        assert help_text.returncode == 0 and "Usage" in help_text.stdout
