"""The must-show figures of an agent run, with their noise: training reward windows and held-out solve rates.

    python3 cookbook/cpu-agent/figures.py RUN EVAL [--window 20] [--out RUN/figures.md]

RUN is an `agentrl train` folder (metrics.jsonl); EVAL the folder of `agentrl eval --model
RUN/checkpoints/step_N -o EVAL`: the checkpoint's `results.jsonl` there, the baseline's in `EVAL-baseline`
(the same tasks, seed and sampling for both). Printed and written as markdown:

- training solve rate (`metrics/solved`, else the reward): the mean of the first and the last `window` steps, and their difference, each
  with a 95% interval from a bootstrap over steps (a step's reward is the mean of its rollouts);
- held-out pass@1 (mean solve rate over a task's rollouts) and pass@k (a task solved by any of its k
  rollouts) of checkpoint and baseline, and the paired difference, each with a 95% interval from a
  bootstrap over tasks (rollouts of one task are not independent draws, tasks are).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

RESAMPLES = 10_000


def _interval(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[int(0.025 * len(ordered))], ordered[int(0.975 * len(ordered)) - 1]


def _bootstrap(samples: list, statistic, *, seed: int = 0) -> tuple[float, tuple[float, float]]:
    rng = random.Random(seed)
    draws = [statistic([rng.choice(samples) for _ in samples]) for _ in range(RESAMPLES)]
    return statistic(samples), _interval(draws)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def reward_windows(run: Path, window: int) -> dict[str, tuple[float, tuple[float, float]]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    key = "metrics/solved" if all("metrics/solved" in row for row in rows) else "reward"
    rewards = [float(row[key]) for row in sorted(rows, key=lambda row: row["step"])]
    if len(rewards) < 2 * window:
        raise SystemExit(f"{run}: {len(rewards)} steps, fewer than two windows of {window}")
    first, last = rewards[:window], rewards[-window:]
    pairs = list(range(window))
    rng = random.Random(1)
    diffs = []
    for _ in range(RESAMPLES):
        diffs.append(_mean(last[rng.choice(pairs)] for _ in pairs) - _mean(first[rng.choice(pairs)] for _ in pairs))
    return {"first": _bootstrap(first, _mean), "last": _bootstrap(last, _mean),
            "difference": (_mean(last) - _mean(first), _interval(diffs))}


def per_task(results: Path) -> dict[int, list[float]]:
    solved: dict[int, list[float]] = {}
    for line in results.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            solved.setdefault(int(record["task_index"]), []).append(float(record["reward"] >= 1.0))
    return solved


def solve_rates(evaluation: Path) -> dict[str, dict[str, tuple[float, tuple[float, float]]]]:
    checkpoint = per_task(evaluation / "results.jsonl")
    baseline = per_task(evaluation.with_name(evaluation.name + "-baseline") / "results.jsonl")
    tasks = sorted(set(checkpoint) & set(baseline))
    k = min(len(checkpoint[tasks[0]]), len(baseline[tasks[0]]))
    statistics = {"pass@1": lambda runs: _mean(runs), f"pass@{k}": lambda runs: float(max(runs[:k]))}
    figures = {}
    for name, of_task in statistics.items():
        def rate(chosen, table, of_task=of_task):
            return _mean(of_task(table[task]) for task in chosen)
        figures[name] = {
            "checkpoint": _bootstrap(tasks, lambda chosen: rate(chosen, checkpoint)),
            "baseline": _bootstrap(tasks, lambda chosen: rate(chosen, baseline)),
            "difference": _bootstrap(tasks, lambda chosen: rate(chosen, checkpoint) - rate(chosen, baseline)),
        }
    figures["tasks"] = len(tasks)
    figures["rollouts_per_task"] = k
    return figures


def _cell(figure: tuple[float, tuple[float, float]], *, signed: bool = False) -> str:
    value, (low, high) = figure
    sign = "+" if signed else ""
    return f"{value:{sign}.3f} [{low:{sign}.3f}, {high:{sign}.3f}]"


def markdown(run: Path, evaluation: Path, window: int) -> str:
    windows = reward_windows(run, window)
    rates = solve_rates(evaluation)
    lines = [f"## Figures (95% bootstrap intervals, {RESAMPLES:,} resamples)", "",
             f"Held-out: {rates['tasks']} test tasks x {rates['rollouts_per_task']} rollouts, checkpoint "
             "against the run's starting weights (the same tasks, seed and sampling; intervals over tasks, the "
             "difference paired by task).", "",
             "| | checkpoint | warm start | difference |", "|---|---|---|---|"]
    for name in (key for key in rates if key.startswith("pass@")):
        figure = rates[name]
        lines.append(f"| {name} | {_cell(figure['checkpoint'])} | {_cell(figure['baseline'])} | "
                     f"{_cell(figure['difference'], signed=True)} |")
    lines += ["", f"Training reward (solve rate of the step's rollouts), first {window} steps against the last "
              f"{window} (intervals over steps):", "",
              "| first steps | last steps | difference |", "|---|---|---|",
              f"| {_cell(windows['first'])} | {_cell(windows['last'])} | {_cell(windows['difference'], signed=True)} |",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
