"""key-hunt's task rows: small file trees hiding a key at the end of a chain of clues, made deterministically.

A task is a file tree (paths -> contents) and a chain through it: the chain starts at the file
`start` in the working directory (or, with `named_start`, at a file anywhere in the tree that the
prompt names); each clue holds `next: PATH`, the path of the next file; the last file of the
chain holds `key: NNNN`. Decoy files hold other keys (`key: MMMM`), filler files hold
`nothing here`. Only following the chain tells the right key from the decoys.

Difficulty (`Difficulty`): `clues` (files to follow before the key file, `start` included: an
episode that reads the chain and submits takes `clues + 2` tool calls), `depth` (folders above
each file), `files` (files in the tree) , `distractors` (decoy keys among them) and
`named_start` (the prompt names the first clue's path, which the model must copy).

    python3 environments/key_hunt/key_hunt_data.py          # rebuild data/train.jsonl and data/test.jsonl
    python3 environments/key_hunt/key_hunt_data.py --check  # exit 1 if the committed files differ

Rows are verifiers-style (`prompt`, `answer`, `info`, `task`, `example_id`); the train and
test splits come from different seeds and share no task (same chain and key).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DATA_DIR",
    "DEFAULT",
    "SPLIT_SEEDS",
    "SPLIT_SIZES",
    "Difficulty",
    "make_rows",
    "make_task",
    "read_rows",
    "split_rows",
    "write_splits",
]

DATA_DIR = Path(__file__).resolve().parent / "data"
FOLDERS = "abcd"
FILE_NAMES = [f"f{number}" for number in range(1, 10)]
SPLIT_SEEDS = {"train": 0, "test": 1}
SPLIT_SIZES = {"train": 1000, "test": 128}
FILLER = "nothing here"
START = "start"


class Difficulty(BaseModel):
    """How hard a key-hunt task is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clues: int = Field(default=1, ge=1, le=8)
    """Clue files to follow before the key file (a solving episode takes clues + 2 tool calls)."""
    depth: int = Field(default=1, ge=0, le=4)
    """Folders above every file (0: all files in the working directory)."""
    files: int = Field(default=5, ge=2, le=40)
    """Files in the tree: the chain, the decoys and fillers."""
    distractors: int = Field(default=2, ge=0, le=20)
    """Decoy files holding a wrong key."""
    named_start: bool = False
    """The chain starts at a file anywhere in the tree that the prompt names (else at `start` in the workdir)."""

    @model_validator(mode="after")
    def _fits(self) -> Difficulty:
        needed = self.clues + 1 + self.distractors
        if self.files < needed:
            raise ValueError(f"files={self.files} is fewer than clues + 1 + distractors = {needed}")
        if self.files > len(FOLDERS) ** self.depth * len(FILE_NAMES):
            raise ValueError(f"files={self.files} do not fit in depth={self.depth} "
                             f"({len(FOLDERS)} folders per level, {len(FILE_NAMES)} names per folder)")
        return self

    def label(self) -> str:
        return f"c{self.clues}-d{self.depth}-f{self.files}-x{self.distractors}" + ("" if self.named_start else "-s")


DEFAULT = Difficulty()


def _path(rng: random.Random, depth: int) -> str:
    return "/".join([rng.choice(FOLDERS) for _ in range(depth)] + [rng.choice(FILE_NAMES)])


def make_task(rng: random.Random, difficulty: Difficulty) -> dict[str, Any]:
    """One task: {"files": {path: content}, "chain": [paths, first clue .. key file], "key": "NNNN"}."""
    paths: list[str] = [] if difficulty.named_start else [START]
    while len(paths) < difficulty.files:
        path = _path(rng, difficulty.depth)
        if path not in paths:
            paths.append(path)
    chain = paths[: difficulty.clues + 1]
    keys = rng.sample(range(1000, 10000), 1 + difficulty.distractors)
    key = str(keys[0])
    files = {path: f"next: {following}" for path, following in itertools.pairwise(chain)}
    files[chain[-1]] = f"key: {key}"
    decoys = paths[len(chain): len(chain) + difficulty.distractors]
    for path, decoy in zip(decoys, keys[1:]):
        files[path] = f"key: {decoy}"
    for path in paths[len(chain) + difficulty.distractors:]:
        files[path] = FILLER
    return {"files": dict(sorted(files.items())), "chain": chain, "key": key}


def prompt_text(first_clue: str) -> str:
    return "Find the key. Begin with the file start." if first_clue == START else \
        f"Find the key. The first clue is in {first_clue}."


def make_rows(count: int, *, seed: int, difficulty: Difficulty = DEFAULT, split: str = "train",
              exclude: set[tuple[str, ...]] = frozenset()) -> list[dict[str, Any]]:
    """`count` distinct task rows, deterministic in `seed`; tasks whose (chain, key) is in `exclude` are skipped."""
    rng = random.Random(f"key-hunt-{difficulty.label()}-{seed}")
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > count * 100:
            raise ValueError(f"key-hunt: cannot make {count} distinct tasks at difficulty {difficulty.label()}")
        task = make_task(rng, difficulty)
        identity = (*task["chain"], task["key"])
        if identity in seen:
            continue
        seen.add(identity)
        rows.append({
            "prompt": [{"role": "user", "content": prompt_text(task["chain"][0])}],
            "answer": task["key"],
            "info": {**task, "difficulty": difficulty.model_dump(), "split": split},
            "task": "key-hunt",
            "example_id": f"{split}-{len(rows)}",
        })
    return rows


def split_rows(difficulty: Difficulty = DEFAULT, *, sizes: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """The train and test rows of a difficulty; no test task appears in train."""
    sizes = {**SPLIT_SIZES, **(sizes or {})}
    test = make_rows(sizes["test"], seed=SPLIT_SEEDS["test"], difficulty=difficulty, split="test")
    held_out = {(*row["info"]["chain"], row["answer"]) for row in test}
    train = make_rows(sizes["train"], seed=SPLIT_SEEDS["train"], difficulty=difficulty, split="train",
                      exclude=held_out)
    return {"train": train, "test": test}


def _jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_splits(folder: Path = DATA_DIR, *, check: bool = False) -> list[str]:
    """Write (or with `check`, compare) the committed default-difficulty splits; the files that differ."""
    differing = []
    for split, rows in split_rows(DEFAULT).items():
        path = folder / f"{split}.jsonl"
        text = _jsonl(rows)
        if path.is_file() and path.read_text() == text:
            continue
        differing.append(str(path))
        if not check:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return differing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rebuild key-hunt's committed splits (data/*.jsonl).")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a committed file differs")
    args = parser.parse_args(argv)
    differing = write_splits(check=args.check)
    for path in differing:
        print(f"{'differs' if args.check else 'wrote'}: {path}")
    return 1 if args.check and differing else 0


if __name__ == "__main__":
    sys.exit(main())
