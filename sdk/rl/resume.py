"""Periodic checkpoints of trainer + orchestrator state, and finding the one to resume from.

    runs/<name>/checkpoints/step_N/
      config.json, model.safetensors, tokenizer files   HF export of the policy after N steps
                                                        (`agentrl eval --model .../step_N` serves it)
      trainer/                                          the trainer's DCP checkpoint (model, optimizer, RNG)
      orchestrator.json                                 OrchestratorState (next step = N, counters)
      COMPLETE                                          written last: only complete checkpoints count

A checkpoint is written into `step_N.partial` and renamed when complete, so a `kill -9` at
any moment leaves either a complete checkpoint or a `.partial` folder that is ignored
(and removed on resume). Resuming from step_N restarts at step N: metrics of steps >= N
are cut from metrics.jsonl and those steps are trained again from the checkpoint's exact
state, so in the finished run every step was applied exactly once.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from agentrl.errors import NotFoundError
from agentrl.rl.orchestrator import OrchestratorState

__all__ = ["CheckpointInfo", "checkpoint_dir", "begin_checkpoint", "commit_checkpoint", "list_checkpoints",
           "latest_checkpoint", "load_orchestrator_state", "prune_checkpoints", "remove_partials"]

_STEP_RE = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


class CheckpointInfo:
    """A complete checkpoint folder and its step."""

    def __init__(self, path: Path, step: int) -> None:
        self.path = path
        self.step = step

    @property
    def trainer_path(self) -> Path:
        return self.path / "trainer"

    def __repr__(self) -> str:
        return f"CheckpointInfo({self.path}, step={self.step})"


def checkpoint_dir(root: Path, step: int) -> Path:
    """Where step N's checkpoint lives."""
    return Path(root) / f"step_{step}"


def begin_checkpoint(root: Path, step: int) -> Path:
    """A fresh `step_N.partial` folder to write the checkpoint into."""
    partial = Path(root) / f"step_{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def commit_checkpoint(partial: Path, state: OrchestratorState) -> CheckpointInfo:
    """Write the orchestrator state and the COMPLETE marker, then move `.partial` into place."""
    (partial / "orchestrator.json").write_text(json.dumps(state.to_dict(), indent=2))
    (partial / COMPLETE).write_text(str(state.step))
    final = partial.with_name(partial.name.removesuffix(".partial"))
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    return CheckpointInfo(final, state.step)


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    found = []
    if not root.is_dir():
        return found
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and (child / COMPLETE).is_file() and (child / "orchestrator.json").is_file():
            found.append(CheckpointInfo(child, int(match.group(1))))
    return sorted(found, key=lambda info: info.step)


def latest_checkpoint(root: Path) -> CheckpointInfo | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_orchestrator_state(info: CheckpointInfo) -> OrchestratorState:
    path = info.path / "orchestrator.json"
    try:
        state = OrchestratorState.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError) as error:
        raise NotFoundError(
            f"{path}: unreadable orchestrator state ({error}); resume from an earlier checkpoint"
        ) from None
    if state.step != info.step:
        raise NotFoundError(f"{path}: says step {state.step} but the folder is step_{info.step}")
    return state


def prune_checkpoints(root: Path, *, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints."""
    found = list_checkpoints(root)
    for info in found[: max(0, len(found) - max(1, keep))]:
        shutil.rmtree(info.path, ignore_errors=True)


def remove_partials(root: Path) -> None:
    """Remove checkpoints a crash left half-written."""
    root = Path(root)
    if root.is_dir():
        for child in root.iterdir():
            if child.name.endswith(".partial"):
                shutil.rmtree(child, ignore_errors=True)
