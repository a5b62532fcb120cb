"""Rollouts of a run (`rollouts.jsonl`) or an evaluation (`results.jsonl`), indexed for the browser.

`RolloutIndex` reads the file incrementally: each call to `refresh` reads only the bytes
appended since the last one, up to the last complete line (a run still writing, or killed,
leaves a partial line, which waits for its end), and keeps for every record its byte
offset and a short summary (step, task, reward, turns, tokens, error). Listing and
filtering work on the summaries; a record is read in full only when it is opened.

`token_rows` lays an opened rollout out token by token (`Rollout.sample()`: prompt,
completions and environment responses in order) with the loss mask, the inference
logprob, and, where the record carries them, the trainer's logprobs and their difference.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from pathlib import Path
from typing import Any

from agentrl.errors import NotFoundError

__all__ = ["RolloutIndex", "summarize_record", "task_key", "token_rows"]

PREVIEW_CHARS = 120


def task_key(record: dict[str, Any]) -> str:
    """What identifies a task across folders: its example id, else a hash of its prompt."""
    task = record.get("task") or {}
    if task.get("example_id") is not None:
        return f"{task.get('task', 'default')}:{task['example_id']}"
    prompt = json.dumps(task.get("prompt", []), sort_keys=True)
    return "prompt:" + hashlib.sha1(prompt.encode()).hexdigest()[:16]


def _prompt_preview(task: dict[str, Any]) -> str:
    users = [m.get("content", "") for m in task.get("prompt", []) if m.get("role") == "user"]
    text = " ".join((users[-1] if users else "").split())
    return text[:PREVIEW_CHARS]


def summarize_record(record: dict[str, Any]) -> dict[str, Any]:
    """The fields the rollout list shows and filters on."""
    task = record.get("task") or {}
    turns = record.get("turns") or []
    messages = record.get("messages") or []
    answer = next((m.get("content", "") for m in reversed(messages) if m.get("role") == "assistant"), "")
    return {
        "step": record.get("step"),
        "group_index": record.get("group_index", record.get("task_index")),
        "rollout_index": record.get("rollout_index"),
        "task": task.get("task", "default"),
        "task_key": task_key(record),
        "example_id": task.get("example_id"),
        "prompt": _prompt_preview(task),
        "answer": " ".join(str(answer).split())[:PREVIEW_CHARS],
        "reward": record.get("reward"),
        "advantage": record.get("advantage"),
        "turns": len(turns),
        "completion_tokens": sum(len((t.get("completion") or {}).get("token_ids", [])) for t in turns),
        "tool_calls": sum(len(m.get("tool_calls") or []) for m in messages),
        "error": (record.get("error") or None) and str(record["error"])[:PREVIEW_CHARS],
        "truncated": bool(record.get("truncated")),
    }


class RolloutIndex:
    """Byte offsets and summaries of the records of one JSONL file, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offsets: list[int] = []
        self._summaries: list[dict[str, Any]] = []
        self._read_to = 0
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Index the complete lines appended since the last call."""
        with self._lock:
            if not self.path.is_file():
                return
            size = self.path.stat().st_size
            if size < self._read_to:  # rewritten (a resumed run truncates): start over
                self._offsets, self._summaries, self._read_to = [], [], 0
            if size == self._read_to:
                return
            with open(self.path, "rb") as handle:
                handle.seek(self._read_to)
                data = handle.read(size - self._read_to)
            end = data.rfind(b"\n")
            if end < 0:
                return
            position = self._read_to
            for line in data[: end + 1].splitlines(keepends=True):
                start, position = position, position + len(line)
                try:
                    record = json.loads(line)
                except ValueError:  # not JSON, or not UTF-8
                    continue
                if isinstance(record, dict):
                    summary = summarize_record(record)
                    summary["n"] = len(self._offsets)
                    self._offsets.append(start)
                    self._summaries.append(summary)
            self._read_to += end + 1

    def count(self) -> int:
        self.refresh()
        return len(self._summaries)

    def summaries(self) -> list[dict[str, Any]]:
        self.refresh()
        return self._summaries

    def filter(self, *, step: int | None = None, task: str | None = None, min_reward: float | None = None,
               max_reward: float | None = None) -> list[dict[str, Any]]:
        """Summaries of the records matching every filter given (task: part of its name, id or prompt)."""
        needle = task.lower() if task else None
        matched = []
        for summary in self.summaries():
            reward = summary["reward"]
            if step is not None and summary["step"] != step:
                continue
            if min_reward is not None and (reward is None or reward < min_reward):
                continue
            if max_reward is not None and (reward is None or reward > max_reward):
                continue
            if needle is not None and not any(needle in str(summary[key]).lower()
                                              for key in ("task", "example_id", "prompt", "task_key")):
                continue
            matched.append(summary)
        return matched

    def record(self, n: int) -> dict[str, Any]:
        """The full record number `n`."""
        self.refresh()
        if not 0 <= n < len(self._offsets):
            raise NotFoundError(f"{self.path}: no rollout {n} (there are {len(self._offsets)})")
        with open(self.path, "rb") as handle:
            handle.seek(self._offsets[n])
            return json.loads(handle.readline())


def _finite(value: float | None) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def token_rows(record: dict[str, Any], *, decode: Any = None) -> list[dict[str, Any]]:
    """Per token: id, text (with `decode(id) -> str`, else None), loss mask, inference and trainer logprobs.

    Empty when the rollout has no turns or its turns do not extend each other.
    """
    from agentrl.types import Rollout

    try:
        sample = Rollout.model_validate({key: record[key] for key in ("task", "messages", "turns")
                                         if key in record}).sample()
    except (ValueError, KeyError):
        return []
    trainer = record.get("trainer_logprobs")  # per token of the sample, when the run recorded them
    rows = []
    for position, (token, mask, logprob) in enumerate(zip(sample.token_ids, sample.loss_mask,
                                                         sample.inference_logprobs)):
        trainer_logprob = _finite(trainer[position]) if trainer and position < len(trainer) else None
        rows.append({
            "id": token, "text": decode(token) if decode is not None else None, "loss": mask,
            "logprob": _finite(logprob) if mask else None,
            "trainer_logprob": trainer_logprob if mask else None,
            "mismatch": (logprob - trainer_logprob) if mask and trainer_logprob is not None else None,
            "version": sample.policy_versions[position] if mask else None,
        })
    return rows
