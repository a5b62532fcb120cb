"""verifiers' load_environment() packages (SingleTurnEnv, ToolEnv, MultiTurnEnv) run by agentrl.

Each fixture package (tests/fixtures/verifiers/legacy_*) is loaded with `agentrl.load_environment`
and played by a ScriptedPolicy through agentrl's rollout loop; the reference is verifiers' own
pipeline (`vf_env.run_group` with verifiers' own OpenAI chat client replaying the same replies:
tests/verifiers_replay.py, no agentrl code),
and each rollout's reward and metrics must equal verifiers'. Needs verifiers < 0.4 (the old API;
0.3.1 keeps it as verifiers.legacy): skipped otherwise, with the reason.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from pathlib import Path

import pytest

verifiers = pytest.importorskip(
    "verifiers", reason="verifiers is not installed (pip install 'verifiers<0.4')"
)
if not hasattr(verifiers, "SingleTurnEnv"):
    pytest.skip(
        f"verifiers {verifiers.__version__} has no load_environment() API (SingleTurnEnv...); "
        "these tests need verifiers<0.4",
        allow_module_level=True,
    )

import agentrl  # noqa: E402
from agentrl.errors import AgentrlError  # noqa: E402
from agentrl.policies import ScriptedPolicy, tool_call  # noqa: E402
from agentrl.sampling import SamplingConfig  # noqa: E402
from tests.verifiers_replay import replay_client  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verifiers"


def _verifiers_reference(folder: Path, module: str, task, replies, n: int) -> list[dict]:
    """verifiers' own run_group (rollout + rubric.score_group) of the task's row with the same replies."""
    vf_env = importlib.import_module(module).load_environment()
    row = task.info["verifiers_input"]
    outputs = asyncio.run(
        vf_env.run_group([dict(row) for _ in range(n)], replay_client(replies), "replay", {})
    )
    return [{"reward": output["reward"], "metrics": output["metrics"]} for output in outputs]


CASES = [
    ("legacy_qa", "vf_legacy_qa", "test", 0, ["<think>Italy</think>\n<answer>Rome</answer>"]),
    ("legacy_qa", "vf_legacy_qa", "test", 1, ["<answer>Alexandria</answer>"]),
    ("legacy_qa", "vf_legacy_qa", "train", 2, ["Nairobi, Kenya"]),
    ("legacy_tools", "vf_legacy_tools", "train", 0, [{"tool_calls": [tool_call("add", a=17, b=25)]}, "42"]),
    ("legacy_tools", "vf_legacy_tools", "train", 1, [{"tool_calls": [tool_call("add", a=1, b=2)]}, "3"]),
    ("legacy_tools", "vf_legacy_tools", "train", 2, ["108"]),
    ("legacy_guess", "vf_legacy_guess", "train", 0, ["5", "2", "3"]),
    ("legacy_guess", "vf_legacy_guess", "train", 1, ["x", "9", "8", "1", "4"]),
]


@pytest.mark.parametrize(
    ("fixture", "module", "split", "index", "replies"), CASES, ids=[f"{c[0]}-{c[2]}{c[3]}" for c in CASES]
)
def test_rewards_equal_verifiers_own(fixture, module, split, index, replies):
    env = agentrl.load_environment(FIXTURES / fixture)
    task = env.tasks(split)[index]
    rollouts = asyncio.run(
        env.run_group(ScriptedPolicy(replies), task, n=2, sampling=SamplingConfig(max_tokens=256))
    )
    reference = _verifiers_reference(FIXTURES / fixture, module, task, replies, n=2)
    for rollout, expected in zip(rollouts, reference):
        assert rollout.error is None
        assert rollout.reward == pytest.approx(expected["reward"])
        assert rollout.metrics == pytest.approx({k: float(v) for k, v in expected["metrics"].items()})
        rollout.sample()  # every turn extends the previous one's tokens
    assert len(rollouts[0].turns) == min(len(replies), 5 if fixture == "legacy_guess" else 4)


def test_rows_are_verifiers_formatting():
    env = agentrl.load_environment(FIXTURES / "legacy_qa", num_eval=2)
    assert env.splits == ["test", "train"]
    test_tasks = env.tasks("test")
    assert [task.answer for task in test_tasks] == [
        "Rome",
        "Cairo",
    ]  # the num_eval argument reached load_environment
    assert [m.role for m in test_tasks[0].prompt] == ["system", "user"]
    assert test_tasks[0].prompt[0].content.startswith("Think in <think>")
    assert test_tasks[0].prompt[1].content == "What is the capital of Italy?"
    assert test_tasks[0].info["country"] == "Italy"


def test_tool_env_offers_the_tools_and_runs_them():
    env = agentrl.load_environment(FIXTURES / "legacy_tools")
    seen = {}

    def policy(messages, tools):
        seen.setdefault("tools", tools)
        if messages[-1].role == "tool":
            return messages[-1].content
        return {"tool_calls": [tool_call("add", a=123, b=456)]}

    [rollout] = asyncio.run(
        env.run_group(ScriptedPolicy(policy), env.tasks("train")[1], n=1, sampling=SamplingConfig())
    )
    assert seen["tools"][0]["function"]["name"] == "add"
    assert set(seen["tools"][0]["function"]["parameters"]["properties"]) == {"a", "b"}
    assert [m.role for m in rollout.messages[2:]] == ["assistant", "tool", "assistant"]
    assert rollout.messages[3].content == "579"
    assert rollout.reward == 1.5


def test_evaluate_writes_verifiers_rewards(tmp_path):
    """agentrl's eval engine over a verifiers package: results.jsonl carries verifiers' rewards."""
    from agentrl.evaluation.engine import EvalConfig
    from agentrl.evaluation.summary import summarize

    env = agentrl.load_environment(FIXTURES / "legacy_qa")
    tasks = env.tasks("test")
    replies = {
        "Italy": "<answer>Rome</answer>",
        "Egypt": "<think>x</think><answer>Cairo</answer>",
        "Chile": "Lima",
    }

    def policy(messages, tools):
        return replies[messages[-1].content.rsplit(" ", 1)[1].rstrip("?")]

    groups = [
        asyncio.run(env.run_group(ScriptedPolicy(policy), task, n=2, sampling=SamplingConfig()))
        for task in tasks
    ]
    summary = summarize(
        groups,
        config=EvalConfig(env=str(FIXTURES / "legacy_qa"), n=3, rollouts_per_task=2),
        env_name=env.name,
        elapsed_s=1.0,
        client="scripted",
        base_url="scripted",
    )
    expected = [
        _verifiers_reference(FIXTURES / "legacy_qa", "vf_legacy_qa", task, [policy(task.prompt, None)], n=1)[
            0
        ]["reward"]
        for task in tasks
    ]
    assert summary.mean_reward == pytest.approx(sum(expected) / 3)
    assert json.loads(json.dumps(groups[0][0].model_dump(mode="json")))["reward"] == pytest.approx(
        expected[0]
    )


def test_bad_arguments_are_one_line():
    with pytest.raises(AgentrlError, match="bad arguments to load_environment") as caught:
        agentrl.load_environment(FIXTURES / "legacy_guess", no_such_option=1)
    assert "\n" not in str(caught.value)


def test_imported_package_loads_and_validates(tmp_path, monkeypatch):
    import sys

    from agentrl.hub.interop.verifiers import import_verifiers_package
    from agentrl.hub.package import validate_package

    out = import_verifiers_package(FIXTURES / "legacy_guess", out=tmp_path / "guess")
    monkeypatch.delitem(sys.modules, "vf_legacy_guess", raising=False)  # one module of a name per process
    manifest, splits = validate_package(out)
    assert (
        manifest.name == "vf-legacy-guess"
        and sorted(splits) == ["test", "train"]
        and len(splits["train"]) == 2
    )
    env = agentrl.load_environment(out)
    assert env.path == out and env.manifest.name == "vf-legacy-guess"
    [rollout] = asyncio.run(
        env.run_group(ScriptedPolicy(["7"]), env.tasks("train")[1], n=1, sampling=SamplingConfig())
    )
    assert rollout.reward == 1.5 and rollout.metrics["num_turns"] == 1.0


def test_v1_packages_need_verifiers_0_4(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_VENVS", str(tmp_path))  # no venv made for it
    with pytest.raises(AgentrlError, match=r"\(v1 API, verifiers>=0.4.0\): verifiers 0.3.1 is installed here; "
                       r"run `agentrl env install .*v1_reverse`"):
        agentrl.load_environment(FIXTURES / "v1_reverse")


def test_a_second_copy_of_a_loaded_package_is_refused(tmp_path):
    import shutil

    agentrl.load_environment(FIXTURES / "legacy_qa")
    shutil.copytree(FIXTURES / "legacy_qa", tmp_path / "copy")
    with pytest.raises(AgentrlError, match="a different module 'vf_legacy_qa' is already imported"):
        agentrl.load_environment(tmp_path / "copy")


def test_unscored_rollouts_do_not_keep_verifiers_state():
    import gc

    env = agentrl.load_environment(FIXTURES / "legacy_qa")
    rollout = asyncio.run(
        env.rollout(ScriptedPolicy(["Rome"]), env.tasks("test")[0], sampling=SamplingConfig())
    )
    assert len(env._states) == 1
    del rollout
    gc.collect()
    assert env._states == {}


def test_rows_with_an_empty_prompt_are_refused_at_load():
    """verifiers' first call would get an empty conversation ("Cannot apply chat template to an empty
    conversation" on every rollout): refused at load in one line instead."""
    with pytest.raises(AgentrlError, match=r"'vf-legacy-empty': train row 0 has an empty prompt and the "
                       r"environment writes none in setup_state") as caught:
        agentrl.load_environment(FIXTURES / "legacy_empty")
    assert "\n" not in str(caught.value)


def test_a_reward_function_that_raised_is_the_rollouts_grader_error():
    """verifiers scores a reward function that raised 0 and only logs it: the rollout says so in `grader_error`,
    and groups scored at the same time each keep their own errors."""
    env = agentrl.load_environment(FIXTURES / "legacy_broken")
    task = env.tasks("train")[0]
    sampling = SamplingConfig(max_tokens=16)

    async def groups():
        return await asyncio.gather(*(env.run_group(ScriptedPolicy([reply]), task, n=2, sampling=sampling)
                                      for reply in ("12", "twelve", "x")))

    parsed, *broken = asyncio.run(groups())
    assert [r.reward for r in parsed] == [1.5, 1.5] and [r.grader_error for r in parsed] == [None, None]
    for group, reply in zip(broken, ("twelve", "x")):
        assert [r.reward for r in group] == [0.5, 0.5] and all(r.error is None for r in group)
        assert [r.grader_error for r in group] == [
            f"verifiers reward function 'exact' raised: invalid literal for int() with base 10: '{reply}'"] * 2
