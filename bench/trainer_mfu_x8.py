"""8-GPU trainer scaling run: GLM-4.5-Air-shaped MoE layers, EP=8 + FSDP, 32k and 131k tokens.

    python3 bench/trainer_mfu_x8.py --dry-run     # any machine: the configurations, layouts, memory and time estimates
    python3 bench/trainer_mfu_x8.py               # 8 GPUs (one nvidia-h200-x8 device call: docs/gpu.md)

One call measures, each in its own launch and against the bf16 matmul rate measured in
that launch (``bench/trainer_mfu.py``'s ``matmul_rate`` and ``_measure``, imported here):

1. baselines: 1 GPU and 2 GPUs (EP=2) with the 2-layer model of ``trainer_mfu.json`` at
   32k tokens per GPU;
2. 8 GPUs (EP=8, FSDP over all 8, experts not FSDP-sharded): the same 2-layer model at 32k
   tokens per GPU (weak scaling: same model, same tokens per GPU), then the deepest model
   that fits (``--layers auto``: the most MoE layers whose planner estimate fits
   ``--memory-fraction`` of ``--gpu-memory-gib`` in *every* 8-GPU configuration) at 32k
   tokens per GPU, at 131k tokens per row with context parallel 4, and with CP 2.

Scaling efficiency (in the JSON's ``scaling_efficiency``):

* ``weak_vs_1gpu`` / ``weak_vs_2gpu``: tokens/s per GPU of the 2-layer model on 8 GPUs over
  that on 1 (2) GPUs, same tokens per GPU: 1.0 is perfect scaling.
* ``deep_mfu_vs_1gpu`` / ``deep_mfu_vs_2gpu``: MFU of the deep model on 8 GPUs (32k) over the
  2-layer model's MFU on 1 (2) GPUs; MFU is per GPU against each launch's own matmul rate.

Writes ``bench/results/trainer_mfu_x8.json`` after every launch (a launch cut short by the
time limit keeps the rows before it). The run stops starting configurations whose
estimated time would pass ``--time-limit-s`` (skipped rows say so) and kills a launch
still running ``KILL_GRACE_S`` after it, so that one device call (10 minutes) always ends
with results.

``--cpu-smoke`` runs the same launches, workers and summary on CPU ranks (gloo, 1, 2 and
``--world`` processes) with a tiny MoE model and 64/256-token rows, into a temporary file
(``--results``): it checks the orchestration before a GPU call, not performance.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_mfu import LOGPROB_CHUNK_TOKENS, _measure, air_args, gpu_launch, matmul_rate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "trainer_mfu_x8.json"
MEASURED_1_2_GPU = ROOT / "bench" / "results" / "trainer_mfu.json"
GIB = 1024**3
BASELINE_LAYERS = 2
SHORT_TOKENS, LONG_TOKENS = 32768, 131072
SMOKE_TOKENS, SMOKE_LAYERS = (64, 256), 3  # --cpu-smoke: row tokens (short, long) and deep-model layers
LAUNCH_OVERHEAD_S = 40.0  # process start, imports, NCCL init and the matmul-rate measurement
KILL_GRACE_S = 20.0  # a launch still running this long after --time-limit-s is killed
BUILD_S_PER_LAYER = 1.5  # meta build, materialise, random init and first optimizer allocation


class BenchInputError(ValueError):
    """Bad option value (one line, printed without a traceback)."""


@dataclass
class RunConfig:
    """One measured configuration."""

    gpus: int
    """Ranks of the launch (one per GPU)."""
    layers: int
    """MoE layers of the model."""
    seq: int
    """Tokens per packed row (one document); each data-parallel rank trains one row per step."""
    cp: int
    """Context-parallel degree (ranks sharing a row)."""
    ep: int
    """Expert-parallel degree (the trainer's ep=auto picks it: the GPU count here)."""
    warmup: int
    """Untimed steps."""
    steps: int
    """Timed steps (the median is reported)."""
    estimate_gib: float = 0.0
    """The trainer planner's per-GPU memory estimate."""
    estimate_parts_gib: dict | None = None
    """That estimate by part (states, unsharded params, activations)."""
    estimated_step_s: float = 0.0
    """Step time from the TFLOP/s per GPU measured on 1-2 GPUs."""
    estimated_total_s: float = 0.0
    """Warm-up + timed steps + model build."""
    role: str = ""
    """baseline, weak scaling, deep or deep long."""
    model: str = "air"
    """'air' (GLM-4.5-Air-shaped layers) or 'tiny' (the --cpu-smoke model)."""

    @property
    def key(self) -> str:
        return f"{self.gpus}gpu_{self.seq}" + (f"_cp{self.cp}" if self.cp > 1 else "") + f"_L{self.layers}"


def model_args(model: str, layers: int):
    """GLM-4.5-Air-shaped layers (``trainer_mfu.air_args``) or the tiny --cpu-smoke model."""
    if model == "air":
        return air_args(layers)
    from agentrl.trainer.models.args import MoEModelArgs

    return MoEModelArgs(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        rotary_dim=16, attention_bias=True, num_experts=8, top_k=2, num_shared_experts=1)


def measured_rates(path: Path = MEASURED_1_2_GPU) -> dict[str, float]:
    """Delivered TFLOP/s per GPU from the 1-/2-GPU run (without / with CP), for time estimates."""
    rates = {"no_cp": 280.0, "cp": 225.0}
    try:
        runs = [r for r in json.loads(path.read_text())["runs"] if "tflops_per_gpu" in r]
    except (OSError, ValueError, KeyError, TypeError):
        return rates
    no_cp = [r["tflops_per_gpu"] for r in runs if r.get("cp", 1) == 1 and r["seq"] >= SHORT_TOKENS]
    with_cp = [r["tflops_per_gpu"] for r in runs if r.get("cp", 1) > 1]
    if no_cp:
        rates["no_cp"] = min(no_cp)
    if with_cp:
        rates["cp"] = min(with_cp)
    return rates


def estimate(config: RunConfig, *, gpu_memory_gib: float, rates: dict[str, float]) -> RunConfig:
    """Fill the planner's memory estimate and a time estimate (from measured TFLOP/s per GPU)."""
    from agentrl.trainer.parallel import plan_layout

    args = model_args(config.model, config.layers)
    plan = plan_layout(args, world=config.gpus, row_tokens=config.seq, ep=config.ep, cp=config.cp,
                       gpu_memory_bytes=gpu_memory_gib * GIB, logprob_chunk_tokens=LOGPROB_CHUNK_TOKENS)
    config.estimate_gib = plan.estimated_bytes / GIB
    config.estimate_parts_gib = {k: round(v / GIB, 2) for k, v in plan.memory.items()}
    tokens = config.seq * (config.gpus // config.cp)
    flops = args.training_flops_per_token(mean_context=config.seq / 2) * tokens
    rate = rates["cp" if config.cp > 1 else "no_cp"] * 1e12
    config.estimated_step_s = flops / config.gpus / rate
    config.estimated_total_s = (config.warmup + config.steps) * config.estimated_step_s \
        + BUILD_S_PER_LAYER * config.layers
    return config


def max_layers(*, world: int, shapes: list[tuple[int, int]], budget_gib: float, limit: int = 92) -> int:
    """The most MoE layers whose planner estimate fits ``budget_gib`` for every (seq, cp) shape."""
    from agentrl.trainer.parallel import plan_layout

    best = 0
    for layers in range(1, limit + 1):
        args = air_args(layers)
        sizes = [plan_layout(args, world=world, row_tokens=seq, ep="auto", cp=cp, gpu_memory_bytes=1e18,
                             logprob_chunk_tokens=LOGPROB_CHUNK_TOKENS).estimated_bytes / GIB
                 for seq, cp in shapes]
        if max(sizes) > budget_gib:
            break
        best = layers
    return best


def plan_runs(*, world: int = 8, layers: int | str = "auto", gpu_memory_gib: float = 139.0,
              memory_fraction: float = 0.93, long_cps: tuple[int, ...] = (4, 2), steps: int = 2,
              warmup: int = 1, cpu_smoke: bool = False) -> dict[int, list[RunConfig]]:
    """The configurations of one scaling run, grouped by launch (GPU count), with estimates.

    ``cpu_smoke``: the tiny model, ``SMOKE_TOKENS`` rows and ``SMOKE_LAYERS`` deep layers."""
    from agentrl.errors import AgentrlError

    model = "tiny" if cpu_smoke else "air"
    experts = model_args(model, 1).num_experts
    if world < 4 or experts % world:
        raise BenchInputError(f"--world {world}: need a GPU count of at least 4 that divides {experts} "
                              "(the expert count)")
    for cp in long_cps:
        if cp < 2 or world % cp:
            raise BenchInputError(f"--long-cp {cp}: must be at least 2 and divide --world ({world})")
    if not 0.1 <= memory_fraction <= 1.0:
        raise BenchInputError(f"--memory-fraction {memory_fraction}: must be between 0.1 and 1.0")
    if steps < 1 or warmup < 0:
        raise BenchInputError(
            f"--steps {steps} / --warmup {warmup}: need at least 1 timed step and no negative warm-up"
        )
    budget = gpu_memory_gib * memory_fraction
    short, long = SMOKE_TOKENS if cpu_smoke else (SHORT_TOKENS, LONG_TOKENS)
    shapes = [(short, 1)] + [(long, cp) for cp in long_cps]
    if layers == "auto" and cpu_smoke:
        layers = SMOKE_LAYERS
    if layers == "auto":
        layers = max_layers(world=world, shapes=shapes, budget_gib=budget)
        if layers < 1:
            raise BenchInputError(f"--layers auto: not even one layer fits {budget:.0f} GiB/GPU "
                                  f"({memory_fraction} x --gpu-memory-gib {gpu_memory_gib})")
    layers = int(layers)
    if layers < 1:
        raise BenchInputError(f"--layers {layers}: need at least one MoE layer (or 'auto')")
    rates = measured_rates()
    base = {"warmup": warmup + 1, "steps": steps + 1, "model": model}
    deep = {"warmup": warmup, "steps": steps, "model": model}
    runs = {
        1: [RunConfig(1, BASELINE_LAYERS, short, 1, 1, role="baseline", **base)],
        2: [RunConfig(2, BASELINE_LAYERS, short, 1, 2, role="baseline", **base)],
        world: [RunConfig(world, BASELINE_LAYERS, short, 1, world, role="weak scaling", **base),
                RunConfig(world, layers, short, 1, world, role="deep", **deep)]
        + [RunConfig(world, layers, long, cp, world, role="deep long", **deep) for cp in long_cps],
    }
    for group in runs.values():
        for config in group:
            try:
                estimate(config, gpu_memory_gib=gpu_memory_gib, rates=rates)
            except AgentrlError as exc:
                raise BenchInputError(str(exc)) from None
            if config.estimate_gib > gpu_memory_gib:
                raise BenchInputError(
                    f"{config.key} ({config.role}, --layers {layers}) needs ~{config.estimate_gib:.1f} "
                    f"GiB/GPU, more than --gpu-memory-gib {gpu_memory_gib}; use fewer layers "
                    "(or 'auto') or GPUs with more memory"
                )
    return runs


def estimated_wall_s(runs: dict[int, list[RunConfig]]) -> float:
    return sum(LAUNCH_OVERHEAD_S + sum(c.estimated_total_s for c in group) for group in runs.values())


def print_plan(runs: dict[int, list[RunConfig]], *, gpu_memory_gib: float, time_limit_s: float) -> None:
    from rich.table import Table

    shape = "tiny model, CPU ranks" if next(iter(runs.values()))[0].model == "tiny" else "GLM-4.5-Air-shaped layers"
    table = Table(title=f"trainer scaling run plan ({shape}, {gpu_memory_gib:g} GiB/GPU)")
    for column in ("GPUs", "role", "layers", "row tokens", "EP", "CP", "DP", "warm+timed", "est. GiB/GPU",
                   "states/params/act.", "est. step s", "est. s"):
        table.add_column(column, justify="right")
    for group in runs.values():
        for c in group:
            parts = "/".join(f"{v:.1f}" for v in (c.estimate_parts_gib or {}).values())
            table.add_row(str(c.gpus), c.role, str(c.layers), str(c.seq), str(c.ep), str(c.cp), str(c.gpus // c.cp),
                          f"{c.warmup}+{c.steps}", f"{c.estimate_gib:.1f}", parts, f"{c.estimated_step_s:.1f}",
                          f"{c.estimated_total_s:.0f}")
    _console().print(table)
    total = estimated_wall_s(runs)
    print(f"estimated wall time {total:.0f} s (+{LAUNCH_OVERHEAD_S:.0f} s per launch included); "
          f"time limit {time_limit_s:.0f} s")


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=170)  # logs and captured output: full columns


# ------------------------------------------------------------------------------- GPU side
def worker(configs: list[dict], out: Path, deadline: float) -> None:
    """Runs in every rank of one launch: each configuration in turn, results written after each."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=240))
    rank = dist.get_rank() if world > 1 else 0
    peak_rate = matmul_rate() if cuda else matmul_rate(size=256)
    rows: list[dict] = []
    for raw in configs:
        config = RunConfig(**raw)
        start_ok = [time.time() + config.estimated_total_s <= deadline]
        if world > 1:
            dist.broadcast_object_list(start_ok, src=0)  # every rank takes rank 0's decision
        if not start_ok[0]:
            rows.append({**_identity(config), "error": "skipped: its estimated time would pass --time-limit-s"})
        else:
            try:
                row = _measure(config.seq, config.cp, model_args(config.model, config.layers), world, rank,
                               config.steps, peak_rate, warmup=config.warmup)
                rows.append({**_identity(config), **row, "estimated_step_s": config.estimated_step_s})
            except torch.OutOfMemoryError as exc:
                rows.append({**_identity(config), "error": f"out of memory: {str(exc).splitlines()[0]}"})
            import gc

            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if rank == 0:
            out.write_text(json.dumps(rows, indent=2))
    if world > 1:
        dist.destroy_process_group()


def _identity(config: RunConfig) -> dict:
    return {"key": config.key, "role": config.role, "gpus": config.gpus, "layers": config.layers,
            "seq": config.seq, "cp": config.cp, "ep": config.ep}


def _launch(gpus: int, configs: list[RunConfig], *, deadline: float, results: Path) -> list[dict]:
    """One launch (1 process, or torchrun over ``gpus`` GPUs); the rows it wrote, even when cut short."""
    out = results.parent / f".{results.stem}_{gpus}gpu.json"
    out.unlink(missing_ok=True)
    worker_args = [str(Path(__file__).resolve()), "--worker-out", str(out), "--deadline", str(deadline),
                   "--worker-configs", json.dumps([asdict(c) for c in configs])]
    command, env = gpu_launch(gpus, worker_args)
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=max(1.0, deadline + KILL_GRACE_S - time.time()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = "killed at the time limit"
    rows = json.loads(out.read_text()) if out.exists() else []
    out.unlink(missing_ok=True)
    done = {r["key"] for r in rows}
    if code != 0:
        print(f"{gpus}-GPU launch ended with {code}")
        rows += [{**_identity(c), "error": f"launch ended with {code} before this row"}
                 for c in configs if c.key not in done]
    return rows


def summarize(rows: list[dict], *, layers: int, world: int, command: str) -> dict:
    """The results JSON: per-row figures, scaling efficiencies, the chosen layer count."""
    ok = [r for r in rows if "error" not in r]

    def row(gpus: int, role: str) -> dict | None:
        return next((r for r in ok if (r["gpus"], r["role"]) == (gpus, role)), None)

    def ratio(a: dict | None, b: dict | None, field: str, per_gpu: bool) -> float | None:
        if a is None or b is None:
            return None
        scale_a, scale_b = (a["gpus"], b["gpus"]) if per_gpu else (1, 1)
        return (a[field] / scale_a) / (b[field] / scale_b)

    one, two = row(1, "baseline"), row(2, "baseline")
    weak, deep = row(world, "weak scaling"), row(world, "deep")
    return {
        "layers": layers,
        "world": world,
        "tokens_per_s": {r["key"]: r["tokens_per_s"] for r in ok},
        "mfu": {r["key"]: r["mfu"] for r in ok},
        "peak_memory_gib": {r["key"]: r["peak_memory_gib"] for r in ok},
        "estimate_memory_gib": {r["key"]: r["estimate_gib"] for r in ok},
        "matmul_tflops": {f"{r['gpus']}gpu": r["matmul_tflops"] for r in ok},
        "scaling_efficiency": {
            "weak_vs_1gpu": ratio(weak, one, "tokens_per_s", per_gpu=True),
            "weak_vs_2gpu": ratio(weak, two, "tokens_per_s", per_gpu=True),
            "deep_mfu_vs_1gpu": ratio(deep, one, "mfu", per_gpu=False),
            "deep_mfu_vs_2gpu": ratio(deep, two, "mfu", per_gpu=False),
        },
        "runs": rows,
        "command": command,
    }


def print_results(summary: dict) -> None:
    from rich.table import Table

    table = Table(title=f"trainer scaling on {summary.get('device', '?')} (deep model: {summary['layers']} MoE layers)")
    for column in ("GPUs", "layers", "row tokens", "step s", "tokens/s", "TFLOP/s/GPU", "matmul TFLOP/s", "MFU",
                   "MFU (989T)", "peak GiB", "est. GiB", "est/peak"):
        table.add_column(column, justify="right")
    for r in summary["runs"]:
        label = f"{r['gpus']} ep{r['ep']}" + (f" cp{r['cp']}" if r["cp"] > 1 else "")
        if "error" in r:
            table.add_row(label, str(r["layers"]), str(r["seq"]), r["error"][:60], *[""] * 8)
            continue
        table.add_row(label, str(r["layers"]), str(r["seq"]), f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['tflops_per_gpu']:.0f}", f"{r['matmul_tflops']:.0f}", f"{r['mfu']:.1%}",
                      f"{r['mfu_datasheet']:.1%}", *_memory_cells(r))
    _console().print(table)
    for name, value in summary["scaling_efficiency"].items():
        print(f"scaling efficiency {name}: " + ("n/a" if value is None else f"{value:.2f}"))


def _memory_cells(row: dict) -> tuple[str, str, str]:
    peak = row["peak_memory_gib"]  # None on CPU ranks
    return ("n/a" if peak is None else f"{peak:.1f}", f"{row['estimate_gib']:.1f}",
            "n/a" if peak is None else f"{row['estimate_gib'] / peak:.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="print the configurations, layouts, memory and time estimates; needs no GPU")
    parser.add_argument("--world", type=int, default=8, help="GPUs of the scaled run (default 8)")
    parser.add_argument("--layers", default="auto",
                        help="MoE layers of the deep model, or 'auto' (most that fit every 8-GPU configuration)")
    parser.add_argument("--gpu-memory-gib", type=float, default=139.0, help="memory per GPU the planner plans for")
    parser.add_argument("--memory-fraction", type=float, default=0.93,
                        help="share of --gpu-memory-gib the estimate may use when --layers is auto (headroom)")
    parser.add_argument("--long-cp", type=int, action="append",
                        help="context-parallel degree for the 131k-token rows (repeatable; default 4 and 2)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per deep configuration (+1 for baselines)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per deep configuration (+1 for baselines)")
    parser.add_argument("--time-limit-s", type=float, default=530.0,
                        help="configurations whose estimated time would pass this (from start) are skipped")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the launches on CPU ranks (gloo) with a tiny model: checks the orchestration")
    parser.add_argument("--results", type=Path,
                        help="results JSON (default bench/results/trainer_mfu_x8.json; a temporary file with "
                             "--cpu-smoke)")
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-configs", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.layers != "auto":
        try:
            options.layers = int(options.layers)
        except ValueError:
            parser.error(f"--layers {options.layers!r}: give a number of MoE layers or 'auto'")
    options.long_cp = tuple(options.long_cp or (4, 2))
    return options


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    options = parse_args(argv)
    if options.worker_out:
        worker(json.loads(options.worker_configs), options.worker_out, options.deadline)
        return 0
    try:
        runs = plan_runs(world=options.world, layers=options.layers, gpu_memory_gib=options.gpu_memory_gib,
                         memory_fraction=options.memory_fraction, long_cps=options.long_cp, steps=options.steps,
                         warmup=options.warmup, cpu_smoke=options.cpu_smoke)
    except BenchInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_plan(runs, gpu_memory_gib=options.gpu_memory_gib, time_limit_s=options.time_limit_s)
    if options.dry_run:
        return 0
    import torch

    results = options.results or (Path(tempfile.gettempdir()) / "trainer_mfu_x8_cpu_smoke.json"
                                  if options.cpu_smoke else RESULTS)
    available = torch.cuda.device_count()
    if available < options.world and not options.cpu_smoke:
        print(f"error: found {available} CUDA GPUs; this run needs {options.world} (--world), or use --dry-run; "
              "see docs/gpu.md", file=sys.stderr)
        return 2
    deadline = started + options.time_limit_s
    rows: list[dict] = []
    deep_layers = runs[options.world][-1].layers
    command = "python3 bench/trainer_mfu_x8.py " + " ".join(argv if argv is not None else sys.argv[1:])
    device = "cpu (--cpu-smoke)" if options.cpu_smoke else torch.cuda.get_device_name(0)
    results.parent.mkdir(parents=True, exist_ok=True)
    for gpus, group in runs.items():
        rows += _launch(gpus, group, deadline=deadline, results=results)
        summary = summarize(rows, layers=deep_layers, world=options.world, command=command.strip())
        summary.update(device=device, torch=torch.__version__, wall_s=time.time() - started)
        results.write_text(json.dumps(summary, indent=2))
    print_results(summary)
    print(f"wrote {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
