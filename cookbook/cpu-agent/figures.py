"""The must-show figures of an agent run, with their noise: training solve-rate windows and held-out solve rates.

    python3 cookbook/cpu-agent/figures.py RUN EVAL [--window 20] [--out RUN/figures.md]

RUN is an `agentrl train` folder (metrics.jsonl); EVAL the folder of `agentrl eval --model
RUN/checkpoints/step_N -o EVAL`: the checkpoint's `results.jsonl` there, the baseline's in `EVAL-baseline`
(the same tasks, seed and sampling for both). Printed and written as markdown, with 95% bootstrap
intervals from `agentrl.stats`:

- training solve rate (`metrics/solved`, else the reward): the first and the last `window` steps and
  the interval of their difference (over steps);
- held-out pass@1 (a task's solve rate over its rollouts) and pass@k (a task solved by any of its k
  rollouts) of checkpoint and baseline (intervals over tasks: rollouts of one task are not independent
  draws) and their difference, paired by task.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentrl.stats import bootstrap_interval, paired_delta, window_delta


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def per_task(results: Path) -> dict[int, list[float]]:
    """Solved (reward >= 1) per rollout, by task index, from an evaluation's results.jsonl."""
    solved: dict[int, list[float]] = {}
    for line in results.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            solved.setdefault(int(record["task_index"]), []).append(float(record["reward"] >= 1.0))
    return solved


def _cell(values: list[float]) -> str:
    low, high = bootstrap_interval(values)
    return f"{_mean(values):.3f} [{low:.3f}, {high:.3f}]"


def _delta(delta) -> str:
    return f"{delta.delta:+.3f} [{delta.low:+.3f}, {delta.high:+.3f}]"


def markdown(run: Path, evaluation: Path, window: int) -> str:
    rows = sorted((json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()),
                  key=lambda row: row["step"])
    key = "metrics/solved" if all("metrics/solved" in row for row in rows) else "reward"
    series = [float(row[key]) for row in rows]
    windows = window_delta(series, window)
    if windows is None:
        raise SystemExit(f"{run}: {len(series)} steps, fewer than two windows of {window}")
    # the windows the difference compares: failed steps (NaN) left out, shrunk to half a short run
    series, window = [value for value in series if value == value], windows.n
    checkpoint = per_task(evaluation / "results.jsonl")
    baseline = per_task(evaluation.with_name(evaluation.name + "-baseline") / "results.jsonl")
    tasks = sorted(set(checkpoint) & set(baseline))
    k = min(len(checkpoint[tasks[0]]), len(baseline[tasks[0]]))
    lines = ["## Figures (95% bootstrap intervals)", "",
             f"Held-out: {len(tasks)} test tasks x {k} rollouts, checkpoint against the run's starting weights "
             "(the same tasks, seed and sampling; intervals over tasks, the difference paired by task).", "",
             "| | checkpoint | warm start | difference |", "|---|---|---|---|"]
    for name, of_task in (("pass@1", _mean), (f"pass@{k}", lambda runs: float(max(runs[:k])))):
        after = [of_task(checkpoint[task]) for task in tasks]
        before = [of_task(baseline[task]) for task in tasks]
        lines.append(f"| {name} | {_cell(after)} | {_cell(before)} | {_delta(paired_delta(before, after))} |")
    lines += ["", f"Training {'solve rate' if key != 'reward' else 'reward'} of the step's rollouts, first {window} "
              f"steps against the last {window} (intervals over steps):", "",
              "| first steps | last steps | difference |", "|---|---|---|",
              f"| {_cell(series[:window])} | {_cell(series[-window:])} | {_delta(windows)} |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The figures of an agent run against their noise.")
    parser.add_argument("run", type=Path)
    parser.add_argument("evaluation", type=Path)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    text = markdown(args.run, args.evaluation, args.window)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
