"""The swe environment through its real multi-turn tool loop in Docker sandboxes.

The oracle policy (a ScriptedPolicy) solves sample tasks by calling bash, str_replace and
submit (or `git apply` through bash), and the rollout is graded in a fresh sandbox.
"""

from __future__ import annotations

import sys
from pathlib import Path

for _folder in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(_folder) not in sys.path:  # the package's modules and the shared test helpers
        sys.path.insert(0, str(_folder))

import json

import pytest
from swe_testlib import build_sample_images, sample_rows

import agentrl
from agentrl.errors import AgentrlError
from agentrl.hub.entrypoint import import_package_attr
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.sampling import SamplingConfig

pytestmark = pytest.mark.integration
SAMPLING = SamplingConfig(max_tokens=100_000)


@pytest.fixture(scope="module")
def sample_file(tmp_path_factory):
    build_sample_images()
    path = tmp_path_factory.mktemp("swe") / "sample.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in sample_rows()))
    return path


@pytest.fixture(scope="module")
def env(sample_file):
    return agentrl.load_environment("swe", data_path=str(sample_file), max_turns=12)


def _oracle(env, sample_file, mode="edit"):
    return import_package_attr(env.path, "swe:oracle_policy", package_name=env.name)(data_path=sample_file, mode=mode)


def test_tasks_are_verifiers_rows(env):
    tasks = env.tasks("test")
    assert len(tasks) == 2
    for task in tasks:
        assert task.prompt[0].role == "system" and task.prompt[-1].role == "user"
        assert task.answer == task.info["patch"] and task.info["FAIL_TO_PASS"]
    assert {tool["function"]["name"] for tool in env.tool_schemas} == {"bash", "read_file", "write_file", "str_replace", "submit"}


@pytest.mark.parametrize("mode", ["edit", "apply"])
async def test_oracle_reaches_reward_one_through_the_tools(env, sample_file, mode):
    for task in env.tasks("test"):
        (rollout,) = await env.run_group(_oracle(env, sample_file, mode), task, n=1, sampling=SAMPLING)
        assert rollout.error is None and not rollout.truncated, rollout.error
        names = [call.function.name for m in rollout.messages if m.role == "assistant" for call in m.tool_calls or []]
        assert names[-1] == "submit" and ("str_replace" in names) == (mode == "edit")
        assert rollout.state["diff"].strip()
        assert rollout.reward == 1.0, rollout.state
        assert rollout.metrics["fail_to_pass"] == 1.0 and rollout.metrics["submitted"] == 1.0
        rollout.sample()  # the turns extend each other token-wise


async def test_default_oracle_scores_one_at_default_sampling(env, sample_file):
    """The default oracle sends short calls (`git apply` of the gold patch the environment put in its own sandbox),
    so the default max_tokens (128) never cuts them; the `edit` oracle's hunks are cut there."""
    oracle = import_package_attr(env.path, "swe:oracle_policy", package_name=env.name)(data_path=sample_file)
    assert SamplingConfig().max_tokens == 128
    for task in env.tasks("test"):
        (rollout,) = await env.run_group(oracle, task, n=1, sampling=SamplingConfig())
        assert rollout.error is None and not rollout.truncated, rollout.error
        assert rollout.reward == 1.0 and rollout.metrics["submitted"] == 1.0, rollout.state
        assert "agentrl-gold" not in rollout.state["diff"]  # the patch file is outside the graded tree
    (cut,) = await env.run_group(_oracle(env, sample_file, "edit"), env.tasks("test")[0], n=1,
                                 sampling=SamplingConfig())
    assert cut.truncated and cut.state["stop_reason"] == "length" and cut.reward == 0.0


async def test_tools_report_errors_and_give_up_scores_zero(env):
    task = env.tasks("test")[0]
    policy = ScriptedPolicy([
        {"tool_calls": [tool_call("read_file", path="no/such/file.py")]},
        {"tool_calls": [tool_call("str_replace", path=task.info["mutation"]["file"], old="@@nothing@@", new="x")]},
        {"tool_calls": [tool_call("bash", command="python3 -c 'print(6 * 7)'; exit 3")]},
        {"tool_calls": [tool_call("submit", answer="nothing to change")]},
    ])
    (rollout,) = await env.run_group(policy, task, n=1, sampling=SAMPLING)
    tool_texts = [m.content for m in rollout.messages if m.role == "tool"]
    assert tool_texts[0] == "Error: cannot read no/such/file.py: no such file"
    assert tool_texts[1].startswith("Error: old text not found")
    assert tool_texts[2].startswith("exit code: 3") and "42" in tool_texts[2]
    assert rollout.reward == 0.0 and rollout.metrics["empty_patch"] == 1.0 and rollout.metrics["submitted"] == 1.0
    assert len(rollout.turns) == 4  # submit ends the episode at once


async def test_turn_budget_truncates_and_the_diff_is_still_graded(env, sample_file):
    budget_env = agentrl.load_environment("swe", data_path=str(sample_file), max_turns=3)
    task = budget_env.tasks("test")[0]
    (rollout,) = await budget_env.run_group(_oracle(budget_env, sample_file, "apply"), task, n=1, sampling=SAMPLING)
    assert rollout.truncated and rollout.state["stop_reason"] == "max_turns"
    # explore, the whole patch through bash, then the budget ends before `git diff --stat` runs:
    # never submitted, but the repository already holds the fix
    assert rollout.reward == 1.0 and rollout.metrics["submitted"] == 0.0


def test_bad_data_path_is_a_one_line_error(tmp_path):
    with pytest.raises(AgentrlError, match="data_path .* does not exist"):
        agentrl.load_environment("swe", data_path=str(tmp_path / "missing.jsonl"))
