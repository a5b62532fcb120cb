"""LoRA against full fine-tuning on the same recipe, in one run of this script: memory, step time, update latency,
update size and the reward curve.

    python3 bench/lora.py                                          # CPU: cookbook/cpu-default, 16 steps each
    python3 bench/lora.py --config cookbook/gpu-1xh200/train.toml --steps 30 --results bench/results/lora.json
    python3 bench/lora.py --summarize RUN_FULL RUN_LORA   # run folders made earlier (e.g. a device call each)

Two `agentrl train` runs of `--config`, one after the other, the same seed and steps: full fine-tuning as the
recipe says, then `trainer.lora = {rank, alpha, targets}` with `inference.lora_adapters = true` (the adapter alone
goes into the running servers after every step, `inference.lora_serving`). From each run folder's `metrics.jsonl`
and `weight_updates.jsonl`:

- the trainer's peak memory (GPU runs report `mem/trainer_peak_gib`), the median step time and the median weight
  push (`weight_push_s`: staging and loading into every server), and the bytes of one update (the staged folder);
- the reward: the mean of the first and last `--window` steps with a 95% bootstrap interval of the difference
  (`agentrl.stats.window_delta`), and the mismatch KL median;
- ratios, full over LoRA: push (target on the H200: at least 10x), step time, memory.

Prints a table and writes `--results` (default bench/results/lora_cpu.json; the H200 comparison is lora.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "cookbook" / "cpu-default" / "train.toml"
RESULTS = ROOT / "bench" / "results" / "lora_cpu.json"


def train(name: str, *, config: Path, steps: int, overrides: list[str], out: Path, timeout_s: float) -> Path:
    """One `agentrl train` run into `out/name`; its folder."""
    run_dir = out / name
    command = [sys.executable, "-m", "agentrl.cli", "train", "--config", str(config), "-o", str(run_dir),
               "--set", f"orchestrator.max_steps={steps}", "--set", "eval.every=0"]
    for override in overrides:
        command += ["--set", override]
    started = time.monotonic()
    print(f"[{name}] {' '.join(command[3:])}", flush=True)
    done = subprocess.run(command, cwd=ROOT, timeout=timeout_s, check=False)
    if done.returncode != 0:
        sys.exit(f"bench/lora: the {name} run exited {done.returncode} after {time.monotonic() - started:.0f} s; "
                 f"see {run_dir}/logs")
    return run_dir


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _recorded_bytes(path: Path) -> int | None:
    """The size of the last adapter as scripts/gpu_run.sh's lora phase records it (`du -sb`), when it kept no files."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def summarize(run_dir: Path, *, window: int) -> dict:
    """The figures of one run folder."""
    from agentrl.stats import window_delta

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        sys.exit(f"bench/lora: {run_dir} has no metrics.jsonl; give a run folder of `agentrl train`")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [row for row in rows if "reward" in row]
    updates_file = run_dir / "weight_updates.jsonl"
    updates = [json.loads(line) for line in updates_file.read_text().splitlines()] if updates_file.is_file() else []
    staged = sorted((run_dir / "weights").glob("v*")) if (run_dir / "weights").is_dir() else []
    rewards = [row["reward"] for row in rows]
    delta = window_delta(rewards, window)
    peaks = [row["mem/trainer_peak_gib"] for row in rows if row.get("mem/trainer_peak_gib") is not None]
    return {
        "run": str(run_dir),
        "steps": len(rows),
        "trainer_peak_gib": max(peaks) if peaks else None,
        "step_time_s_median": _median([row["step_time_s"] for row in rows if row.get("step_time_s") is not None]),
        "train_s_median": _median([row["train_s"] for row in rows if row.get("train_s") is not None]),
        "weight_push_s_median": _median([row["weight_push_s"] for row in rows if row.get("weight_push_s")]),
        "weight_load_s_median": _median([update["load_s"] for update in updates if update.get("load_s") is not None]),
        "update_bytes": _folder_bytes(staged[-1]) if staged else _recorded_bytes(run_dir / "adapter_bytes"),
        "mismatch_kl_median": _median([row["mismatch_kl"] for row in rows if row.get("mismatch_kl") is not None]),
        "reward_first": delta.before if delta else (rewards[0] if rewards else None),
        "reward_last": delta.after if delta else (rewards[-1] if rewards else None),
        "reward_delta": None if delta is None else {"delta": delta.delta, "low": delta.low, "high": delta.high,
                                                     "window": delta.n},
        "rewards": rewards,
    }


