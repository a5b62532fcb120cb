"""Shared helpers of the swe environment's tests: module path, sample rows, image builds."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
if str(PACKAGE_DIR) not in sys.path:
    sys.path.insert(0, str(PACKAGE_DIR))

DATA_DIR = PACKAGE_DIR / "data"
# The CI sample: two fast projects (their test suites run in about a second).
SAMPLE_PROJECTS = ("parse", "inflection")


def committed_rows(split: str | None = None) -> list[dict]:
    """The committed task rows (both splits when `split` is None)."""
    rows: list[dict] = []
    for name in ("train", "test") if split is None else (split,):
        rows += [json.loads(line) for line in (DATA_DIR / f"{name}.jsonl").read_text().splitlines() if line]
    return rows


def sample_rows(per_project: int = 1) -> list[dict]:
    """A fixed sample of committed rows from the CI projects (first instance ids of the test split)."""
    rows = sorted(committed_rows("test") + committed_rows("train"), key=lambda row: (row["split"] != "test", row["instance_id"]))
    sample: list[dict] = []
    for project in SAMPLE_PROJECTS:
        sample += [row for row in rows if row["instance_id"].startswith(project + "__")][:per_project]
    return sample


@functools.cache
def build_sample_images() -> tuple[str, ...]:
    """Build (or reuse, by content hash) the base image and the CI projects' images."""
    import docker
    from swe_images import base_image, build_images

    client = docker.from_env()
    try:
        client.images.get(base_image())
    except docker.errors.ImageNotFound:
        from agentrl.sandbox.base_image import build_base_image

        build_base_image()
    return tuple(build_images(list(SAMPLE_PROJECTS)))
