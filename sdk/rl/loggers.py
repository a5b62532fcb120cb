"""Step metrics into TensorBoard and Weights & Biases (`[run] loggers = ["tensorboard", "wandb"]`).

`metrics.jsonl` stays the run's own record; these loggers copy each step's numbers to the
tools people already watch:

- `tensorboard`: event files in `<run>/tensorboard/`, written with the `tensorboard`
  package's own event writer (`EventFileWriter`, tfrecord of `Event` protos with
  `simple_value` scalars, what `torch.utils.tensorboard` writes too) so neither torch nor
  TensorFlow is needed; `tensorboard --logdir <run>/tensorboard` shows them. Extra `tensorboard`.
- `wandb`: a W&B run in `<run>/wandb/`, offline unless `WANDB_API_KEY` is set (then online,
  in `run.wandb_project`); `wandb sync` uploads an offline run later. Extra `wandb`.

A resumed run (`agentrl train --resume`, `resume_step` = the checkpoint's step, the first step
it redoes) continues both instead of starting again, so no step is logged twice:

- TensorBoard: the new event file starts with a `SessionLog(START)` event at `resume_step`,
  which tells TensorBoard's reader to drop every event of the earlier files at that step or
  later (what `SummaryWriter(purge_step=...)` writes); the redone steps then show once, with
  the resumed run's values.
- W&B: the run's id is kept in `<run>/wandb/run_id`, and the resumed run opens the same run
  (`wandb.init(id=..., resume="allow")`; offline, a new `offline-run-*-<id>` folder that
  `wandb sync` adds to that run). W&B keeps a run's steps increasing, so online the steps
  between the checkpoint and the interruption keep the values first logged for them.

Both get `scalars(metrics)`: every finite number, nested dicts flattened with `/`
(`staleness/0`, `staleness/1`), booleans as 0/1; strings (`bound`, `first_error`) are left
out, except `bound`, which becomes `inference_bound` (1 when the step waited on inference).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

from agentrl.errors import ConfigError, require

__all__ = ["StepLogger", "TensorBoardLogger", "WandbLogger", "make_loggers", "scalars"]


def scalars(metrics: dict[str, Any], *, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a step's metrics, flattened (`staleness/1`); `bound` as `inference_bound` 0/1."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, prefix=f"{name}/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
        elif key == "bound" and value in ("inference", "trainer"):
            out[f"{prefix}inference_bound"] = float(value == "inference")
    return out


class StepLogger(Protocol):
    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        """Send one step's metrics."""
        ...

    def close(self) -> None:
        """Flush and finish."""
        ...


class TensorBoardLogger:
    """Scalars into TensorBoard event files under `folder`."""

    def __init__(self, folder: str | Path, *, resume_step: int | None = None) -> None:
        require("tensorboard", "tensorboard")
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.folder = Path(folder)
        self._writer = EventFileWriter(str(self.folder), flush_secs=10)
        if resume_step is not None:  # the reader drops the earlier files' events of steps >= resume_step
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=resume_step, session_log=start))
            self._writer.flush()

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [summary_pb2.Summary.Value(tag=tag, simple_value=value)
                  for tag, value in scalars(metrics).items() if tag != "step"]
        event = event_pb2.Event(wall_time=float(metrics.get("time") or time.time()), step=step,
                                summary=summary_pb2.Summary(value=values))
        self._writer.add_event(event)
        self._writer.flush()  # a step takes seconds; the curves should not wait for the run to end

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run in `folder` (offline without WANDB_API_KEY)."""

    def __init__(self, folder: str | Path, *, project: str, name: str, config: dict[str, Any],
                 resume: bool = False) -> None:
        wandb = require("wandb", "wandb")
        self.folder = Path(folder)
        id_file = self.folder / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        self.mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        known = id_file.read_text().strip() if resume and id_file.is_file() else None
        self._run = wandb.init(project=project, name=name, dir=str(self.folder), config=config,
                               mode=self.mode, settings=wandb.Settings(silent=True, console="off"),
                               reinit="create_new", **({"id": known, "resume": "allow"} if known else {}))
        self.run_id = self._run.id
        id_file.write_text(self.run_id + "\n")

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        self._run.log({tag: value for tag, value in scalars(metrics).items() if tag != "step"}, step=step)

    def close(self) -> None:
        self._run.finish()


def make_loggers(names: list[str], *, run_dir: str | Path, run_name: str, project: str = "agentrl",
                 config: dict[str, Any] | None = None, resume_step: int | None = None) -> list[StepLogger]:
    """The loggers `run.loggers` names, writing into `run_dir` (one-line errors); `resume_step`: the
    run resumes at that step (see the module docstring)."""
    loggers: list[StepLogger] = []
    try:
        for name in dict.fromkeys(names):
            if name == "tensorboard":
                loggers.append(TensorBoardLogger(Path(run_dir) / "tensorboard", resume_step=resume_step))
            elif name == "wandb":
                loggers.append(WandbLogger(Path(run_dir), project=project, name=run_name,
                                           config=config or {}, resume=resume_step is not None))
            else:
                raise ConfigError(f"run.loggers: unknown logger {name!r}; use \"tensorboard\" or \"wandb\"")
    except BaseException:
        for logger in loggers:
            logger.close()
        raise
    return loggers
