"""Trainer throughput and MFU on GLM-4.5-Air-shaped MoE layers (GPU benchmark).

    python3 bench/trainer_mfu.py                 # all visible GPUs: 1-GPU runs, then 2-GPU runs if there are 2
    python3 bench/trainer_mfu.py --layers 2 --seq 8192 --seq 32768

Model: hidden 4096, 96 query / 8 KV heads of 128 (partial RoPE 0.5, qkv bias), 128
routed experts top-8 of width 1408 plus one shared expert, vocab 151552, ``--layers``
MoE layers (default 2: the fp32 master weights, gradients and Adam moments of more do
not fit one H200 beside 32k-token activations). One packed row of ``seq`` tokens per GPU
per step (one document), RL loss, activation checkpointing, bf16 compute, AdamW step
included in the step time.

MFU = model FLOPs per step / (step time x peak). Model FLOPs = 6 x active matmul
parameters per token + causal attention (12 x layers x heads x head_dim x seq/2 per
token); recomputation by activation checkpointing is not counted as useful work. The
peak is the bf16 matmul rate measured in the same run (8192^3 GEMMs); MFU against the
H200 datasheet's 989 TFLOP/s is printed too. Memory: measured peak
(``torch.cuda.max_memory_allocated``) against the planner's estimate.

Writes ``bench/results/trainer_mfu.json`` with ``mfu_1gpu``, ``mfu_2gpu``,
``tokens_per_s`` and ``peak_memory_gib`` (per sequence length and GPU count).

``--fp8 linears|all`` (``trainer.fp8``: torchao's row-wise FP8 training of the projections, and with ``all`` the
routed experts' grouped GEMMs) times every configuration twice in the same run, bf16 then FP8, and writes
``bench/results/trainer_mfu_fp8.json`` with ``fp8_speedup`` (FP8 over bf16 tokens/s; target 1.3x at 32k) and the
FP8 rows' MFU counted in bf16-equivalent FLOPs against the same bf16 GEMM rate (target 55%).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "trainer_mfu.json"
DATASHEET_BF16 = 989.4e12
LOGPROB_CHUNK_TOKENS = 2048  # trainer.logprob_chunk_tokens of every benchmark run (the planner needs it too)


def gpu_launch(gpus: int, worker_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """Command and environment for a worker on `gpus` GPUs: one process on GPU 0, else torchrun."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if gpus == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        return [sys.executable, *worker_args], env
    with socket.socket() as sock:  # a free rendezvous port on 127.0.0.1
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus),
            "--master_addr", "127.0.0.1", "--master_port", str(port), *worker_args], env


def air_args(layers: int):
    from agentrl.trainer.models.args import MoEModelArgs

    return MoEModelArgs(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=layers, num_attention_heads=96, num_key_value_heads=8,
        head_dim=128, rotary_dim=64, rope_theta=1e6, rms_norm_eps=1e-5, attention_bias=True, num_experts=128,
        top_k=8, num_shared_experts=1, dense_layers=[], n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, score_func="sigmoid", use_correction_bias=True,
    )


def _key(row: dict) -> str:
    return (f"{row['gpus']}gpu_{row['seq']}" + (f"_cp{row['cp']}" if row.get("cp", 1) > 1 else "")
            + (f"_fp8_{row['fp8']}" if row.get("fp8", "off") != "off" else ""))


