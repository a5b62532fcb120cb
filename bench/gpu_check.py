"""The one-GPU check's verdict: runs of cookbook/gpu-1xh200 and the GPU tests against committed baselines.

    python3 bench/gpu_check.py RUN [RUN ...] [--tests-log LOG ...] [--commit ID] [--results FILE]

`scripts/gpu_check.sh` runs the GPU tests and the 30-step recipe on the H200 and then this. Each run
folder (config.toml, metrics.jsonl, weight_updates.jsonl, report.md; `exit_code` and
`phase_seconds` files written beside them by the script) is checked:

| check | passes when |
|---|---|
| completed | the run reached its `max_steps` with exit status 0 (no out-of-memory or other failure) |
| reward_rising | reward mean of the last 10 steps above the first 10 |
| mismatch_kl | median mismatch KL of the on-policy samples (`train/mismatch_kl_on_policy`: samples wholly from the
  weights the step starts from) within 2x of the synchronous baseline run's (results/sync-16-steps, where every
  sample is on-policy) |
| weights_verified | every weight update's line checked every server (`weights/verified` 1 from step 0 on) |
| mismatch_kl_all | median mismatch KL of all samples within 2x of the median of the profile's reference runs' (earlier
  healthy check runs of the same recipe), when the run's share of stale groups is within 0.1 of theirs (else not
  judged: that KL carries one optimizer step's change of the policy for every stale sample) |
| update_latency | median push (`weight_push_s` of the steps after a push) within 1.5x of the baseline run's |
| trainer_peak_flat | `mem/trainer_peak_gib` of steps 2.. at most 1.1x its median (the peak does not grow) |

and the tests logs (one per part of the GPU tests, each part one device call: `tests-loop`, `tests-rest`): each has
pytest's summary line with no failed or errored test (a part cut at its time limit has none, and fails).

The on-policy KL rests on few samples: generation outpaces training, so every group after step 0 is one step
stale (a share of 0.967), and only step 0's samples are on-policy. The all-sample KL covers every step but rises
with the share of stale samples, hence references with the same share: the async baseline of 2026-12-01 (71% stale,
2.3e-4) cannot be one, while the seven healthy H200 check runs of 2026-12-02..05 (every later group stale) had
medians of 8.9e-4 to 1.36e-3 (median 1.10e-3: the "4x" KL reported on 2026-12-03 was that staleness, not a fault).
The ratio to the async baseline run's is reported as before. The table goes to stdout.
On an 80 GiB card (`--profile 80g`, picked by `scripts/gpu_check.sh`) the runs are of `train-80g.toml`
(glm-air-32e) and both baselines are `results/baseline-80g`, that profile's first full run; until it is committed
the checks against it are reported and not judged (`pass` null, listed under `unjudged`).
Everything goes to `--results` (default `bench/results/gpu_check.json`): date, commit, device, per run
its figures and checks, the tests' counts, and `passed` (all checks of all runs and the tests).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "cookbook" / "gpu-1xh200" / "results"
BASELINE_RUN = RESULTS / "async-30-steps"
SYNC_BASELINE_RUN = RESULTS / "sync-16-steps"


class Profile(NamedTuple):
    """The committed runs a profile's runs are judged against."""

    baseline: Path
    """The async baseline run: its push latency."""
    sync_baseline: Path
    """The run whose on-policy mismatch KL is the on-policy KL check's base."""
    kl_references: list[Path]
    """Earlier healthy check runs of the same recipe, every group after step 0 one step stale: the all-sample
    mismatch KL check's references."""


#: `h200`: glm-air-5b (train.toml); `80g`: glm-air-32e on an 80 GiB card (train-80g.toml), judged against its own
#: first full run.
PROFILES: dict[str, Profile] = {
    "h200": Profile(BASELINE_RUN, SYNC_BASELINE_RUN, [
        RESULTS / "async-30-steps-cuda-graphs", RESULTS / "check-30-steps-2026-12-03",
        RESULTS / "check-30-steps-0f4dd4a" / "run-1", RESULTS / "check-30-steps-1bede2a" / "run-1",
        *(RESULTS / "check-3x30-steps-f8668e2" / f"run-{n}" for n in (1, 2, 3))]),
    "80g": Profile(RESULTS / "baseline-80g", RESULTS / "baseline-80g", [RESULTS / "baseline-80g"]),
}
KL_FACTOR, LATENCY_FACTOR, PEAK_FACTOR, WINDOW, STALE_TOLERANCE = 2.0, 1.5, 1.1, 10, 0.1


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _updates(run: Path) -> list[dict]:
    path = run / "weight_updates.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _median(values: list[float]) -> float | None:
    values = [value for value in values if value is not None and value == value]
    return statistics.median(values) if values else None


def _max_steps(run: Path) -> int | None:
    config = run / "config.toml"
    if not config.is_file():
        return None
    import tomllib

    return int(tomllib.loads(config.read_text())["orchestrator"]["max_steps"])


