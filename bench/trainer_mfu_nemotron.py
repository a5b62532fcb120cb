"""Trainer MFU on Nemotron-3-Nano-shaped layers, and the Mamba-2 scan's share of the step (GPU benchmark).

    python3 bench/trainer_mfu_nemotron.py                  # one H200: 8k, 16k and 32k tokens
    python3 bench/trainer_mfu_nemotron.py --cpu --quick    # CPU smoke run (tiny widths), also without CUDA

Model: Nemotron-3-Nano's published widths (`agentrl.models` preset ``nemotron-3-nano``: hidden
2688, Mamba-2 with 64 heads of 64 and state 128 in 8 groups, chunk 128; MoE with 128 non-gated
squared-ReLU experts top-6 of width 1856 plus a shared expert of 3712; GQA attention 32/2 heads
of 128 without RoPE; vocab 131072) in the first ``--pattern`` layers of Nano's own pattern
(default ``MEMEM*E``: 3 Mamba-2, 3 MoE, 1 attention, Nano's 23:23:6 mix; 4.6B parameters, whose
fp32 master weights, gradients and AdamW moments fit one H200 beside 32k-token activations). One
packed row of ``seq`` tokens per step, RL loss, activation checkpointing, bf16 compute, AdamW
step included: bench/trainer_mfu.py's own `_measure`.

MFU = model FLOPs per step / (step time x the bf16 GEMM rate measured in the same run); model
FLOPs = 6 x active matmul parameters + causal attention + the chunked SSD scan's four einsums
(`MoEModelArgs.training_flops_per_token`); recomputation is not counted as useful work.

Scans (``--mamba-scan``, `trainer.mamba_scan`): the float32 torch reference and fla's Triton kernels
(`agentrl.trainer.models.ssd_fla`); on the GPU both run in the same run, the torch rows being the
baseline of the ``fla_over_torch_speedup`` ratios. The scan's share: each Mamba-2 layer's conv + chunked
SSD scan (`Mamba2Mixer._scan`) and the whole mixer (projections and gated norm
too) are timed on their own at the step's shapes as the trainer runs them under activation
checkpointing (a forward without grad, then forward + backward), times the number of Mamba-2
layers, over the measured step time. Memory: the measured peak against the planner's estimate.

Prints a table; writes ``bench/results/trainer_mfu_nemotron.json`` (``--results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from trainer_mfu import DATASHEET_BF16, _measure, _timed, matmul_rate  # noqa: E402  (the trainer benchmark's code)

RESULTS = ROOT / "bench" / "results" / "trainer_mfu_nemotron.json"
NANO_PATTERN = "MEMEM*E"


def nano_args(pattern: str, *, tiny: bool = False):
    """Nemotron-3-Nano's config (the preset's published fields) cut to the layers of `pattern`."""
    from agentrl.models import PRESETS
    from agentrl.trainer.models.args import MoEModelArgs

    config = dict(
        PRESETS["nemotron-3-nano"].hf_config, num_hidden_layers=len(pattern), hybrid_override_pattern=pattern
    )
    if tiny:  # the CPU smoke run: Nano's structure at widths a laptop trains in seconds
        config.update(
            vocab_size=512,
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            chunk_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            moe_shared_expert_intermediate_size=128,
            intermediate_size=128,
        )
    return MoEModelArgs.from_hf_config(config)


def mamba_layer_times(args, *, seq: int, cuda: bool, repeats: int, scan_kernel: str = "torch") -> dict[str, float]:
    """Seconds per Mamba-2 layer per step at ``seq`` tokens, as run under activation checkpointing, with the
    scan ``scan_kernel`` ("torch" or "fla")."""
    import torch

    from agentrl.trainer.models.mamba2 import Mamba2Mixer, MambaSequences

    device = "cuda:0" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    mixer = Mamba2Mixer(args).to(device)
    mixer.scan_kernel = scan_kernel
    for weight in (mixer.in_proj.weight, mixer.out_proj.weight, mixer.conv1d.weight):
        torch.nn.init.normal_(weight, std=0.02)
    sequences = MambaSequences.for_row(torch.arange(seq, device=device))
    x = torch.randn(seq, args.hidden_size, device=device, dtype=dtype, requires_grad=True)
    xbc = torch.randn(seq, mixer.conv_dim, device=device, dtype=dtype, requires_grad=True)
    dt = torch.randn(seq, mixer.heads, device=device, dtype=dtype, requires_grad=True)

    def scan():
        with torch.no_grad():
            mixer._scan(xbc, dt, sequences.doc_T, heads=range(mixer.heads))
        mixer._scan(xbc, dt, sequences.doc_T, heads=range(mixer.heads)).float().sum().backward()

    def whole_mixer():
        with torch.autocast(x.device.type, dtype=dtype, enabled=cuda):
            with torch.no_grad():
                mixer(x, sequences)
            out = mixer(x, sequences)
        out.float().sum().backward()

    times = {
        "scan_s": _timed(scan, repeats=repeats, cuda=cuda),
        "mixer_s": _timed(whole_mixer, repeats=repeats, cuda=cuda),
    }
    return times


def run(
    pattern: str, seqs: list[int], *, steps: int, cuda: bool, tiny: bool, scans: list[str],
    partial: Path | None = None,
) -> tuple[float, list[dict]]:
    """Each (length, scan)'s row (`_measure` plus the Mamba timings); the rows so far also go to `partial`."""
    import torch

    args = nano_args(pattern, tiny=tiny)
    peak_rate = matmul_rate(size=8192 if cuda else 512)
    rows = []
    for seq, scan in ((seq, scan) for seq in seqs for scan in scans):
        try:
            row = _measure(seq, 1, args, 1, 0, steps, peak_rate, warmup=2 if cuda else 1, mamba_scan=scan)
            layer = mamba_layer_times(args, seq=seq, cuda=cuda, repeats=3 if cuda else 1, scan_kernel=scan)
            mamba = len(args.mamba_layers)
            row.update(
                mamba_scan=scan,
                pattern=pattern,
                mamba_layers=mamba,
                mamba_scan_s_per_layer=layer["scan_s"],
                mamba_mixer_s_per_layer=layer["mixer_s"],
                mamba_scan_share=mamba * layer["scan_s"] / row["step_s"],
                mamba_mixer_share=mamba * layer["mixer_s"] / row["step_s"],
                scan_flops_share=3.0
                * mamba
                * args.mamba_scan_flops_per_token()
                / args.training_flops_per_token(mean_context=seq / 2),
            )
        except Exception as exc:  # noqa: BLE001 - out of memory or a kernel's refusal: reported in the row
            row = {
                "gpus": 1,
                "seq": seq,
                "mamba_scan": scan,
                "pattern": pattern,
                "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}",
            }
        rows.append(row)
        if partial is not None:  # kept if a later length runs past the caller's time limit
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"partial": True, "runs": rows}, indent=2, default=str) + "\n")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return peak_rate, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--seq", type=int, action="append", help="tokens per step (repeatable; default 8k 16k 32k)"
    )
    parser.add_argument("--pattern", default=NANO_PATTERN, help="Nano's layer kinds to build (M, E, *)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per length")
    parser.add_argument("--cpu", action="store_true", help="CPU smoke run at tiny widths")
    parser.add_argument("--quick", action="store_true", help="with --cpu: two short rows")
    parser.add_argument("--mamba-scan", choices=["both", "torch", "fla"], default=None,
                        help="the scan (trainer.mamba_scan): 'both' (the GPU default) times the torch reference "
                        "and fla's Triton kernels in the same run; the CPU runs 'torch'")
    parser.add_argument("--results", type=Path, default=None, help=f"JSON output (default {RESULTS})")
    options = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not options.cpu
    if not cuda and not options.cpu:
        print("bench/trainer_mfu_nemotron.py needs a CUDA GPU (or --cpu for the smoke run); see docs/gpu.md")
        return 2
    seqs = options.seq or (
        [8192, 16384, 32768] if cuda else ([128, 256] if options.quick else [256, 512, 1024])
    )
    started = time.time()
    path = options.results or (RESULTS if cuda else RESULTS.with_name("trainer_mfu_nemotron_cpu.json"))
    scan = options.mamba_scan or ("both" if cuda else "torch")
    scans = ["torch", "fla"] if scan == "both" else [scan]
    peak_rate, rows = run(
        options.pattern, seqs, steps=options.steps if cuda else 1, cuda=cuda, tiny=not cuda, scans=scans,
        partial=path,
    )

    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"trainer MFU, Nemotron-3-Nano-shaped layers {options.pattern} "
        f"({'H200' if cuda else 'CPU, tiny widths'})"
    )
    for column in (
        "row tokens",
        "scan",
        "step s",
        "tokens/s",
        "TFLOP/s",
        "GEMM TFLOP/s",
        "MFU",
        "MFU (989T)",
        "scan share",
        "Mamba mixer share",
        "scan FLOP share",
        "peak GiB",
        "est. GiB",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(str(r["seq"]), r["mamba_scan"], r["error"][:48], *[""] * 10)
            continue
        memory = (
            (f"{r['peak_memory_gib']:.1f}", f"{r['estimate_gib']:.1f}") if r["peak_memory_gib"] else ("", "")
        )
        table.add_row(
            str(r["seq"]),
            r["mamba_scan"],
            f"{r['step_s']:.3f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['tflops_per_gpu']:.1f}",
            f"{r['matmul_tflops']:.1f}",
            f"{r['mfu']:.1%}",
            f"{r['mfu_datasheet']:.1%}",
            f"{r['mamba_scan_share']:.1%}",
            f"{r['mamba_mixer_share']:.1%}",
            f"{r['scan_flops_share']:.1%}",
            *memory,
        )
    Console().print(table)
    measured = [r for r in rows if "error" not in r]
    at_longest = max(measured, key=lambda r: (r["seq"], r["mamba_scan"] == scans[-1])) if measured else None
    by_scan = {(r["seq"], r["mamba_scan"]): r for r in measured}
    speedups = {  # the torch scan is the same run's baseline
        str(seq): {what: by_scan[seq, "torch"][key] / by_scan[seq, "fla"][key]
                   for what, key in (("step", "step_s"), ("scan", "mamba_scan_s_per_layer"))}
        for seq in seqs if (seq, "torch") in by_scan and (seq, "fla") in by_scan
    }
    summary = {
        "benchmark": "trainer_mfu_nemotron",
        "pattern": options.pattern,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "matmul_tflops": peak_rate / 1e12,
        "datasheet_tflops": DATASHEET_BF16 / 1e12,
        "mfu_at_longest": at_longest and at_longest["mfu"],
        "longest_seq": at_longest and at_longest["seq"],
        "mamba_scan_share_at_longest": at_longest and at_longest["mamba_scan_share"],
        "scan_at_longest": at_longest and at_longest["mamba_scan"],
        "fla_over_torch_speedup": speedups,
        "runs": rows,
        "wall_s": time.time() - started,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
