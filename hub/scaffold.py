"""`agentrl env init NAME`: write a working environment package to start from.

The scaffold is a single-turn environment with a jsonl train/test split, an exact-match
reward, an `oracle_policy()` (`agentrl eval --oracle` plays it), a README (the dataset card), and a
pytest file that loads the package and scores an oracle and a wrong reply with a ScriptedPolicy.
It validates, pushes and passes its test as written; the author then edits the rows, prompt and reward.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from agentrl.errors import AgentrlError

__all__ = ["create_scaffold"]

_NAME_RE = re.compile(r"^[a-z][a-z0-9\-_]{0,63}$")

_MANIFEST = '''name = "{name}"
version = "0.1.0"
description = "TODO: one line saying what the agent must do"
tags = ["single-turn"]
entrypoint = "{module}:load_environment"
license = "Apache-2.0"
requirements = []

[reward]
description = "1.0 when the reply equals the reference answer, else 0.0"

[dataset.splits]
train = "data/train.jsonl"
test = "data/test.jsonl"
'''

_MODULE = '''"""{name}: TODO describe the task. Rows live in data/*.jsonl (prompt, answer, info, task)."""

from __future__ import annotations

import json
from pathlib import Path

from agentrl.environment import SingleTurnEnv, rows_to_dataset
from agentrl.policies import ScriptedPolicy
from agentrl.rubric import Rubric

DATA = Path(__file__).resolve().parent / "data"
SYSTEM_PROMPT = "Answer with the answer only."


def read_rows(split: str) -> list[dict]:
    """The rows of one split, from data/<split>.jsonl."""
    lines = (DATA / f"{{split}}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def exact_match(completion, answer: str) -> float:
    """1.0 when the last reply, stripped, equals the answer."""
    reply = completion[-1].content.strip() if completion else ""
    return float(reply == answer.strip())


def load_environment(*, system_prompt: str = SYSTEM_PROMPT) -> SingleTurnEnv:
    """The {name} environment."""
    return SingleTurnEnv(
        name="{name}",
        dataset=rows_to_dataset(read_rows("train")),
        eval_dataset=rows_to_dataset(read_rows("test")),
        rubric=Rubric(funcs=[exact_match], weights=[1.0]),
        system_prompt=system_prompt,
    )


def oracle_policy() -> ScriptedPolicy:
    """The reference answers as a policy: `agentrl eval --env . --oracle` plays it (every rollout should pass),
    and `agentrl sft` learns from its rollouts."""
    answers = {{json.dumps(row["prompt"]): row["answer"] for split in ("train", "test") for row in read_rows(split)}}

    def reply(messages, tools):
        question = [{{"role": m.role, "content": m.content}} for m in messages if m.role != "system"]
        return answers.get(json.dumps(question), "")

    return ScriptedPolicy(reply)
'''

_TEST = '''"""{name}: the package loads and its reward tells right from wrong."""

import asyncio
from pathlib import Path

import agentrl
from agentrl.policies import ScriptedPolicy
from agentrl.sampling import SamplingConfig

PACKAGE = Path(__file__).resolve().parents[1]


def run_one(env, task, reply):
    rollouts = asyncio.run(env.run_group(ScriptedPolicy([reply]), task, n=1, sampling=SamplingConfig()))
    return rollouts[0]


def test_oracle_scores_one_and_wrong_scores_zero():
    env = agentrl.load_environment(PACKAGE)
    task = env.tasks("test")[0]
    right = run_one(env, task, task.answer)
    assert right.error is None and right.reward == 1.0
    assert run_one(env, task, "not it").reward == 0.0
'''

_README = '''# {name}

TODO: what the task is, where the rows come from, how the reward works.

Check that the reference answers score 1 (the module's `oracle_policy()`), then validate and publish:

    agentrl eval --env . --oracle
    agentrl env validate .
    agentrl env push .
'''

_ROWS = {
    "train": [("What is the capital of France?", "Paris"), ("What is 2 + 2?", "4"),
              ("Spell 'cat' backwards.", "tac")],
    "test": [("What is the capital of Italy?", "Rome"), ("What is 3 + 4?", "7")],
}


def create_scaffold(name: str, *, directory: str | Path | None = None) -> Path:
    """Write the scaffold for `name` into `directory` (default ./NAME), which must not exist or be empty."""
    if not _NAME_RE.match(name):
        raise AgentrlError(f"env init {name!r}: the name must start with a lowercase letter, then lowercase "
                           "letters, digits, '-' or '_' (at most 64), e.g. my-env (it names the Python module too)")
    folder = Path(directory) if directory is not None else Path(name)
    if folder.exists() and any(folder.iterdir()):
        raise AgentrlError(f"{folder}: folder exists and is not empty; pick another --dir")
    module = name.replace("-", "_")
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "tests").mkdir(exist_ok=True)
    (folder / "environment.toml").write_text(_MANIFEST.format(name=name, module=module))
    (folder / f"{module}.py").write_text(_MODULE.format(name=name))
    (folder / "tests" / f"test_{module}.py").write_text(_TEST.format(name=name))
    (folder / "README.md").write_text(_README.format(name=name))
    for split, pairs in _ROWS.items():
        with open(folder / "data" / f"{split}.jsonl", "w") as handle:
            for index, (question, answer) in enumerate(pairs):
                row = {"prompt": [{"role": "user", "content": question}], "answer": answer,
                       "info": {"index": index}, "task": name}
                handle.write(json.dumps(row) + "\n")
    return folder