def _stale_fraction(steps: list[dict]) -> float | None:
    """The share of trained groups generated at least one version behind the trainer."""
    counts = [(key, count) for step in steps for key, count in (step.get("staleness") or {}).items()]
    total = sum(count for _, count in counts)
    return sum(count for key, count in counts if key != "0") / total if total else None


def summarise(run: Path) -> dict:
    """A run folder's figures (None where the run has none)."""
    steps = _metrics(run)
    rewards = [step["reward"] for step in steps if step.get("reward") is not None]
    pushes = [step["weight_push_s"] for step in steps[1:] if step.get("weight_push_s")]
    peaks = [step["mem/trainer_peak_gib"] for step in steps if "mem/trainer_peak_gib" in step]
    updates = _updates(run)
    exit_file = run / "exit_code"
    return {
        "run": str(run.resolve().relative_to(ROOT)) if run.resolve().is_relative_to(ROOT) else str(run),
        "steps": len(steps),
        "max_steps": _max_steps(run),
        "exit_code": int(exit_file.read_text().strip()) if exit_file.is_file() else None,
        "reward_first": statistics.fmean(rewards[:WINDOW]) if len(rewards) >= 2 * WINDOW else None,
        "reward_last": statistics.fmean(rewards[-WINDOW:]) if len(rewards) >= 2 * WINDOW else None,
        "mismatch_kl_median": _median([step.get("mismatch_kl") for step in steps]),
        "mismatch_kl_mean": (statistics.fmean(values) if (values := [
            s["mismatch_kl"] for s in steps if s.get("mismatch_kl") is not None]) else None),
        # A run from before the metric existed (a baseline) with every group on-policy: its mismatch KL is that.
        "mismatch_kl_on_policy_median": _median([step.get("train/mismatch_kl_on_policy", step.get("mismatch_kl")
                                                  if step.get("staleness") == {"0": sum(step["staleness"].values())}
                                                  else None) for step in steps]),
        "stale_group_fraction": _stale_fraction(steps),
        "dropped_stale": sum(step.get("dropped_stale", 0) for step in steps),
        "on_policy_fraction_mean": (statistics.fmean(values) if (values := [
            step["train/on_policy_fraction"] for step in steps if "train/on_policy_fraction" in step]) else None),
        "weight_push_s_median": _median(pushes),
        "updates": len(updates),
        "updates_checked": sum(1 for update in updates if update.get("checks")),
        "check_error_max": max((check["max_error"] for update in updates for check in (update.get("checks") or {})
                                .values()), default=None),
        "verified_steps": sum(1 for step in steps if step.get("weights/verified") == 1.0),
        "trainer_peak_gib": peaks,
        "trainer_process_gib_max": max((s["mem/trainer_process_gib"] for s in steps if "mem/trainer_process_gib" in s),
                                       default=None),
        "inference_gib_max": max((s["mem/inference_gib"] for s in steps if "mem/inference_gib" in s), default=None),
        "step_time_s_median": _median([step.get("step_time_s") for step in steps[1:]]),
        "phase_s": float((run / "phase_seconds").read_text()) if (run / "phase_seconds").is_file() else None,
    }


def kl_reference(runs: list[dict]) -> dict | None:
    """The reference runs' median all-sample mismatch KL (the median of their medians) and mean stale share."""
    runs = [run for run in runs if run["mismatch_kl_median"] is not None and run["stale_group_fraction"] is not None]
    if not runs:
        return None
    return {"runs": [run["run"] for run in runs],
            "mismatch_kl_median": statistics.median(run["mismatch_kl_median"] for run in runs),
            "stale_group_fraction": statistics.fmean(run["stale_group_fraction"] for run in runs)}


def checks(figures: dict, baseline: dict | None, sync_baseline: dict | None, *,
           reference: dict | None = None) -> dict[str, dict]:
    """Each check: its value, what it is compared with, and whether it passed. Without baselines (a profile's
    first run) the checks against them are reported with `pass` None: not judged."""
    def check(value, limit, passed: bool) -> dict:
        return {"value": value, "limit": limit, "pass": bool(passed)}

    def unjudged(value, note: str = "no baseline for this profile yet") -> dict:
        return {"value": value, "limit": None, "pass": None, "note": note}

    out = {"completed": check(figures["steps"], figures["max_steps"], figures["exit_code"] == 0
                              and figures["max_steps"] is not None and figures["steps"] == figures["max_steps"])}
    first, last = figures["reward_first"], figures["reward_last"]
    out["reward_rising"] = check(last, first, first is not None and last is not None and last > first)
    kl = figures["mismatch_kl_on_policy_median"]
    if sync_baseline is None:
        out["mismatch_kl"] = unjudged(kl)
    else:
        base_kl = sync_baseline["mismatch_kl_on_policy_median"]
        out["mismatch_kl"] = check(kl, KL_FACTOR * base_kl, kl is not None and kl <= KL_FACTOR * base_kl)
    kl_all, stale = figures["mismatch_kl_median"], figures["stale_group_fraction"]
    if reference is None:
        out["mismatch_kl_all"] = unjudged(kl_all)
    elif stale is None or abs(stale - reference["stale_group_fraction"]) > STALE_TOLERANCE:
        out["mismatch_kl_all"] = unjudged(kl_all, f"stale share {stale} is not the references' "
                                                  f"{reference['stale_group_fraction']:.3f}")
    else:
        limit = KL_FACTOR * reference["mismatch_kl_median"]
        out["mismatch_kl_all"] = check(kl_all, limit, kl_all is not None and kl_all <= limit)
    out["weights_verified"] = check(figures["verified_steps"], figures["steps"],
                                    figures["steps"] > 0 and figures["verified_steps"] == figures["steps"]
                                    and figures["updates_checked"] == figures["updates"] > 0)
    push = figures["weight_push_s_median"]
    if baseline is None:
        out["update_latency"] = unjudged(push)
    else:
        base_push = baseline["weight_push_s_median"]
        out["update_latency"] = check(push, LATENCY_FACTOR * base_push,
                                      push is not None and push <= LATENCY_FACTOR * base_push)
    peaks = figures["trainer_peak_gib"][2:]
    ratio = max(peaks) / statistics.median(peaks) if peaks else None
    out["trainer_peak_flat"] = check(ratio, PEAK_FACTOR, ratio is not None and ratio <= PEAK_FACTOR)
    return out


_SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected|error|errors|warnings?)\b.*?) in [\d.]+s",
                      re.MULTILINE)  # `-q` prints the counts bare, otherwise between rows of "="


def tests_summary(log: Path) -> dict:
    """pytest's counts from its last summary line; `pass` when it ran and nothing failed or errored."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = _SUMMARY.findall(text)
    counts = {kind: int(number) for number, kind in re.findall(r"(\d+) (\w+)", found[-1])} if found else {}
    return {"log": str(log), "counts": counts,
            "pass": bool(found) and counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error")
            and not counts.get("errors")}


def tests_verdict(logs: list[Path]) -> dict:
    """The tests' logs together: each log's summary, the counts summed, and `pass` when every log passed."""
    parts = [tests_summary(log) for log in logs]
    counts: dict[str, int] = {}
    for part in parts:
        for kind, number in part["counts"].items():
            counts[kind] = counts.get(kind, 0) + number
    return {"logs": parts, "counts": counts, "pass": bool(parts) and all(part["pass"] for part in parts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--tests-log", type=Path, action="append", default=[],
                        help="a log of (a part of) the GPU tests; repeat for each part")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--device", default="")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="h200",
                        help="the recipe the runs are of: h200 (glm-air-5b) or 80g (glm-air-32e, an 80 GiB card)")
    parser.add_argument("--baseline", type=Path, help="the async baseline run (default: the profile's)")
    parser.add_argument("--sync-baseline", type=Path, help="the on-policy KL baseline run (default: the profile's)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "gpu_check.json")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    baseline = _committed(args.baseline or profile.baseline)
    sync_baseline = _committed(args.sync_baseline or profile.sync_baseline)
    reference = kl_reference([summary for run in profile.kl_references if (summary := _committed(run))])
    runs = []
    for run in args.runs:
        figures = summarise(run)
        if figures["mismatch_kl_median"] is not None and baseline is not None:
            figures["mismatch_kl_vs_async_baseline"] = figures["mismatch_kl_median"] / baseline["mismatch_kl_median"]
        runs.append({"figures": figures, "checks": checks(figures, baseline, sync_baseline, reference=reference)})
    tests = tests_verdict(args.tests_log) if args.tests_log else None
    passed = all(c["pass"] is not False for run in runs for c in run["checks"].values()) and (
        tests is None or tests["pass"])
    unjudged = sorted({name for run in runs for name, c in run["checks"].items() if c["pass"] is None})
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": args.commit, "device": args.device,
              "profile": args.profile,
              "baseline": baseline and {key: baseline[key] for key in (
                  "run", "mismatch_kl_median", "weight_push_s_median", "stale_group_fraction", "dropped_stale")},
              "sync_baseline": sync_baseline and {key: sync_baseline[key]
                                                  for key in ("run", "mismatch_kl_on_policy_median")},
              "kl_reference": reference,
              "runs": runs, "tests": tests, "unjudged": unjudged, "passed": passed}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    names = list(runs[0]["checks"]) if runs else []
    print("| run | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for run in runs:
        cells = [f"{({True: 'ok', False: 'FAIL', None: 'n/a'})[c['pass']]} ({_short(c['value'])})"
                 for c in run["checks"].values()]
        print(f"| {Path(run['figures']['run']).name} | " + " | ".join(cells) + " |")
    if tests is not None:
        print(f"tests: {'ok' if tests['pass'] else 'FAIL'} {tests['counts']}")
    for name in unjudged:
        notes = sorted({run["checks"][name]["note"] for run in runs if run["checks"][name]["pass"] is None})
        print(f"not judged: {name} ({'; '.join(notes)})")
    print(f"gpu check: {'passed' if passed else 'FAILED'} -> {args.results}")
    return 0 if passed else 1


def _committed(run: Path) -> dict | None:
    """`summarise(run)`, or None where the run is not there (a profile's baseline before its first run)."""
    return summarise(run) if (run / "metrics.jsonl").is_file() else None


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
