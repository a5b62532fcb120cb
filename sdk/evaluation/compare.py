"""A training checkpoint's evaluation beside its base model's: the baseline, the pair, the table.

    agentrl.evaluate("reverse-text", checkpoint="runs/x/checkpoints/step_40")          # baseline from the run
    agentrl.evaluate("reverse-text", checkpoint="runs/x/checkpoints/step_40", baseline="tiny-moe")
    agentrl eval --model runs/x/checkpoints/step_40                                     # CLI: table of both

A checkpoint folder written by `agentrl train` (`RUN/checkpoints/step_N`) is a Hugging
Face folder vLLM serves directly. Its baseline defaults to the model the run started
from (the run's `config.toml`: `model.init_checkpoint`, else `model.name`, `run_baseline`).
`agentrl.evaluation.engine.compare_checkpoint` evaluates both with the same tasks, seed and sampling,
one vLLM server at a time, into a `Comparison`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from agentrl.project_files import resolve_project_path

__all__ = ["Comparison", "run_baseline", "comparison_table"]

def run_baseline(checkpoint: str | Path) -> str | None:
    """The model a run checkpoint started from, or None when the folder is not a run checkpoint."""
    folder = Path(checkpoint).expanduser()
    run_config = folder.parent.parent / "config.toml"
    if folder.parent.name != "checkpoints" or not run_config.is_file():
        return None
    try:
        data = tomllib.loads(run_config.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    model = data.get("model") or {}
    start = model.get("init_checkpoint")
    if start:
        return str(resolve_project_path(start))  # recipes name cookbook/... paths
    return model.get("name")


class Comparison(BaseModel):
    """A checkpoint's evaluation next to its baseline's."""

    checkpoint: Any
    """EvalSummary of the checkpoint."""
    baseline: Any
    """EvalSummary of the baseline model."""

    @property
    def reward_delta(self) -> float:
        """Mean reward of the checkpoint minus the baseline's."""
        return self.checkpoint.mean_reward - self.baseline.mean_reward

    def task_delta(self, key: str = "reward"):
        """The checkpoint's per-task `key` (mean reward, pass@k) minus the baseline's on the same tasks, with the
        bootstrap interval of the mean difference (`agentrl.stats.Delta`); None when the two did not run the same
        tasks."""
        from agentrl.stats import paired_delta

        ours = (getattr(self.checkpoint, "per_task", None) or {}).get(key)
        theirs = (getattr(self.baseline, "per_task", None) or {}).get(key)
        if not ours or not theirs or len(ours) != len(theirs):
            return None
        return paired_delta(theirs, ours)


def comparison_table(comparison: Comparison):
    """A rich table with the checkpoint and the baseline side by side."""
    from rich.table import Table

    ckpt, base = comparison.checkpoint, comparison.baseline
    table = Table(title=f"{ckpt.env}: checkpoint vs baseline, {ckpt.num_tasks} tasks x {ckpt.rollouts_per_task}")
    table.add_column("metric")
    table.add_column(f"checkpoint\n{Path(ckpt.model).name}", justify="right")
    table.add_column(f"baseline\n{Path(base.model).name}", justify="right")
    table.add_column("delta (checkpoint - baseline)", justify="right")
    table.add_column("95% CI of the delta", justify="right")
    rows = [("mean reward", ckpt.mean_reward, base.mean_reward, "reward"),
            (f"avg@{ckpt.rollouts_per_task}", ckpt.avg_at_k, base.avg_at_k, "reward")]
    rows += [
        (f"pass@{k}", value, base.pass_at_k.get(k, float("nan")), f"pass@{k}") for k, value in ckpt.pass_at_k.items()
    ]
    rows += [
        (f"metric {name}", value, base.metrics.get(name, float("nan")), None) for name, value in ckpt.metrics.items()
    ]
    for name, a, b, per_task in rows:
        delta = comparison.task_delta(per_task) if per_task else None
        interval = f"{delta.low:+.4f} to {delta.high:+.4f}" if delta is not None else ""
        table.add_row(name, f"{a:.4f}", f"{b:.4f}", f"{a - b:+.4f}", interval)
    table.add_row("completion tokens", str(ckpt.completion_tokens), str(base.completion_tokens),
                  f"{ckpt.completion_tokens - base.completion_tokens:+d}")
    table.add_row("errors", str(ckpt.errors), str(base.errors), f"{ckpt.errors - base.errors:+d}")
    return table