def matmul_rate(*, size: int = 8192) -> float:
    """bf16 ``size``^3 GEMM rate of this rank's GPU (FLOP/s); float32 on a CPU (the x8 bench's CPU smoke mode)."""
    import torch

    if not torch.cuda.is_available():
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b
        times = []
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return 2 * size**3 / sorted(times)[len(times) // 2]
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        for _ in range(10):
            a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / 10)
    times.sort()
    return 2 * size**3 / times[len(times) // 2]


def _timed(fn, *, repeats: int, cuda: bool) -> float:
    """Median seconds of `repeats` calls of `fn` after one warm-up call (synchronised on CUDA)."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def worker(seq_lens: list[int], layers: int, steps: int, out: Path, cp2_lens: list[int], fp8: str = "off") -> None:
    """Runs in every rank: build the trainer, time steps at each sequence length."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl")
    rank = dist.get_rank() if world > 1 else 0
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    peak_rate = matmul_rate()
    args = air_args(layers)
    results = []
    configs = [(seq, 1) for seq in seq_lens] + ([(seq, 2) for seq in cp2_lens] if world > 1 else [])
    for seq, cp in configs:
        for mode in dict.fromkeys(("off", fp8)):  # bf16, then the FP8 mode asked for, in the same run
            try:
                results.append(_measure(seq, cp, args, world, rank, steps, peak_rate, fp8=mode))
            except torch.OutOfMemoryError as exc:
                results.append({"gpus": world, "seq": seq, "fp8": mode,
                                "error": f"out of memory: {str(exc).splitlines()[0]}"})
            import gc

            gc.collect()
            torch.cuda.empty_cache()
    if rank == 0:
        out.write_text(json.dumps(results, indent=2))
    if world > 1:
        dist.destroy_process_group()


