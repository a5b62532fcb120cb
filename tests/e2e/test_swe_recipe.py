"""The swe recipe's README commands, run as written in a fresh clone of the repository (issue 36 item 5).

`cookbook/swe-tiny-moe/README.md` lists the commands from a fresh clone: build the base image,
build the project images (cached: a second run costs a second), train. They run here in a
`git clone` of the checkout's HEAD, one after the other, and the run must finish its steps
with every rollout graded (tiny-moe does not fix bugs: reward 0 is expected; a missing image
would fail every rollout, and `agentrl train` would stop at once naming the build command).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.rl.report import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import ROOT, finish

README = ROOT / "cookbook" / "swe-tiny-moe" / "README.md"


def readme_commands() -> list[str]:
    """The commands of the README's first code block after 'From a fresh clone', comments dropped."""
    text = README.read_text()
    block = re.search(r"From a fresh clone.*?```\n(.*?)```", text, re.DOTALL)
    assert block, "the README has no 'From a fresh clone' code block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def _run(command: str, *, cwd: Path, timeout: float) -> tuple[int, str]:
    process = subprocess.Popen(command, shell=True, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    return finish(process, timeout=timeout)


@pytest.mark.e2e
@pytest.mark.slow  # a fresh clone, its images and a run: test_train_agent trains in sandboxes by default
@pytest.mark.timeout(1500)
def test_swe_recipe_commands_from_a_fresh_clone(tmp_path):
    commands = readme_commands()
    assert commands[-1].startswith("agentrl train --config cookbook/swe-tiny-moe/train.toml"), commands
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{ROOT}", str(clone)], check=True)
    for command in commands[:-1]:  # building what the run needs (cached when it exists)
        returncode, output = _run(command, cwd=clone, timeout=900)
        assert returncode == 0, (command, output[-2000:])
    run_dir = tmp_path / "run"
    returncode, output = _run(f"{commands[-1]} -o {run_dir}", cwd=clone, timeout=900)
    assert returncode == 0, output[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(4))
    assert all(row["rollout_errors"] == 0 for row in rows), [row.get("first_error") for row in rows]
    assert all(row["rollout_sandbox_s"] > 0 for row in rows)  # the step-time split shows the sandboxes
