"""A bounded sample of each step's rollouts, written into the run folder as the run goes.

    runs/<name>/rollouts.jsonl     one JSON object per recorded rollout

After every optimizer step the orchestrator hands its groups to `RolloutLog.record`, which
appends `run.rollout_samples_per_step` of them (spread over the step's groups: the first
rollout of each group, then the second, ...), so `agentrl view` and later analysis can read
what the policy did while it trained. A record is the rollout as `results.jsonl` of
`agentrl eval` holds it (`Rollout.model_dump`: task, messages with tool calls and tool
outputs, turns with token ids, inference logprobs and weight versions, reward, reward parts
in `metrics`, error, state such as a SWE diff) plus where it came from:

    step, group_index, rollout_index, advantage (None when the rollout was not trained on),
    policy_versions, time, trainer_logprobs

`trainer_logprobs` (when the rollout was trained on) is the trainer's logprob of each token of
the rollout's training sample (`Rollout.sample().token_ids`: prompt and completion tokens of
its turns), None for tokens outside the loss mask; it comes from the step's own forward pass
(the orchestrator asks the trainer for the samples `RolloutLog.pick` names), so with the
inference logprobs the viewer shows the trainer-vs-inference mismatch per token.

and with routed experts left out (they are (tokens, layers, top_k) arrays, most of a record).
Strings longer than `MAX_STRING_CHARS` are cut with a marker; once the file reaches
`run.rollouts_max_mb` nothing more is written (a warning says so once). Each line is
written whole and flushed, so a killed run leaves at worst one torn last line, which
readers skip.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.types import Rollout

__all__ = ["MAX_STRING_CHARS", "ROLLOUTS_FILE", "RolloutLog", "pick_rollouts", "rollout_record"]

ROLLOUTS_FILE = "rollouts.jsonl"
MAX_STRING_CHARS = 20_000
"""Longest string kept in a record (message contents, tool outputs, diffs); longer ones are cut."""


def _cut(value: Any) -> Any:
    if isinstance(value, str):
        if len(value) <= MAX_STRING_CHARS:
            return value
        return value[:MAX_STRING_CHARS] + f"\n[... {len(value) - MAX_STRING_CHARS:,} more characters cut]"
    if isinstance(value, dict):
        return {key: _cut(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_cut(item) for item in value]
    if isinstance(value, float) and value != value:  # NaN is no JSON
        return None
    return value


def rollout_record(rollout: Rollout, **origin: Any) -> dict[str, Any]:
    """One rollout as a JSON-ready dict: `origin` keys first, then `Rollout.record` (no routed experts)."""
    return {**origin, "policy_versions": rollout.policy_versions, **_cut(rollout.record())}


def pick_rollouts(groups: Sequence[Sequence[Any]], count: int) -> list[tuple[int, int]]:
    """(group, member) of `count` rollouts spread over the groups: each first rollout, then each second..."""
    picked: list[tuple[int, int]] = []
    depth = max((len(group) for group in groups), default=0)
    for member in range(depth):
        for index, group in enumerate(groups):
            if len(picked) == count:
                return picked
            if member < len(group):
                picked.append((index, member))
    return picked


class RolloutLog:
    """Appends a sample of each step's rollouts to `<run>/rollouts.jsonl`, up to a size cap."""

    def __init__(self, run_dir: str | Path, *, samples_per_step: int, max_bytes: int) -> None:
        self.path = Path(run_dir) / ROLLOUTS_FILE
        self.samples_per_step = samples_per_step
        self.max_bytes = max_bytes
        self.full = False

    def truncate(self, *, before_step: int) -> None:
        """Keep only the records of steps < before_step (a resumed run redoes the later steps)."""
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if int(json.loads(line).get("step", -1)) < before_step:
                    kept.append(line + "\n")
            except (json.JSONDecodeError, TypeError, ValueError, AttributeError):
                continue  # a torn line
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)

    def pick(self, groups: Sequence[Any]) -> list[tuple[int, int]]:
        """(group, member) of the rollouts `record` keeps of these groups (none once the log is full)."""
        if self.samples_per_step <= 0 or self.full:
            return []
        return pick_rollouts([group.rollouts for group in groups], self.samples_per_step)

    def record(self, step: int, groups: Sequence[Any], advantages: Sequence[Sequence[float | None]], *,
               trainer_logprobs: dict[tuple[int, int], list[float | None]] | None = None) -> int:
        """Append the step's sample: `groups` are `ScoredGroup`s, `advantages[g][m]` (or None),
        `trainer_logprobs[(g, m)]` the trainer's per-token logprobs of that rollout's sample.

        Returns how many records were written (0 once the cap is reached).
        """
        picked = self.pick(groups)
        if not picked:
            return 0
        trainer_logprobs = trainer_logprobs or {}
        size = self.path.stat().st_size if self.path.is_file() else 0
        lines = []
        now = time.time()
        for index, member in picked:
            group = groups[index]
            known = index < len(advantages) and member < len(advantages[index])
            advantage = advantages[index][member] if known else None
            record = rollout_record(group.rollouts[member], step=step, group_index=group.index,
                                    rollout_index=member, advantage=advantage, time=now,
                                    trainer_logprobs=trainer_logprobs.get((index, member)))
            line = json.dumps(record) + "\n"
            if size + len(line) > self.max_bytes:
                self.full = True
                warnings.warn(f"{self.path} reached run.rollouts_max_mb ({self.max_bytes / 2**20:g} MB): "
                              "no more rollouts are recorded in this run; raise it to keep more",
                              RuntimeWarning, stacklevel=2)
                break
            size += len(line)
            lines.append(line)
        if lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write("".join(lines))
                handle.flush()
        return len(lines)
