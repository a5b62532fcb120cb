"""The run's rollouts.jsonl: a bounded sample per step, written by the real orchestrator loop.

The orchestrator runs the real arithmetic environment (calculator tool, rubric) with a
scripted policy whose answers alternate between right and wrong, so groups have reward
spread and non-zero advantages. The trainer here only records what it is given (what is
tested is the orchestrator's recording, not learning; the e2e tests run the real trainer).
"""

from __future__ import annotations

import itertools
import json
import warnings

import pytest

from agentrl.hub.loader import load_environment
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.rl.orchestrator import Orchestrator, OrchestratorConfig
from agentrl.rl.rollout_log import MAX_STRING_CHARS, RolloutLog, pick_rollouts, rollout_record
from agentrl.sampling import SamplingConfig
from agentrl.types import Completion, Message, Rollout, Task, Turn


def _alternating_policy() -> ScriptedPolicy:
    calls = itertools.count()

    def reply(messages, tools):
        if messages[-1].role == "tool":
            right = next(calls) % 2 == 0
            return f"<answer>{messages[-1].content if right else '-1'}</answer>"
        expression = messages[-1].content.split("Compute:", 1)[-1].strip()
        return {"content": "", "tool_calls": [tool_call("calculator", expression=expression)]}

    return ScriptedPolicy(reply, name="alternating")


class RecordingTrainer:
    """Takes the orchestrator's samples and pushes, returns the metrics keys the loop reads."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.asked: list[list[int]] = []

    async def train_step(self, samples, *, step, logprobs_of=()):
        self.steps.append(step)
        self.asked.append(list(logprobs_of))
        return {"mismatch_kl": 0.0, "loss": 0.0}

    async def save_checkpoint(self, path, *, step):
        pass

    async def push(self, *, version):
        return None


async def _run(tmp_path, *, samples_per_step: int, max_bytes: int = 2**30, steps: int = 3) -> list[dict]:
    env = load_environment("arithmetic", num_train=16, num_test=4)
    log = RolloutLog(tmp_path, samples_per_step=samples_per_step, max_bytes=max_bytes)
    trainer = RecordingTrainer()
    orchestrator = Orchestrator(
        config=OrchestratorConfig(max_steps=steps, groups_per_step=3, rollouts_per_group=4,
                                  max_off_policy_steps=0),
        environment=env, client=_alternating_policy(), trainer=trainer, weight_sync=trainer,
        sampling=SamplingConfig(), on_groups=log,
    )
    await orchestrator.run()
    assert trainer.steps == list(range(steps))
    if not log.full:  # the trainer is asked for the logprobs of the recorded samples only
        assert [len(asked) for asked in trainer.asked] == [min(samples_per_step, 12)] * steps
    return [json.loads(line) for line in log.path.read_text().splitlines()] if log.path.exists() else []


async def test_each_step_writes_a_sample_spread_over_its_groups(tmp_path):
    records = await _run(tmp_path, samples_per_step=5)
    assert [r["step"] for r in records] == [0] * 5 + [1] * 5 + [2] * 5
    step0 = records[:5]
    # every group's first rollout, then the second rollout of the first groups
    assert [r["rollout_index"] for r in step0] == [0, 0, 0, 1, 1]
    assert len({r["group_index"] for r in step0}) == 3
    record = step0[0]
    assert [m["role"] for m in record["messages"]][-3:] == ["assistant", "tool", "assistant"]
    calls = [m for m in record["messages"] if m.get("tool_calls")]
    assert calls and calls[0]["tool_calls"][0]["function"]["name"] == "calculator"
    tool_output = next(m for m in record["messages"] if m["role"] == "tool")
    assert tool_output["content"] == record["task"]["answer"]  # the calculator's result
    assert set(record["metrics"]) >= {"correct_answer", "used_answer_tags", "tool_calls"}  # reward parts
    assert record["reward"] == record["metrics"]["correct_answer"]
    turn = record["turns"][0]
    completion = turn["completion"]
    assert turn["prompt_token_ids"] and len(completion["token_ids"]) == len(completion["logprobs"])
    assert "routed_experts" not in turn["completion"] and "prompt_routed_experts" not in turn
    assert record["policy_versions"] == []  # the scripted policy reports no weight versions
    # advantages are the ones trained with: reward minus the group's mean
    assert all(isinstance(r["advantage"], float) for r in records)
    same_group = [r for r in step0 if r["group_index"] == step0[0]["group_index"]]
    assert len(same_group) == 2 and same_group[0]["reward"] != same_group[1]["reward"]
    assert same_group[0]["advantage"] == pytest.approx(-same_group[1]["advantage"])


async def test_zero_samples_writes_nothing(tmp_path):
    assert await _run(tmp_path, samples_per_step=0) == []


async def test_the_size_cap_stops_recording_with_one_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = await _run(tmp_path, samples_per_step=4, max_bytes=20_000)
    assert 0 < len(records) < 12
    assert (tmp_path / "rollouts.jsonl").stat().st_size <= 20_000
    messages = [str(w.message) for w in caught if "rollouts_max_mb" in str(w.message)]
    assert len(messages) == 1, messages


def test_long_strings_are_cut_and_truncate_keeps_earlier_steps(tmp_path):
    task = Task(prompt=[Message(role="user", content="x")])
    long_output = "y" * (MAX_STRING_CHARS + 500)
    turn = Turn(prompt_token_ids=[1], completion=Completion(token_ids=[2], logprobs=[-0.5]))
    rollout = Rollout(task=task, messages=[Message(role="tool", content=long_output)],
                      state={"diff": long_output}, turns=[turn])
    record = rollout_record(rollout, step=3)
    assert record["messages"][0]["content"].endswith("[... 500 more characters cut]")
    assert len(record["state"]["diff"]) < MAX_STRING_CHARS + 100
    log = RolloutLog(tmp_path, samples_per_step=1, max_bytes=2**20)
    log.path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)) + '{"step": 5, "torn')
    log.truncate(before_step=3)
    assert [json.loads(line)["step"] for line in log.path.read_text().splitlines()] == [0, 1, 2]


def test_pick_rollouts_spreads_over_uneven_groups():
    assert pick_rollouts([[1, 2], [3], [4, 5, 6]], 5) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1)]
    assert pick_rollouts([[1]], 3) == [(0, 0)]


def test_policy_versions_is_one_name_and_old_records_still_load():
    """`Completion.policy_versions` feeds `TrainingSample.policy_versions`; a record written under the old field name
    (`weight_versions`, vLLM's) loads into it, and a record is written under the one name."""
    old = {"text": "ab", "token_ids": [5, 6], "logprobs": [-0.1, -0.2], "weight_versions": [2, 3]}
    completion = Completion.model_validate(old)
    assert completion.policy_versions == [2, 3]
    assert "weight_versions" not in completion.model_dump() and completion.model_dump()["policy_versions"] == [2, 3]
    rollout = Rollout(task=Task(prompt=[Message(role="user", content="x")]), messages=[Message(role="user", content="x")],
                      turns=[Turn(prompt_token_ids=[1, 2], completion=completion)])
    assert rollout.sample().policy_versions == [-1, -1, 2, 3] and rollout.policy_versions == [2, 3]