def _measure(seq, cp, args, world, rank, steps, peak_rate, *, warmup: int = 2, fp8: str = "off",
             mamba_scan: str = "auto") -> dict:
    """One configuration: ``seq`` tokens per packed row, each row split over ``cp`` GPUs;
    ``warmup`` untimed steps, then the median of ``steps`` timed steps."""
    import torch
    import torch.distributed as dist

    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer
    from agentrl.types import TrainingSample

    cuda = torch.cuda.is_available()  # False only in the x8 bench's CPU smoke mode (tiny model, gloo)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    config = TrainerConfig(row_tokens=seq, optimizer={"lr": 1e-6}, logprob_chunk_tokens=LOGPROB_CHUNK_TOKENS,
                           parallel={"ep": "auto", "cp": cp, "activation_checkpointing": True,
                                     "gpu_memory_gib": 139.0}, fp8=fp8, mamba_scan=mamba_scan)
    trainer = Trainer(config, model_args=args)
    generator = torch.Generator().manual_seed(rank)
    samples = []
    for _ in range(world // cp):
        tokens = torch.randint(0, args.vocab_size, (seq + 1,), generator=generator).tolist()
        mask = [i > seq // 2 for i in range(seq + 1)]
        samples.append(TrainingSample(token_ids=tokens, loss_mask=mask,
                                      inference_logprobs=[-11.0 if m else 0.0 for m in mask],
                                      policy_versions=[0 if m else -1 for m in mask], advantage=1.0))
    batch = trainer.pack(samples)
    for _ in range(warmup):
        trainer.step(batch)
    if cuda:
        torch.cuda.synchronize()
    if world > 1:
        dist.barrier()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        metrics = trainer.step(batch)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    step_time = times[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() if cuda else None
    tokens = seq * (world // cp)
    flops = args.training_flops_per_token(mean_context=seq / 2) * tokens
    result = {
        "gpus": world, "seq": seq, "cp": cp, "fp8": fp8, "step_s": step_time, "tokens_per_s": tokens / step_time,
        "tflops_per_gpu": flops / step_time / world / 1e12, "matmul_tflops": peak_rate / 1e12,
        "mfu": flops / step_time / world / peak_rate, "mfu_datasheet": flops / step_time / world / DATASHEET_BF16,
        "peak_memory_gib": peak / 1024**3 if cuda else None, "estimate_gib": trainer.plan.estimated_bytes / 1024**3,
        "estimate_parts_gib": {k: v / 1024**3 for k, v in trainer.plan.memory.items()},
        "plan": trainer.plan.describe(), "loss": metrics["loss"], "params": args.param_counts(),
    }
    del trainer, batch
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, action="append", help="tokens per GPU per step (repeatable)")
    parser.add_argument("--layers", type=int, default=2, help="number of MoE layers")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    parser.add_argument("--gpus", type=int, action="append", help="GPU counts to run (default 1 and 2 if present)")
    parser.add_argument("--cp2-seq", type=int, action="append", default=[],
                        help="also run 2 GPUs with context parallel 2 on rows of this many tokens (repeatable)")
    parser.add_argument("--fp8", choices=("linears", "all"), default=None,
                        help="also time trainer.fp8 in the same run (bf16 then FP8 per configuration)")
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    options = parser.parse_args()
    seqs = options.seq or [8192, 32768]
    if options.worker_out:
        worker(seqs, options.layers, options.steps, options.worker_out, options.cp2_seq, options.fp8 or "off")
        return
    import torch

    available = torch.cuda.device_count()
    if available == 0:
        print("bench/trainer_mfu.py needs a CUDA GPU; see docs/gpu.md")
        sys.exit(2)
    gpu_counts = options.gpus or [n for n in (1, 2) if n <= available]
    rows = []
    for gpus in gpu_counts:
        out = ROOT / "bench" / "results" / f".trainer_mfu_{gpus}gpu.json"
        out.unlink(missing_ok=True)
        base = [str(Path(__file__).resolve()), "--layers", str(options.layers), "--steps", str(options.steps),
                "--worker-out", str(out)] + (["--fp8", options.fp8] if options.fp8 else []) \
            + [x for s in seqs for x in ("--seq", str(s))] \
            + [x for s in options.cp2_seq for x in ("--cp2-seq", str(s))]
        command, env = gpu_launch(gpus, base)
        proc = subprocess.run(command, env=env)
        if proc.returncode != 0 or not out.exists():
            print(f"{gpus}-GPU run failed (exit {proc.returncode})")
            continue
        rows += json.loads(out.read_text())
        out.unlink()
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"trainer MFU, GLM-4.5-Air-shaped ({options.layers} MoE layers)")
    for column in ("GPUs", "row tokens", "FP8", "step s", "tokens/s", "TFLOP/s/GPU", "matmul TFLOP/s", "MFU",
                   "MFU (989T)", "peak GiB", "est. GiB", "est/peak"):
        table.add_column(column, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(str(r["gpus"]), str(r["seq"]), r.get("fp8", "off"), r["error"][:40], *[""] * 8)
            continue
        table.add_row(f"{r['gpus']}" + (f" cp{r['cp']}" if r.get("cp", 1) > 1 else ""), str(r["seq"]),
                      r.get("fp8", "off"),
                      f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['tflops_per_gpu']:.0f}", f"{r['matmul_tflops']:.0f}", f"{r['mfu']:.1%}",
                      f"{r['mfu_datasheet']:.1%}", f"{r['peak_memory_gib']:.1f}", f"{r['estimate_gib']:.1f}",
                      f"{r['estimate_gib'] / r['peak_memory_gib']:.2f}")
    Console().print(table)
    def best(gpus: int) -> float | None:
        values = [r["mfu"] for r in rows if r["gpus"] == gpus and "mfu" in r and r.get("cp", 1) == 1
                  and r.get("fp8", "off") == "off"]
        return max(values) if values else None
    rows_ok = [r for r in rows if "error" not in r]
    summary = {
        "mfu_1gpu": best(1),
        "mfu_2gpu": best(2),
        "tokens_per_s": {_key(r): r["tokens_per_s"] for r in rows_ok},
        "peak_memory_gib": {_key(r): r["peak_memory_gib"] for r in rows_ok},
        "estimate_memory_gib": {_key(r): r["estimate_gib"] for r in rows_ok},
        "matmul_tflops": rows_ok[0]["matmul_tflops"] if rows_ok else None,
        "runs": rows,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    results = RESULTS
    if options.fp8:
        results = RESULTS.with_name("trainer_mfu_fp8.json")
        summary["fp8"] = options.fp8
        summary["fp8_speedup"] = fp8_speedups(rows_ok)
        summary["mfu_fp8_1gpu"] = max([r["mfu"] for r in rows_ok if r["gpus"] == 1 and r.get("fp8", "off") != "off"],
                                      default=None)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(summary, indent=2))
    print(f"wrote {results}")


def fp8_speedups(rows: list[dict]) -> dict[str, float]:
    """{configuration: FP8 tokens/s over bf16 tokens/s} for every configuration measured both ways."""
    bf16 = {_key({**r, "fp8": "off"}): r["tokens_per_s"] for r in rows if r.get("fp8", "off") == "off"}
    return {_key({**r, "fp8": "off"}): r["tokens_per_s"] / bf16[_key({**r, "fp8": "off"})]
            for r in rows if r.get("fp8", "off") != "off" and _key({**r, "fp8": "off"}) in bf16}


if __name__ == "__main__":
    main()
