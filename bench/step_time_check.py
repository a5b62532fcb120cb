"""The planner's trainer step time against the measured one (GLM-4.5-Air-shaped layers on the H200).

    python3 bench/step_time_check.py            # GPU: rates + trainer steps on 1 GPU (and 2 if present)
    python3 bench/step_time_check.py --cpu      # CPU variant (also without CUDA): tiny model, CPU rates
    python3 bench/step_time_check.py --fit      # refit the [plan] defaults on bench/results/trainer_mfu.json

One run measures the rates the step-time model reads (`agentrl.rl.step_time.PlanSection`)
on its own device: the dense GEMM rate (bench/trainer_mfu.py's `matmul_rate`), the routed
experts' rate (the trainer's own `Experts` module, forward + backward, at the layer's routed
rows), the attention rate (the trainer's `segment_attention`: per-segment SDPA with GQA, and
the varlen kernel with K/V repeated to every head that the CP path runs). It then times
trainer steps with bench/trainer_mfu.py's own code (`_measure`; on GPUs its worker, through
`gpu_launch`, at 2 and 1 MoE layers so a per-layer cost shows) and predicts each with
`predict_trainer` twice: from the rates measured in this run (plus the default per-micro-batch
overhead) and from the committed defaults. ``--fit`` also solves the effective rates from the
measured rows (grouped, attention and overhead from the 1-GPU rows, CP attention from the CP
row: how the defaults were made). Prints a table, writes ``bench/results/step_time_check.json``
(``step_time_check_cpu.json`` for the CPU variant).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
# the trainer benchmark's code
from trainer_mfu import _measure, _timed, air_args, gpu_launch, matmul_rate  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def tiny_args(layers: int):
    """A small GLM-4.5-shaped MoE for the CPU variant (GQA 4/2 heads, 8 experts top-2)."""
    from agentrl.trainer.models.args import MoEModelArgs

    return MoEModelArgs(
        model_type="glm4_moe",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rotary_dim=16,
        num_experts=8,
        top_k=2,
        num_shared_experts=1,
        dense_layers=[],
    )


def measure_rates(args, *, seq: int, cuda: bool, gemm_size: int) -> dict[str, float]:
    """TFLOP/s of this device for the model's terms, counted as `predict_trainer` counts them."""
    import torch
    from torchtitan.models.common.moe import GroupedExperts

    from agentrl.trainer.models.attention import build_segments, segment_attention
    from agentrl.trainer.models.moe_block import Experts

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    D, K, E, F = args.hidden_size, args.top_k, args.num_experts, args.moe_intermediate_size
    experts = Experts(GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E)).to(device)
    for weight in experts.parameters():
        torch.nn.init.normal_(weight, std=0.02)
    rows = seq * K
    counts = torch.full((E,), rows // E, dtype=torch.int64, device=device)
    x = torch.randn(rows // E * E, D, device=device, requires_grad=True)

    def experts_step():
        experts(x, counts).sum().backward()

    grouped_flops = 3 * 2 * (rows // E * E) * 3 * D * F  # forward + backward (2x) of three GEMMs
    H, KV, hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    q = torch.randn(seq, H, hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(seq, KV, hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(seq, KV, hd, device=device, dtype=dtype, requires_grad=True)
    segments = build_segments(torch.arange(seq))
    segments.cu_seq_q, segments.cu_seq_k = segments.cu_seq_q.to(device), segments.cu_seq_k.to(device)
    k_all, v_all = (t.detach().repeat_interleave(H // KV, dim=1).requires_grad_() for t in (k, v))

    def attention_step(keys, values):
        segment_attention(q, keys, values, segments, scale=hd**-0.5).float().sum().backward()

    attention_flops = 3 * seq * 2 * H * 2 * hd * seq / 2  # forward + backward (2x), causal
    repeats = 5 if cuda else 2
    rates = {
        "dense_gemm_tflops": matmul_rate(size=gemm_size) / 1e12,
        "grouped_gemm_tflops": grouped_flops / _timed(experts_step, repeats=repeats, cuda=cuda) / 1e12,
        "attention_tflops": attention_flops
        / _timed(lambda: attention_step(k, v), repeats=repeats, cuda=cuda)
        / 1e12,
        "cp_attention_tflops": attention_flops
        / _timed(lambda: attention_step(k_all, v_all), repeats=repeats, cuda=cuda)
        / 1e12,
    }
    return rates


def predict(args, row: dict, inputs) -> dict:
    from agentrl.rl.step_time import predict_trainer
    from agentrl.trainer.layout import plan_layout

    plan = plan_layout(
        args, world=row["gpus"], row_tokens=row["seq"], cp=row.get("cp", 1), gpu_memory_bytes=1e18
    )
    return predict_trainer(
        args,
        plan,
        inputs,
        tokens_per_step=row["seq"] * row["gpus"] // row.get("cp", 1),
        mean_sample_tokens=row["seq"],
    )


def fit(rows: list[dict], args_for) -> dict[str, float]:
    """Effective grouped/attention rates and overhead from the 1-GPU rows, CP attention from a CP row."""
    import numpy as np

    from agentrl.rl.step_time import PlanSection

    single = [r for r in rows if r["gpus"] == 1 and r.get("cp", 1) == 1 and "step_s" in r]
    if len(single) < 3:
        raise SystemExit("--fit needs three 1-GPU rows of different lengths")
    A, b = [], []
    for r in single:
        unit = predict(
            args_for(r),
            r,
            PlanSection(
                dense_gemm_tflops=r["matmul_tflops"],
                grouped_gemm_tflops=1.0,
                attention_tflops=1.0,
                step_overhead_s=0.0,
            ),
        ).terms
        A.append([unit["grouped_gemm_s"], unit["attention_s"], 1.0])
        b.append(r["step_s"] - unit["dense_gemm_s"] - unit["optimizer_s"])
    x, *_ = np.linalg.lstsq(np.array(A), np.array(b), rcond=None)
    if min(x) <= 0:  # a rate or the overhead came out negative: the rows do not pin them down
        return {
            "not_identifiable": f"coefficients {x.tolist()} (seconds per TFLOP/s, overhead): the rows are "
            "dominated by noise or by costs the model lacks"
        }
    fitted = {"grouped_gemm_tflops": 1 / x[0], "attention_tflops": 1 / x[1], "step_overhead_s": x[2]}
    cp_rows = [r for r in rows if r.get("cp", 1) > 1 and "step_s" in r]
    if cp_rows:
        r = min(cp_rows, key=lambda r: r["seq"])
        unit = predict(
            args_for(r),
            r,
            PlanSection(dense_gemm_tflops=r["matmul_tflops"], **fitted, cp_attention_tflops=1.0),
        ).terms
        # step = compute (its attention at the CP rate) + exposed comms + optimizer (compute > FSDP here)
        other = (
            unit["compute_s"]
            - unit["attention_s"]
            + unit["ep_all_to_all_s"]
            + unit["cp_all_gather_s"]
            + unit["optimizer_s"]
        )
        fitted["cp_attention_tflops"] = unit["attention_s"] / (r["step_s"] - other)
        fitted["cp_fit_row"] = f"{r['gpus']}gpu_{r['seq']}_cp{r['cp']}"
    return fitted


def compare(rows: list[dict], args_for, measured_rates: dict | None, *, defaults: bool = True) -> list[dict]:
    """Each measured row beside its predictions: from the committed defaults (H200 rates) and/or from the
    rates measured in the same run."""
    from agentrl.rl.step_time import PlanSection

    table = []
    for r in rows:
        if "step_s" not in r:
            continue
        out = {
            "key": f"{r['gpus']}x_{r['seq']}"
            + (f"_cp{r['cp']}" if r.get("cp", 1) > 1 else "")
            + f"_L{r.get('layers', 2)}",
            "measured_s": r["step_s"],
        }
        if defaults:
            predicted = predict(args_for(r), r, PlanSection(dense_gemm_tflops=r["matmul_tflops"]))
            out["predicted_defaults_s"] = predicted.total_s
            out["error_defaults"] = predicted.total_s / r["step_s"] - 1
        if measured_rates:
            rated = predict(
                args_for(r), r, PlanSection(**{**measured_rates, "dense_gemm_tflops": r["matmul_tflops"]})
            )
            out["predicted_measured_rates_s"] = rated.total_s
            out["error_measured_rates"] = rated.total_s / r["step_s"] - 1
            out["terms_measured_rates"] = rated.terms
        table.append(out)
    return table


def print_table(table: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    view = Table(title=title)
    for column in (
        "row",
        "measured s",
        "pred. (rates of this run) s",
        "error",
        "pred. (defaults) s",
        "error",
    ):
        view.add_column(column, justify="right")

    def cells(t: dict, name: str) -> list[str]:
        value = t.get(f"predicted_{name}_s")
        return ["", ""] if value is None else [f"{value:.3f}", f"{t[f'error_{name}']:+.1%}"]

    for t in table:
        view.add_row(t["key"], f"{t['measured_s']:.3f}", *cells(t, "measured_rates"), *cells(t, "defaults"))
    Console().print(view)


def gpu_rows(layers: int, seqs: list[int], gpus: int, steps: int, cp2: list[int]) -> list[dict]:
    """Trainer steps measured by bench/trainer_mfu.py's worker (1 process, or torchrun on `gpus`)."""
    out = RESULTS / f".step_time_check_{gpus}gpu_L{layers}.json"
    out.unlink(missing_ok=True)
    worker = (
        [
            str(ROOT / "bench" / "trainer_mfu.py"),
            "--layers",
            str(layers),
            "--steps",
            str(steps),
            "--worker-out",
            str(out),
        ]
        + [x for s in seqs for x in ("--seq", str(s))]
        + [x for s in cp2 for x in ("--cp2-seq", str(s))]
    )
    command, env = gpu_launch(gpus, worker)
    if subprocess.run(command, env=env).returncode != 0 or not out.exists():
        print(f"{gpus}-GPU run with {layers} layers failed")
        return []
    rows = [dict(r, layers=layers) for r in json.loads(out.read_text())]
    out.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU variant (tiny model); also without CUDA")
    parser.add_argument(
        "--fit", action="store_true", help="refit the defaults on bench/results/trainer_mfu.json"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--quick", action="store_true", help="CPU variant: two short rows only (the test)")
    parser.add_argument(
        "--results", type=Path, help="JSON output (default bench/results/step_time_check*.json)"
    )
    options = parser.parse_args()
    if options.fit:
        rows = json.loads((RESULTS / "trainer_mfu.json").read_text())["runs"]
        fitted = fit(rows, lambda r: air_args(2))
        print("fitted:", json.dumps(fitted))
        print_table(compare(rows, lambda r: air_args(2), None), "committed H200 rows vs the defaults")
        return
    import torch

    cuda = torch.cuda.is_available() and not options.cpu
    started = time.time()
    if cuda:
        # Trainer rows first, in their own processes, on a GPU this process has not touched yet.
        # 1 MoE layer at 16k beside 2: a cost per layer (not per micro-batch) shows as that row's error;
        # 3 or more layers do not fit one H200 beside fp32 Adam states (the planner: 131.6 GiB at 8k).
        rows = gpu_rows(2, [8192, 16384, 32768], 1, options.steps, []) + gpu_rows(
            1, [16384], 1, options.steps, []
        )
        if torch.cuda.device_count() >= 2:
            rows += gpu_rows(2, [32768], 2, options.steps, [65536])
        try:  # the measured rows are kept even if a rate's kernel fails here
            rates = measure_rates(air_args(2), seq=16384, cuda=True, gemm_size=8192)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON and on the console
            print(f"measuring the rates failed: {type(exc).__name__}: {exc}")
            rates = {"error": f"{type(exc).__name__}: {exc}"}
        args_for, path = (lambda r: air_args(r.get("layers", 2))), RESULTS / "step_time_check.json"
        device = torch.cuda.get_device_name(0)
    else:
        torch.manual_seed(0)
        rates = measure_rates(tiny_args(2), seq=256 if options.quick else 1024, cuda=False, gemm_size=512)
        rows = []
        shapes = ((2, (128, 256)),) if options.quick else ((2, (256, 512, 1024)), (4, (512,)))
        for layers, seqs in shapes:
            for seq in seqs:
                rows.append(
                    dict(
                        _measure(
                            seq,
                            1,
                            tiny_args(layers),
                            1,
                            0,
                            options.steps,
                            rates["dense_gemm_tflops"] * 1e12,
                            warmup=1,
                        ),
                        layers=layers,
                    )
                )
        args_for, path = (lambda r: tiny_args(r["layers"])), RESULTS / "step_time_check_cpu.json"
        device = "cpu"
    measured_rates = None if "error" in rates else rates
    table = compare(rows, args_for, measured_rates, defaults=cuda)  # the defaults are H200 rates
    print("rates measured in this run (TFLOP/s):", json.dumps(rates if measured_rates is None
                                                              else {k: round(v, 4) for k, v in rates.items()}))
    print_table(table, f"trainer step time: measured vs predicted ({device})")
    fitted = fit(rows, args_for) if sum(r["gpus"] == 1 for r in rows) >= 3 else None
    path = options.results or path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "device": device,
                "torch": torch.__version__,
                "load_average_1m": os.getloadavg()[0],
                "cpu_count": os.cpu_count(),
                "rates": rates,
                "rows": table,
                "fitted": fitted,
                "runs": rows,
                "wall_s": time.time() - started,
            },
            indent=2,
            default=str,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
