"""Benchmark of the swe environment: grading latency and throughput, and mutation yield.

    python3 bench/swe.py [--per-project 2] [--parallel 1,2,4]

Grades the gold patch of a fixed sample of committed tasks (the first test-split
instances of each project) in fresh Docker sandboxes:
- sequentially, for grading time per task (p50 / p95);
- with N sandboxes at a time, for tasks graded per minute; N=1 is the baseline measured
  in the same run, and the table gives each N's speed-up over it.
The share of generated mutations that validate comes from the generation counts committed
with the data (data/stats.json). Prints a table and writes bench/results/swe.json with
`validated_tasks`, `projects`, `grade_p50_s`, `grade_p95_s`, `graded_per_minute` and
`validation_rate`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "environments" / "swe"))

from rich.console import Console
from rich.table import Table
from swe_grade import grade
from swe_images import build_images
from swe_task import SweInstance

DATA_DIR = ROOT / "environments" / "swe" / "data"
RESULTS = ROOT / "bench" / "results" / "swe.json"


def _rows() -> list[dict]:
    rows: list[dict] = []
    for split in ("test", "train"):
        rows += [json.loads(line) for line in (DATA_DIR / f"{split}.jsonl").read_text().splitlines() if line]
    return rows


def _sample(rows: list[dict], per_project: int) -> list[SweInstance]:
    by_project: dict[str, list[dict]] = {}
    for row in sorted(rows, key=lambda r: (r["split"] != "test", r["instance_id"])):
        by_project.setdefault(row["image_name"], []).append(row)
    return [SweInstance.from_row(row) for image in sorted(by_project) for row in by_project[image][:per_project]]


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


async def _grade_all(instances: list[SweInstance], parallel: int) -> tuple[float, list[float], int]:
    gate = asyncio.Semaphore(parallel)

    async def one(instance: SweInstance):
        async with gate:
            return await grade(instance, instance.patch)

    started = time.monotonic()
    results = await asyncio.gather(*(one(instance) for instance in instances))
    elapsed = time.monotonic() - started
    return elapsed, [result.grade_s for result in results], sum(result.reward == 1.0 for result in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-project", type=int, default=2, help="tasks graded per project")
    parser.add_argument("--parallel", default="1,2,4", help="sandbox counts to measure (the first is the baseline)")
    args = parser.parse_args(argv)
    levels = [int(part) for part in args.parallel.split(",")]

    rows = _rows()
    stats = json.loads((DATA_DIR / "stats.json").read_text())
    projects = sorted({row["repo"] for row in rows})
    build_images()
    instances = _sample(rows, args.per_project)

    runs: dict[int, dict] = {}
    for level in levels:
        elapsed, times, solved = asyncio.run(_grade_all(instances, level))
        runs[level] = {
            "elapsed_s": round(elapsed, 2),
            "graded_per_minute": round(60 * len(instances) / elapsed, 2),
            "grade_p50_s": round(statistics.median(times), 3),
            "grade_p95_s": round(_percentile(times, 0.95), 3),
            "gold_solved": solved,
            "tasks": len(instances),
        }
    baseline = runs[levels[0]]
    project_stats = stats["projects"].values()
    applied = sum(p["applied"] for p in project_stats)
    candidates = sum(p["candidates"] for p in project_stats)
    validated = sum(p["validated"] for p in project_stats)
    result = {
        "validated_tasks": len(rows),
        "projects": len(projects),
        "project_names": projects,
        "splits": {split: sum(row["split"] == split for row in rows) for split in ("train", "test")},
        "grade_p50_s": baseline["grade_p50_s"],
        "grade_p95_s": baseline["grade_p95_s"],
        "graded_per_minute": {str(level): run["graded_per_minute"] for level, run in runs.items()},
        "speedup_vs_1_sandbox": {str(level): round(run["graded_per_minute"] / baseline["graded_per_minute"], 2)
                                 for level, run in runs.items()},
        "gold_solved": {str(level): f"{run['gold_solved']}/{run['tasks']}" for level, run in runs.items()},
        "validation_rate": round(validated / applied, 3) if applied else 0.0,
        "validation_rate_of_candidates": round(validated / candidates, 3) if candidates else 0.0,
        "mutations": {"candidates": candidates, "applied": applied, "validated": validated},
        "runs": {str(level): run for level, run in runs.items()},
        "machine": "2 CPU cores shared with other work; one grading = fresh sandbox + start state + tests",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    table = Table(title=f"swe: grading {len(instances)} gold patches ({len(projects)} projects)")
    for column in ("sandboxes", "tasks/min", "vs 1 sandbox", "p50 s", "p95 s", "gold solved"):
        table.add_column(column, justify="right")
    for level, run in runs.items():
        table.add_row(
            str(level),
            f"{run['graded_per_minute']:.1f}",
            f"{run['graded_per_minute'] / baseline['graded_per_minute']:.2f}x",
            f"{run['grade_p50_s']:.2f}",
            f"{run['grade_p95_s']:.2f}",
            f"{run['gold_solved']}/{run['tasks']}",
        )
    console = Console()
    console.print(table)
    console.print(f"validated tasks: {len(rows)} ({result['splits']}) across {len(projects)} projects; "
                  f"mutations validated: {validated}/{applied} applied = {result['validation_rate']:.1%} "
                  f"({validated}/{candidates} candidates)")
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
