"""The README is a front page that shows: its two set-up commands, a real console sample, the viewer's screenshot,
and the table of tasks; its links point at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_set_up_commands_are_code_blocks_as_ci_runs_them():
    blocks = re.findall(r"```\n(.*?)```", README, re.S)
    commands = [block.strip() for block in blocks if "\n" not in block.strip()]
    assert "bash scripts/install.sh && agentrl train" in commands
    assert "bash scripts/install.sh && python3 -m pytest" in commands
    assert "bash scripts/install.sh && .venv/bin/python -m pytest" in commands
    assert "-m pytest" in (ROOT / ".ci" / "run").read_text()


def test_the_console_sample_and_the_screenshot_render():
    sample = next(block for block in re.findall(r"```\n(.*?)```", README, re.S) if "/24 reward" in block)
    steps = [line for line in sample.splitlines() if re.match(r"\s+\d+/24 reward", line)]
    assert len(steps) >= 8 and all(len(line) <= 80 for line in steps)
    assert "held-out after step" in sample and "95% CI" in sample
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert images and all((ROOT / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for image in images)


def test_every_file_the_readme_points_at_exists():
    for path in re.findall(r"`((?:docs|cookbook)/[\w./-]+)`", README):
        assert (ROOT / path.rstrip("/").split("*")[0]).exists() or "*" in path, path