def _ratio(full: float | None, lora: float | None) -> float | None:
    return None if not full or not lora else round(full / lora, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default="attention,shared_experts",
                        help="trainer.lora.targets (routed experts are served by CUDA vLLM only)")
    parser.add_argument("--lora-lr", type=float, default=None, help="trainer.optimizer.lr of the LoRA run")
    parser.add_argument("--window", type=int, default=5, help="steps per reward window")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-lora"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--summarize", type=Path, nargs=2, metavar=("FULL", "LORA"), help="existing run folders")
    args = parser.parse_args(argv)
    if args.summarize:
        full_dir, lora_dir = args.summarize
    else:
        if not args.config.is_file():
            sys.exit(f"bench/lora: no config at {args.config}")
        targets = [target.strip() for target in args.targets.split(",") if target.strip()]
        lora = [f"trainer.lora={{rank={args.rank}, alpha={args.alpha}, targets={json.dumps(targets)}}}",
                "inference.lora_adapters=true"]
        if args.lora_lr is not None:
            lora.append(f"trainer.optimizer.lr={args.lora_lr}")
        full_dir = train("full", config=args.config, steps=args.steps, overrides=[], out=args.out,
                         timeout_s=args.timeout)
        lora_dir = train("lora", config=args.config, steps=args.steps, overrides=lora, out=args.out,
                         timeout_s=args.timeout)
    full, lora_run = summarize(full_dir, window=args.window), summarize(lora_dir, window=args.window)
    ratios = {"push_full_over_lora": _ratio(full["weight_push_s_median"], lora_run["weight_push_s_median"]),
              "update_bytes_full_over_lora": _ratio(full["update_bytes"], lora_run["update_bytes"]),
              "step_time_full_over_lora": _ratio(full["step_time_s_median"], lora_run["step_time_s_median"]),
              "trainer_peak_full_over_lora": _ratio(full["trainer_peak_gib"], lora_run["trainer_peak_gib"])}
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
              "config": str(args.config), "settings": {k: v for k, v in vars(args).items()
                                                         if k in ("steps", "rank", "alpha", "targets", "lora_lr",
                                                                  "window")},
              "full": full, "lora": lora_run, "ratios": ratios}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=2, default=str) + "\n")
    _print(full, lora_run, ratios)
    print(f"written: {args.results}")
    return 0


def _print(full: dict, lora: dict, ratios: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def shown(value, fmt="{:.3g}") -> str:
        return "-" if value is None else fmt.format(value)

    table = Table(title="LoRA against full fine-tuning (medians over steps)")
    for column in ("", "full", "LoRA", "full / LoRA"):
        table.add_column(column)
    lines = [("weight push (s)", "weight_push_s_median", "push_full_over_lora"),
             ("update size (bytes)", "update_bytes", "update_bytes_full_over_lora"),
             ("step time (s)", "step_time_s_median", "step_time_full_over_lora"),
             ("trainer peak (GiB)", "trainer_peak_gib", "trainer_peak_full_over_lora"),
             ("mismatch KL", "mismatch_kl_median", None)]
    for label, key, ratio in lines:
        table.add_row(label, shown(full[key]), shown(lora[key]), shown(ratios.get(ratio)) if ratio else "")
    for name, run in (("full", full), ("LoRA", lora)):
        change = run["reward_delta"]
        said = "-" if change is None else (f"{run['reward_first']:.3f} -> {run['reward_last']:.3f} "
                                           f"({change['delta']:+.3f} [{change['low']:+.3f}, {change['high']:+.3f}])")
        table.add_row(f"reward, {name}", said, "", "")
    Console().print(table)


if __name__ == "__main__":
    raise SystemExit(main())
