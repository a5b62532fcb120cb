"""`agentrl eval --oracle`: the environment package's own `oracle_policy()` plays instead of a model, no server.

The real CLI in a subprocess on reverse-text (whose oracle reverses the text) and on the toy echo package with an
oracle written here: one that answers right, one that answers wrong (exit 1, the package check failed), none at all
(one line naming the module to define it in), and --oracle beside --model (one line).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.toy_package import write_toy_package

ROOT = Path(__file__).resolve().parents[2]


def _eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_the_oracle_of_a_built_in_environment_passes_every_rollout(tmp_path):
    result = _eval("--env", "reverse-text", "--oracle", "-n", "3", "-r", "2", "-o", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "oracle: all 6 rollouts passed" in result.stdout and "starting vLLM" not in result.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["model"], summary["client"], summary["mean_reward"]) == ("oracle", "oracle", 1.0)


def _toy_with_oracle(folder: Path, reply: str | None) -> Path:
    package = write_toy_package(folder)
    if reply is not None:
        with open(package / "toy_echo.py", "a") as module:
            module.write("\n\ndef oracle_policy():\n    from agentrl.policies import ScriptedPolicy\n\n"
                         f"    return ScriptedPolicy([{reply}])\n")
    return package


@pytest.mark.parametrize(("reply", "code", "line"), [
    # the toy echo's rows ask for "alpha0", "beta1", "gamma2": an oracle that knows only one of them
    ('"alpha0"', 1, r"error: the oracle passed 2 of 6 rollouts \(reward >= 1\); see .*/results\.jsonl"),
    (None, 2, r"error: environment 'toy-echo' has no oracle: define oracle_policy\(\) in .*/toy_echo\.py, "
              r"returning a ChatClient that solves its tasks \(agentrl\.policies\.ScriptedPolicy\)"),
])
def test_a_package_whose_oracle_fails_or_is_missing_says_so_in_one_line(tmp_path, reply, code, line):
    import re

    package = _toy_with_oracle(tmp_path / "pkg", reply)
    result = _eval("--env", str(package), "--oracle", "-n", "3", "-r", "2", "--split", "train",
                   "-o", str(tmp_path / "out"))
    assert result.returncode == code, (result.stdout[-1500:], result.stderr[-1500:])
    errors = [text for text in result.stderr.splitlines() if text.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(line, errors[0]), result.stderr[-1500:]
    assert "Traceback" not in result.stderr
    assert (tmp_path / "out").exists() == (code == 1)  # a missing oracle writes nothing


def test_oracle_and_a_model_together_are_one_line(tmp_path):
    result = _eval("--env", "reverse-text", "--oracle", "--model", "tiny-moe", "-o", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: oracle (--oracle): the environment's own oracle plays, so model (--model) = 'tiny-moe' has no use; "
        "drop one of them"), result.stderr
    assert not (tmp_path / "out").exists()
