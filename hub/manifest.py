"""The environment package manifest (`environment.toml`) and its pydantic schema.

An environment package is a folder (docs/DESIGN.md section 4) with an `environment.toml`:

    name = "reverse-text"
    version = "0.1.0"
    description = "Reverse a string"
    tags = ["single-turn"]
    entrypoint = "reverse_text:load_environment"
    license = "Apache-2.0"
    requirements = []

    [reward]
    description = "LCS similarity between the answer and the reversed text"

    [dataset]
    generator = "reverse_text:build_dataset"   # or: [dataset.splits] train = "data/train.jsonl"

    [sandbox]                                    # optional: only for environments with tools
    image = "agentrl/swe:0.1.0"
    dockerfile = "Dockerfile"
    network = false
    [sandbox.limits]
    cpus = 1.0
    memory_mb = 1024

`load_manifest` reports every problem in one `ConfigError`, one '; '-separated entry per problem
(wrong values first), each naming the file, line, field and what it must be. The schema is shared
by the SDK loader and the hub.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator

from agentrl.config import BaseConfig, load_config

__all__ = ["MANIFEST_NAME", "SandboxLimits", "SandboxSpec", "DatasetSpec", "RewardSpec", "Manifest", "load_manifest"]

MANIFEST_NAME = "environment.toml"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9\-_]{0,63}$")
_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+([.\-+][0-9A-Za-z.\-]+)?$")
_ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w\.]*:[A-Za-z_]\w*$")


class SandboxLimits(BaseConfig):
    """Resource limits for each sandbox of the environment."""

    cpus: float = Field(1.0, gt=0, le=256, json_schema_extra={"unit": "CPU cores"})
    """CPU cores a sandbox may use (more than 0, at most 256)."""
    memory_mb: int = Field(1024, ge=16, le=1_048_576, json_schema_extra={"unit": "MiB"})
    """Memory limit in MiB (16 MiB to 1 TiB); the sandbox is killed above it."""
    pids: int = Field(256, ge=8, le=65_536, json_schema_extra={"unit": "processes"})
    """Most processes and threads at once (8 to 65536; stops fork bombs)."""
    disk_mb: int = Field(2048, ge=1, le=10_485_760, json_schema_extra={"unit": "MiB"})
    """Writable disk space in MiB (1 MiB to 10 TiB)."""
    timeout_s: float = Field(60.0, gt=0, le=86_400, json_schema_extra={"unit": "seconds"})
    """Default wall-clock limit of one command, in seconds (more than 0, at most a day)."""
    output_bytes: int = Field(1_000_000, ge=1024, le=1_073_741_824, json_schema_extra={"unit": "bytes"})
    """Most bytes kept of a command's stdout and of its stderr (1 KiB to 1 GiB)."""


class SandboxSpec(BaseConfig):
    """The sandbox the environment's tools run in."""

    image: str
    """Image name (with tag or digest) the sandboxes start from."""
    dockerfile: str | None = None
    """Path, relative to the package, of the Dockerfile that builds `image`."""
    build_script: str | None = None
    """Path, relative to the package, of a Python script that builds `image` and every image the task rows name
    (run as `python3 SCRIPT`); `agentrl train` names it when one of them is missing."""
    network: bool = False
    """Whether sandboxes may reach the network (off by default)."""
    workdir: str = "/workspace"
    """Working directory inside the sandbox."""
    user: str | None = None
    """User to run as inside the sandbox (None: the image's default, root only where needed)."""
    limits: SandboxLimits = SandboxLimits()
    """Resource limits."""
    digest: str | None = None
    """Image digest recorded at publish time (`sha256:...`); set by `agentrl env push`."""


class DatasetSpec(BaseConfig):
    """Where the environment's task rows come from."""

    splits: dict[str, str] = {}
    """Split name -> data file (jsonl or parquet) relative to the package."""
    generator: str | None = None
    """`module:function` returning a dict of split name -> datasets.Dataset."""

    @field_validator("generator")
    @classmethod
    def _check_generator(cls, value: str | None) -> str | None:
        if value is not None and not _ENTRYPOINT_RE.match(value):
            raise ValueError("must look like 'module:function'")
        return value


class RewardSpec(BaseConfig):
    """A human-readable account of the reward."""

    description: str = ""
    """What the reward measures and its range."""


class Manifest(BaseConfig):
    """The `environment.toml` of an environment package."""

    name: str
    """Environment name: lowercase letters, digits, '-' and '_'."""
    version: str = "0.1.0"
    """Semantic version (MAJOR.MINOR.PATCH)."""
    description: str = ""
    """One-line summary."""
    tags: list[str] = []
    """Search tags."""
    entrypoint: str
    """`module:function` that returns the Environment (the module lives in the package folder)."""
    license: str = "Apache-2.0"
    """SPDX licence identifier of the package and its data."""
    requirements: list[str] = []
    """Extra Python requirements (pip specifiers)."""
    reward: RewardSpec = RewardSpec()
    """How the environment rewards."""
    dataset: DatasetSpec = DatasetSpec()
    """Task rows."""
    sandbox: SandboxSpec | None = None
    """The sandbox image and limits, for environments that run tools."""
    env_args: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Default keyword arguments passed to the entrypoint."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError("must be lowercase letters, digits, '-' or '_' (at most 64)")
        return value

    @field_validator("version")
    @classmethod
    def _check_version(cls, value: str) -> str:
        if not _VERSION_RE.match(value):
            raise ValueError("must be a semantic version such as 0.1.0")
        return value

    @field_validator("entrypoint")
    @classmethod
    def _check_entrypoint(cls, value: str) -> str:
        if not _ENTRYPOINT_RE.match(value):
            raise ValueError("must look like 'module:function'")
        return value


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a package folder's `environment.toml` (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    return load_config(Manifest, path)
