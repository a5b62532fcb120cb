"""The sandbox backends the security and integrity suites run every attack under.

Docker under runc and under gVisor (`runsc`), and bubblewrap; each is skipped (with the
reason) where this machine lacks it. `config(backend, ...)` gives the small-limit
`SandboxConfig` the attacks run against, with an owner label of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from agentrl.sandbox import SandboxConfig


def docker_ok() -> bool:
    return shutil.which("docker") is not None and subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def runsc_ok() -> bool:
    if not docker_ok():
        return False
    return "runsc" in subprocess.run(["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True,
                                     text=True).stdout


def bwrap_ok() -> bool:
    from agentrl.sandbox.base_image import rootfs_dir

    return shutil.which("bwrap") is not None and (rootfs_dir() / "bin" / "sh").exists() and os.geteuid() == 0


BACKENDS = [
    pytest.param({"type": "docker", "runtime": "runc"}, id="docker-runc",
                 marks=pytest.mark.skipif(not docker_ok(), reason="no Docker engine")),
    pytest.param({"type": "docker", "runtime": "runsc"}, id="docker-runsc",
                 marks=pytest.mark.skipif(not runsc_ok(), reason="gVisor runtime runsc not registered")),
    pytest.param({"type": "bwrap"}, id="bwrap",
                 marks=pytest.mark.skipif(not bwrap_ok(), reason="bubblewrap or base rootfs missing")),
]
DOCKER_BACKENDS = BACKENDS[:2]


def config(backend: dict, **extra) -> SandboxConfig:
    """Small limits, an owner label of its own; `extra` overrides any field."""
    fields = {"memory_mb": 256, "pids_limit": 64, "max_output_bytes": 1_000_000,
              "owner": f"test-sandbox-{uuid.uuid4().hex[:8]}", **backend, **extra}
    return SandboxConfig(**fields)
