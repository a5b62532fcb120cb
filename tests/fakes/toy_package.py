"""A minimal environment package written into a folder: test data for the hub tests (not a fake).

The package is a real one: `environment.toml`, a module with `load_environment`, a jsonl
split, a README, and optionally a Dockerfile building a tiny image.
"""

from __future__ import annotations

import json
from pathlib import Path

TOY_MODULE = '''"""Toy environment: echo a word back (rows in data/train.jsonl)."""

import json
from pathlib import Path

from agentrl.environment import SingleTurnEnv, rows_to_dataset
from agentrl.rubric import Rubric


def exact(completion, answer: str) -> float:
    return float(bool(completion) and completion[-1].content.strip() == answer)


def load_environment(**kwargs):
    lines = (Path(__file__).resolve().parent / "data" / "train.jsonl").read_text().splitlines()
    rows = rows_to_dataset([json.loads(line) for line in lines if line.strip()])
    return SingleTurnEnv(dataset=rows, eval_dataset=rows, rubric=Rubric(funcs=[exact]), **kwargs)
'''


def write_toy_package(
    folder: Path, *, name: str = "toy-echo", version: str = "0.1.0", rows: int = 3, base_image: str | None = None,
    extra_manifest: str = "", readme: str = "# Toy echo\n\nEcho a word back.\n",
) -> Path:
    """Write the toy package into `folder` and return it."""
    folder = Path(folder)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    sandbox = ""
    if base_image:
        sandbox = (f'\n[sandbox]\nimage = "{name}:{version}"\ndockerfile = "Dockerfile"\n')
        (folder / "Dockerfile").write_text(f"FROM {base_image}\nCOPY README.md /toy-readme.md\n")
    (folder / "environment.toml").write_text(
        f'name = "{name}"\nversion = "{version}"\ndescription = "Echo a word back"\n'
        f'tags = ["toy", "single-turn"]\nentrypoint = "toy_echo:load_environment"\n{extra_manifest}\n'
        f'[dataset.splits]\ntrain = "data/train.jsonl"\n{sandbox}'
    )
    (folder / "toy_echo.py").write_text(TOY_MODULE)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    with open(folder / "data" / "train.jsonl", "w") as handle:
        for index in range(rows):
            word = words[index % len(words)] + str(index)
            handle.write(json.dumps({"prompt": [{"role": "user", "content": f"say {word}"}], "answer": word,
                                     "info": {"index": index}, "task": "echo"}) + "\n")
    (folder / "README.md").write_text(readme)
    return folder
