"""key-hunt's data, difficulty arguments and size, without sandboxes (tests/integration/test_key_hunt_sandboxes.py
runs episodes in Docker runc, gVisor and bubblewrap)."""

from __future__ import annotations

import json

import pytest

import agentrl
from agentrl.errors import AgentrlError
from agentrl.hub.entrypoint import import_package_attr
from agentrl.types import Message, ToolCall


def _module(env, name: str):
    return import_package_attr(env.path, f"key_hunt_data:{name}", package_name=env.name)


def _follow(files: dict[str, str], first: str) -> tuple[list[str], str]:
    """The chain the clues describe, and the key at its end."""
    chain = [first]
    while files[chain[-1]].startswith("next: "):
        chain.append(files[chain[-1]].removeprefix("next: "))
    assert files[chain[-1]].startswith("key: ")
    return chain, files[chain[-1]].removeprefix("key: ")


@pytest.fixture(scope="module")
def env():
    return agentrl.load_environment("key-hunt")


def test_committed_splits_are_the_generators_output(env, tmp_path):
    write_splits = _module(env, "write_splits")
    assert write_splits(check=True) == []  # data/*.jsonl is what the generator makes
    (tmp_path / "train.jsonl").write_text("{}\n")
    assert write_splits(tmp_path, check=True) == [str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl")]


def test_rows_follow_the_clues_to_the_key_and_splits_are_disjoint(env):
    train, test = env.get_dataset("train"), env.get_dataset("test")
    assert (len(train), len(test)) == (1000, 128)
    identities = {}
    for split, data in (("train", train), ("test", test)):
        for row in data:
            info = agentrl.types.Task.from_row(row).info
            files = info["files"]
            chain, key = _follow(files, info["chain"][0])
            assert chain == info["chain"] and key == row["answer"] and len(chain) == 2 and chain[0] == "start"
            assert row["prompt"][-1]["content"] == "Find the key. Begin with the file start."
            keys = [text for text in files.values() if text.startswith("key: ")]
            assert len(keys) == 3 and len(set(keys)) == 3  # the key and 2 decoys, all different
            assert len(files) == 5 and all(path.count("/") == 1 for path in files if path != "start")
            identities.setdefault(split, set()).add((*chain, key))
    assert not identities["train"] & identities["test"]


def test_difficulty_arguments_shape_the_tasks(env):
    hard = agentrl.load_environment("key-hunt", clues=3, depth=2, files=12, distractors=4, named_start=True)
    assert hard.max_turns == 7
    again = agentrl.load_environment("key-hunt", clues=3, depth=2, files=12, distractors=4, named_start=True)
    rows = hard.get_dataset("test").to_list()
    assert rows == again.get_dataset("test").to_list()  # deterministic
    for row in rows[:20]:
        info = agentrl.types.Task.from_row(row).info
        chain, key = _follow(info["files"], info["chain"][0])
        assert len(chain) == 4 and key == row["answer"]
        assert f"The first clue is in {chain[0]}." in row["prompt"][-1]["content"]  # a path to copy
        assert len(info["files"]) == 12 and all(path.count("/") == 2 for path in info["files"])
        assert sum(text.startswith("key: ") for text in info["files"].values()) == 5


@pytest.mark.parametrize("args, field", [({"files": 3}, "files=3"), ({"depth": 9}, "depth"),
                                         ({"clues": 0}, "clues"), ({"sandbox": {"type": "vm"}}, "type"),
                                         ({"train_tasks": 0}, "train_tasks=0")])
def test_bad_arguments_are_one_line_errors(args, field):
    with pytest.raises(AgentrlError) as error:
        agentrl.load_environment("key-hunt", **args).get_dataset("test")
    assert field in str(error.value) and "\n" not in str(error.value)


def test_tools_are_bash_and_submit_with_short_schemas(env):
    assert [schema["function"]["name"] for schema in env.tool_schemas] == ["bash", "submit"]
    assert len(json.dumps(env.tool_schemas)) < 400


def test_an_oracle_episode_fits_tiny_moe_with_room(env):
    """The longest conversation of a solving episode at the default difficulty, in tiny-moe's tokens."""
    from agentrl.chat import ChatRenderer
    from agentrl.models import ensure_model

    renderer = ChatRenderer.from_pretrained(ensure_model("tiny-moe"))
    oracle = import_package_attr(env.path, "key_hunt:oracle_policy", package_name=env.name)()
    longest = 0
    for task in env.tasks("test", n=16, seed=0):
        messages = list(task.prompt)
        files = task.info["files"]
        for _ in range(3):
            reply = oracle.script(messages, None)
            call: ToolCall = reply["tool_calls"][0]
            messages.append(Message(role="assistant", content="", tool_calls=[call]))
            if call.function.name == "submit":
                assert call.function.parsed_arguments()["answer"] == task.answer
                break
            path = call.function.parsed_arguments()["command"].removeprefix("cat ")
            messages.append(Message(role="tool", content=files[path], tool_call_id=call.id, name="bash"))
        longest = max(longest, len(renderer.encode(renderer.render_text(messages, tools=env.tool_schemas,
                                                                         add_generation_prompt=False))))
    assert longest < 1024, longest  # tiny-moe has 2048 positions


def test_partial_credit_follows_single_file_reads_in_order(env):
    progress = import_package_attr(env.path, "key_hunt:progress", package_name=env.name)
    chain_followed = import_package_attr(env.path, "key_hunt:chain_followed", package_name=env.name)
    info = {"chain": ["start", "c/f3"]}
    cases = [(["cat start", "cat c/f3"], 1.0), (["cat start", "cat ./c/f3"], 1.0), (["cat start"], 0.5),
             (["cat c/f3", "cat start"], 0.5), (["cat start c/f3"], 0.0), (["cat a/f1 b/f2 c/f3 start"], 0.0),
             (["cat start; cat c/f3"], 0.0), ([], 0.0)]
    for commands, expected in cases:
        assert chain_followed({"commands": commands}, info) == expected, commands
    state = {"commands": ["cat start", "cat c/f3"], "submission": "1234"}
    assert progress(state, info, "1234") == 0.0  # solved: the reward is exactly 1
    assert progress(state, info, "9999") == 1.0
    with pytest.raises(AgentrlError, match="progress_weight"):
        agentrl.load_environment("key-hunt", progress_weight=1.0)
    shaped = agentrl.load_environment("key-hunt", progress_weight=0.3)
    assert shaped.rubric.weights[:2] == [1.0, 0.3]


def test_train_tasks_keeps_the_first_rows_of_the_train_split_only(env):
    few = agentrl.load_environment("key-hunt", train_tasks=6)
    assert [t.answer for t in few.tasks("train")] == [t.answer for t in env.tasks("train")][:6]
    assert [t.answer for t in few.tasks("test")] == [t.answer for t in env.tasks("test")]

def _oracle_episode(oracle, task) -> list[ToolCall]:
    """The oracle's calls over a task, tool outputs read from the task's files (no sandbox)."""
    messages, calls = list(task.prompt), []
    for _ in range(8):
        call: ToolCall = oracle.script(messages, None)["tool_calls"][0]
        calls.append(call)
        messages.append(Message(role="assistant", content="", tool_calls=[call]))
        if call.function.name == "submit":
            return calls
        path = call.function.parsed_arguments()["command"].removeprefix("cat ")
        messages.append(Message(role="tool", content=task.info["files"][path], tool_call_id=call.id, name="bash"))
    raise AssertionError("the oracle did not submit")


def test_a_guessing_oracle_gives_up_after_the_first_file_in_its_share_of_episodes(env):
    factory = import_package_attr(env.path, "key_hunt:oracle_policy", package_name=env.name)
    tasks = env.tasks("train", n=200, seed=0)
    for rate in (0.0, 0.6, 1.0):
        episodes = [_oracle_episode(factory(guess_rate=rate, seed=3), task) for task in tasks]
        guessed = [calls for calls in episodes if len(calls) == 2]  # one cat, then a made-up key
        solved = [calls for calls, task in zip(episodes, tasks)
                  if calls[-1].function.parsed_arguments()["answer"] == task.answer]
        assert len(guessed) + len(solved) == len(tasks)
        assert abs(len(guessed) / len(tasks) - rate) <= 0.08, (rate, len(guessed))
        assert all(len(calls) > 2 for calls in solved)  # the default chain: start, a clue, the key
    def functions(oracle):
        return [[call.function for call in _oracle_episode(oracle, task)] for task in tasks[:20]]

    assert functions(factory(guess_rate=0.6, seed=3)) == functions(factory(guess_rate=0.6, seed=3))  # per episode
    assert functions(factory(guess_rate=0.6, seed=3)) != functions(factory(guess_rate=0.6, seed=4))
    with pytest.raises(AgentrlError, match="guess_rate=1.5"):
        factory(guess_rate=1.5)
