"""The RL loop on one GPU: step time split, async against sync, Router Replay in bf16, weight-update latency.

    python3 bench/gpu_loop.py                       # summarise the recipe's run folders (anywhere)
    python3 bench/gpu_loop.py --measure             # on the H200 (scripts/gpu_run.sh bench): also measure
    python3 bench/gpu_loop.py --measure-nccl        # on two H200s (scripts/gpu_run.sh x2bench; issue 25)

From the run folders of `cookbook/gpu-1xh200/train.toml` (`--async-run`, `max_off_policy_steps`
1, and `--sync-run`, the same recipe with 0; scripts/gpu_run.sh train writes them, the
committed ones are under cookbook/gpu-1xh200/results/):

* step time split (median seconds): waiting for rollouts, training, staging and loading the
  new weights;
* steps/hour in the steady state (from the end of the first step to the end of the last step
  that still had generation beside it, as bench/async.py), `async_speedup` = async / sync;
* mismatch KL with R3 on against off on the same samples (the runs train with R3 and
  `trainer.router_replay_diagnostics` also computes the KL of the trainer's own routing):
  `r3_kl_reduction_gpu` = pooled mean KL(live routing) / pooled mean KL(replayed), and the
  median of the per-step ratios; bf16 on both sides, CUDA kernels.

With `--measure` (a GPU; the recipe's SFT warm start in `--model-dir`, else glm-air-5b as created):
a vLLM server of the 5B model with the `ipc` engine beside a trainer in this process, the weight
update timed three times through CUDA IPC packed (`IpcWeightPublisher`'s default: a buffer per 1 GiB
chunk), three times unpacked (a handle per tensor), three times packed in the served layout
(`ipc_kernel`: `inference.weight_format = "kernel"`, fused tensors vLLM copies in, every update's weight check
passing) and twice through the filesystem (HF export +
`reload_weights`, `--repeats-fs`), pause to resume and end to end (`--updates-only` stops there;
`--created-model glm-air-deep` times the 46-layer model's 17,925 tensors, under
`weight_update_glm_air_deep`); then completion tokens/s through
`agentrl.evaluate` against raw requests to the same server (bench/eval_throughput.py, 256 tasks x 4
rollouts, 5 alternating repeats per arm, target ratio >= 0.9), with `--enforce-eager` and again on
a server that captured CUDA graphs (`inference.cuda_graphs`): the decode speed-up and the start-up
it costs.

`--deep-run` (the run folder of `cookbook/gpu-1xh200/r3-deep-train.toml`, glm-air-deep: GLM-4.5-Air's
46 layers at a quarter of its width) gives `r3_kl_reduction_gpu_deep`: the same paired KL at
GLM-4.5-Air's depth, where routing flips compound over 45 MoE layers. `--deep-on-policy-run` (the same
recipe with `max_off_policy_steps` 0, `R3DEEP_ARGS` of scripts/gpu_run.sh) gives it on samples the
trainer scores with the very weights that generated them, so the KL holds the kernels' and the
routing's mismatch only, not one step of the policy's own change (`..._deep_on_policy` on glm-air-deep
as created, `..._deep_sft_on_policy` from r3-deep-sft.toml's warm start: `--deep-sft-on-policy-run`).
`--graphs-run` (train.toml with `inference.cuda_graphs = true`) gives its steps/hour against the
eager async run (`cuda_graphs_run_speedup`).

`--measure-nccl` (2 GPUs; writes `bench/results/gpu_loop_x2.json`): the same model served on GPU 1
with the `nccl` engine, the trainer on GPU 0 in this process; the NCCL group formed once
(`connect_s`), then the update timed three times packed (vLLM's packed broadcast, 1 GiB buffers, as
runs send) and twice one tensor at a time (a second group), in GB/s of wire bytes (matrices bf16,
vectors float32, as every direct transport sends them) against the one-GPU IPC and filesystem
medians of `bench/results/gpu_loop.json` for the same bytes; and the run folders of
`cookbook/gpu-2xh200/train.toml` (async, and `max_off_policy_steps` 0 for sync) summarised as above
when they exist (`--async-run`, `--sync-run`; scripts/gpu_run.sh x2train / x2sync write them).

Prints a table; writes `bench/results/gpu_loop.json` (`--results`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "gpu_loop.json"
RUNS = ROOT / "cookbook" / "gpu-1xh200" / "results"
RESULTS_X2 = ROOT / "bench" / "results" / "gpu_loop_x2.json"
RUNS_X2 = ROOT / "runs" / "gpu-2xh200"
R3_FIGURES = (  # (summary in the report, its R3 figure's key, what the table adds to the key)
    ("async", "r3_kl_reduction_gpu", ""),
    ("deep", "r3_kl_reduction_gpu_deep", ", 45 MoE layers"),
    ("deep_on_policy", "r3_kl_reduction_gpu_deep_on_policy", ", 45 MoE layers, sync, created"),
    ("deep_sft_on_policy", "r3_kl_reduction_gpu_deep_sft_on_policy", ", 45 MoE layers, sync, after SFT"),
)
ASYNC_AHEAD = 1  # the recipe's max_off_policy_steps: the async run's last step trains on an earlier batch


def summarise(run_dir: Path, *, ahead: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    window = rows[1: max(2, len(rows) - ahead)]
    span_s = window[-1]["time"] - window[0]["time"]
    live = [r.get("train/mismatch_kl_live_routing") for r in rows]
    replayed = [r.get("mismatch_kl") for r in rows]
    pairs = [(lv, rp) for lv, rp in zip(live, replayed) if lv is not None and rp]
    live_mean = statistics.mean(lv for lv, _ in pairs) if pairs else None
    replayed_mean = statistics.mean(rp for _, rp in pairs) if pairs else None
    return {
        "run": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
        "steps": len(rows),
        "steps_per_hour": (len(window) - 1) / span_s * 3600 if span_s > 0 else None,
        "split_median_s": {key: statistics.median(r[key] for r in rows[1:])
                           for key in ("step_time_s", "wait_s", "train_s", "weight_stage_s", "weight_push_s")},
        "reward_first10": statistics.mean(r["reward"] for r in rows[:10]),
        "reward_last10": statistics.mean(r["reward"] for r in rows[-10:]),
        "mismatch_kl_replayed": replayed_mean,
        "mismatch_kl_live_routing": live_mean,
        "r3_kl_reduction": live_mean / replayed_mean if pairs else None,  # pooled over the same steps
        "r3_step_ratio_median": statistics.median(lv / rp for lv, rp in pairs) if pairs else None,
        "r3_replayed_fraction": sorted({r.get("r3/replayed_fraction") for r in rows if r.get("r3/replayed_fraction")}),
        # the peers' figures, per arm: tokens 2x apart (mean share), the largest log ratio; the third arm's KL
        **_arm_figures(rows),
        # the share of inference's (token, MoE layer) expert sets the trainer's own routers chose alike
        # (runs from before this metric existed have none)
        "live_routing_agreement": statistics.mean(agreement) if (agreement := [
            r["train/live_routing_agreement"] for r in rows if r.get("train/live_routing_agreement") is not None
        ]) else None,
    }


def _arm_figures(rows: list[dict]) -> dict:
    """Means of the 2x-apart shares and the largest |log ratio| of the replayed and live-routing arms, and the
    replayed ids + gate weights arm's KL, and of live routing with the gate in the other precision (the fourth
    arm, `trainer.router_float32`), over the steps that report them (older runs report none)."""
    out: dict = {}
    for suffix in ("", "_live_routing", "_replay_ids_weights", "_live_routing_reduced_gate",
                   "_live_routing_float32_gate"):
        shares = [r[f"train/mismatch_large_fraction{suffix}"] for r in rows
                  if r.get(f"train/mismatch_large_fraction{suffix}") is not None]
        largest = [r[f"train/mismatch_max_log_ratio{suffix}"] for r in rows
                   if r.get(f"train/mismatch_max_log_ratio{suffix}") is not None]
        if shares:
            out[f"mismatch_large_fraction{suffix or '_replayed'}"] = statistics.mean(shares)
        if largest:
            out[f"mismatch_max_log_ratio{suffix or '_replayed'}"] = max(largest)
    for arm in ("replay_ids_weights", "live_routing_reduced_gate", "live_routing_float32_gate"):
        kls = [r[f"train/mismatch_kl_{arm}"] for r in rows if r.get(f"train/mismatch_kl_{arm}") is not None]
        if kls:
            out[f"mismatch_kl_{arm}"] = statistics.mean(kls)
    return out


def eval_throughput(base_url: str, out: Path, *, model: str = "glm-air-5b") -> dict:
    """bench/eval_throughput.py against a running server: agentrl.evaluate vs raw requests (its JSON)."""
    import subprocess

    command = [sys.executable, str(ROOT / "bench" / "eval_throughput.py"), "--base-url", base_url, "--model", model,
               "-n", "256", "-r", "4", "--max-tokens", "128", "--concurrency", "128", "--repeats", "5",
               "--output", str(out)]
    finished = subprocess.run(command, timeout=300)
    if finished.returncode != 0 or not out.is_file():
        return {"error": f"bench/eval_throughput.py exited {finished.returncode}"}
    result = json.loads(out.read_text())
    kept = {key: result.get(key) for key in ("ratio", "agentrl_tokens_per_s", "raw_tokens_per_s", "paired_ratio_median",
                                             "raw_single_pool_tokens_per_s", "client_cpu_s_median", "errors",
                                             "config")}
    kept["agentrl_errors"] = [run.get("errors") for run in result["runs"] if run["arm"] == "agentrl"]
    return kept


def measure_updates(
    model_dir: Path, *, served_name: str = "glm-air-5b", repeats_ipc: int = 3, repeats_fs: int = 2,
    cuda_graphs: bool = True, updates: bool = True, throughput: bool = True,
) -> dict:
    """Weight-update latency of the served model through CUDA IPC (packed, the default, and unpacked)
    and through the filesystem, then agentrl.evaluate's throughput on that server (eager) and on one
    with CUDA graphs.

    `updates=False`: the throughput only (no trainer, no weight update; `weight_update` is absent);
    `throughput=False`: the updates only (`eval_throughput` is absent)."""
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.inference.direct_weights import IpcWeightPublisher
    from agentrl.inference.direct_weights import wire_bytes as direct_wire_bytes
    from agentrl.inference.weights import FilesystemWeightPublisher
    from agentrl.rl.inference_actor import replica_server
    from agentrl.trainer.checkpoint import hf_state_views
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer

    deployment = InferenceConfig(device="gpu", gpu_memory_utilization=0.30, max_model_len=4096,
                                  routed_experts=True, weight_transfer="ipc", fp8=False)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-loop-"))
    server = replica_server(deployment, model_dir, served_name=served_name, dtype="bfloat16",
                            log_path=scratch / "vllm.log")
    results: dict = {}
    if not updates:
        with server:
            measured = {"eager": eval_throughput(server.url, scratch / "eval-eager.json", model=served_name)}
            measured["eager"]["startup_s"] = server.startup_s
        return {"eval_throughput": _with_graphs(measured, deployment, model_dir, scratch, cuda_graphs=cuda_graphs,
                                                served_name=served_name)}
    with server:
        trainer = Trainer(TrainerConfig(parallel={"param_dtype": "bfloat16"}), model_dir=model_dir, device="cuda:0")
        state = hf_state_views(trainer)
        wire_bytes = sum(direct_wire_bytes(t, dtype="bfloat16") for t in state.values())
        version = 0
        errors = {}
        kernel_tensors = None
        for name, packed, kernel in (("ipc", True, False), ("ipc_unpacked", False, False), ("ipc_kernel", True, True)):
            ipc = IpcWeightPublisher([server.url], packed=packed, kernel_format=kernel)
            ipc.version = version or None
            runs = []
            try:
                for _ in range(repeats_ipc):
                    started = time.monotonic()
                    outcome = ipc.publish(hf_state_views(trainer), version + 1)
                    version += 1
                    runs.append({"total_s": time.monotonic() - started, "pause_to_resume_s": outcome.update_s})
            except Exception as error:  # noqa: BLE001 - recorded; the other arms' figures are kept
                errors[f"{name}_error"] = f"{type(error).__name__}: {error}"[:500]
            if runs:
                results[name] = runs
            if kernel and ipc._layouts:
                kernel_tensors = len(next(iter(ipc._layouts.values())))
        files = FilesystemWeightPublisher([server.url], staging_dir=scratch / "staged")
        files.version = version or None
        runs = []
        for _ in range(repeats_fs):
            version += 1
            started = time.monotonic()
            exported = trainer.export_hf(scratch / f"v{version}")
            outcome = files.publish(exported, version)
            runs.append({"total_s": time.monotonic() - started, "pause_to_resume_s": outcome.update_s})
        if runs:
            results["filesystem"] = runs
        measured = {}
        if throughput:
            measured["eager"] = eval_throughput(server.url, scratch / "eval-eager.json", model=served_name)
            measured["eager"]["startup_s"] = server.startup_s
    params = trainer.args.param_counts().get("total")
    report = {"model": served_name, "model_params": params, "tensors": len(state), "wire_bytes": wire_bytes,
              "ipc_layout": "ipc: packed (a buffer per 1 GiB chunk); ipc_unpacked: a handle per tensor; ipc_kernel: "
                            "packed, in the served layout (inference.weight_format = 'kernel')",
              "kernel_tensors": kernel_tensors,
              **{f"{name}_median_s": statistics.median(r["total_s"] for r in runs_) for name, runs_ in results.items()},
              **errors, "runs": results}
    del trainer, state
    if not throughput:
        return {"weight_update": report}
    return {"weight_update": report,
            "eval_throughput": _with_graphs(measured, deployment, model_dir, scratch, cuda_graphs=cuda_graphs,
                                            served_name=served_name)}


def measure_nccl(model_dir: Path, *, server_gpu: int = 1, repeats_packed: int = 3, repeats_unpacked: int = 2) -> dict:
    """NCCL weight-update latency into a server on `server_gpu` from a trainer on GPU 0 (see the docstring)."""
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.inference.direct_weights import NcclWeightPublisher
    from agentrl.inference.direct_weights import wire_bytes as direct_wire_bytes
    from agentrl.inference.server import free_port
    from agentrl.rl.inference_actor import replica_server
    from agentrl.rl.transport import _world_size
    from agentrl.trainer.checkpoint import hf_state_views
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer

    deployment = InferenceConfig(device="gpu", gpu_memory_utilization=0.85, max_model_len=4096,
                                  routed_experts=True, weight_transfer="nccl", fp8=False)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-loop-x2-"))
    server = replica_server(deployment, model_dir, served_name="glm-air-5b", dtype="bfloat16",
                            log_path=scratch / "vllm.log")
    server.env["CUDA_VISIBLE_DEVICES"] = str(server_gpu)
    report: dict = {"server_gpu": server_gpu, "trainer_gpu": 0}
    with server:
        trainer = Trainer(TrainerConfig(parallel={"param_dtype": "bfloat16"}), model_dir=model_dir, device="cuda:0")
        state = hf_state_views(trainer)
        wire_bytes = sum(direct_wire_bytes(t, dtype="bfloat16") for t in state.values())
        report.update(model_params=trainer.args.param_counts().get("total"), wire_bytes=wire_bytes,
                      tensors=len(state), startup_s=server.startup_s)
        version = 0
        for packed, repeats in ((True, repeats_packed), (False, repeats_unpacked)):
            name = "packed" if packed else "unpacked"
            try:
                publisher = NcclWeightPublisher([server.url], master_address="127.0.0.1",
                                                master_port=free_port("127.0.0.1"),
                                                workers_per_server=_world_size(server.url), packed=packed)
                publisher.version = version or None
                started = time.monotonic()
                publisher.connect()
                runs = []
                report[f"{name}_connect_s"] = time.monotonic() - started
                for _ in range(repeats):
                    version += 1
                    started = time.monotonic()
                    outcome = publisher.publish(hf_state_views(trainer), version)
                    runs.append({"total_s": time.monotonic() - started, "pause_to_resume_s": outcome.update_s})
            except Exception as error:  # noqa: BLE001 - recorded; the other mode's figures are kept
                report[f"{name}_error"] = f"{type(error).__name__}: {error}"[:500]
                break
            median = statistics.median(r["total_s"] for r in runs)
            report[name] = {"runs": runs, "median_s": median, "gbs": wire_bytes / median / 1e9,
                            "pause_to_resume_gbs": wire_bytes / statistics.median(r["pause_to_resume_s"]
                                                                                  for r in runs) / 1e9}
    one_gpu = (json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}).get("weight_update") or {}
    for name in ("ipc", "filesystem"):
        if one_gpu.get(f"{name}_median_s"):
            report[f"one_gpu_{name}"] = {"median_s": one_gpu[f"{name}_median_s"],
                                         "gbs": wire_bytes / one_gpu[f"{name}_median_s"] / 1e9,
                                         "source": "bench/results/gpu_loop.json (one H200, same model)"}
    del trainer
    return {"weight_update_nccl": report}


def main_nccl(args) -> int:
    """`--measure-nccl`: the two-GPU report (`gpu_loop_x2.json`)."""
    import torch

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"--measure-nccl needs 2 GPUs (trainer on GPU 0, vLLM on GPU 1); "
                         f"{torch.cuda.device_count()} visible")
    report: dict = {}
    for name, folder, ahead in (("async", args.async_run or RUNS_X2 / "rl", ASYNC_AHEAD),
                                ("sync", args.sync_run or RUNS_X2 / "rl-sync", 0)):
        if (folder / "metrics.jsonl").is_file():
            report[name] = summarise(folder, ahead=ahead)
    fast, slow = ((report.get(name) or {}).get("steps_per_hour") for name in ("async", "sync"))
    report["async_speedup"] = fast / slow if fast and slow else None
    model_dir = args.model_dir
    if not (model_dir / "config.json").is_file():
        from agentrl.models import ensure_model

        model_dir = ensure_model("glm-air-5b")
        torch.cuda.empty_cache()  # the creation's cached blocks go back before vLLM sizes its share
    report.update(measure_nccl(model_dir))

    from rich.console import Console
    from rich.table import Table

    table = Table(title="agentrl on two H200s: glm-air-5b, trainer GPU 0, vLLM GPU 1, nccl")
    for column in ("measure", "value"):
        table.add_column(column)
    update = report["weight_update_nccl"]
    for name in ("packed", "unpacked", "one_gpu_ipc", "one_gpu_filesystem"):
        if name in update:
            table.add_row(f"weight update {name} (median s, GB/s)", f"{update[name]['median_s']:.2f} s, "
                          f"{update[name]['gbs']:.1f} GB/s")
        if f"{name}_error" in update:
            table.add_row(f"weight update {name}", update[f"{name}_error"][:120])
    for name in ("async", "sync"):
        if name in report:
            split = ", ".join(f"{key} {value:.2f}" for key, value in report[name]["split_median_s"].items())
            table.add_row(f"{name} run: steps/hour; split (median s)",
                          f"{report[name]['steps_per_hour']:.0f}; {split}")
    if report["async_speedup"]:
        table.add_row("async_speedup", f"{report['async_speedup']:.2f}x")
    Console().print(table)
    results = args.results or RESULTS_X2
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {results}")
    return 0


def _with_graphs(throughput: dict, deployment, model_dir: Path, scratch: Path, *, cuda_graphs: bool,
                 served_name: str = "glm-air-5b") -> dict:
    """`throughput` plus the same measurement on a server that captured CUDA graphs (when `cuda_graphs`)."""
    if not cuda_graphs:
        return throughput
    import torch

    from agentrl.rl.inference_actor import replica_server

    torch.cuda.empty_cache()
    graphs = replica_server(deployment.model_copy(update={"cuda_graphs": True}), model_dir,
                            served_name=served_name, dtype="bfloat16", log_path=scratch / "vllm-graphs.log")
    with graphs:
        throughput["cuda_graphs"] = eval_throughput(graphs.url, scratch / "eval-graphs.json", model=served_name)
        throughput["cuda_graphs"]["startup_s"] = graphs.startup_s
    eager, captured = throughput["eager"].get("raw_tokens_per_s"), throughput["cuda_graphs"].get("raw_tokens_per_s")
    throughput["cuda_graphs_speedup_raw"] = captured / eager if eager and captured else None
    return throughput


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--async-run", type=Path, default=None,
                        help=f"default {RUNS / 'async-30-steps'} ({RUNS_X2 / 'rl'} with --measure-nccl)")
    parser.add_argument("--sync-run", type=Path, default=None,
                        help=f"default {RUNS / 'sync-16-steps'} ({RUNS_X2 / 'rl-sync'} with --measure-nccl)")
    parser.add_argument("--measure", action="store_true", help="also time weight updates on this GPU")
    parser.add_argument("--measure-nccl", action="store_true",
                        help="two GPUs: NCCL weight updates into vLLM on GPU 1 (writes gpu_loop_x2.json)")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "runs" / "gpu-1xh200" / "glm-air-5b-sft")
    parser.add_argument("--deep-run", type=Path, default=RUNS / "r3-deep-12-steps",
                        help="run folder of cookbook/gpu-1xh200/r3-deep-train.toml (skipped when absent)")
    parser.add_argument("--deep-on-policy-run", type=Path, default=RUNS / "r3-deep-on-policy-8-steps",
                        help="r3-deep-train.toml with max_off_policy_steps 0 on glm-air-deep as created "
                             "(skipped when absent)")
    parser.add_argument("--deep-sft-on-policy-run", type=Path, default=RUNS / "r3-deep-sft-on-policy-8-steps",
                        help="the same from r3-deep-sft.toml's warm start (skipped when absent)")
    parser.add_argument("--graphs-run", type=Path, default=RUNS / "async-30-steps-cuda-graphs",
                        help="train.toml with inference.cuda_graphs = true (skipped when absent)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="with --measure: only the eager server")
    parser.add_argument("--created-model", nargs="?", const="glm-air-5b", default=None, metavar="PRESET",
                        help="with --measure: this preset (default glm-air-5b) as created even when --model-dir "
                             "exists (its answers run to max_tokens, so the eval throughput measures decoding, "
                             "not short answers' latency); a preset other than glm-air-5b goes under "
                             "weight_update_<preset>")
    parser.add_argument("--eval-only", action="store_true",
                        help="with --measure: only the eval throughput (keeps an earlier weight_update)")
    parser.add_argument("--updates-only", action="store_true",
                        help="with --measure: only the weight updates (keeps an earlier eval_throughput)")
    parser.add_argument("--repeats-fs", type=int, default=2, help="with --measure: filesystem updates timed")
    parser.add_argument(
        "--results", type=Path, default=None, help=f"default {RESULTS} ({RESULTS_X2} with --measure-nccl)"
    )
    args = parser.parse_args(argv)
    if args.measure_nccl:
        return main_nccl(args)
    args.async_run, args.sync_run = args.async_run or RUNS / "async-30-steps", args.sync_run or RUNS / "sync-16-steps"
    args.results = args.results or RESULTS

    report: dict = {"async": summarise(args.async_run, ahead=ASYNC_AHEAD), "sync": summarise(args.sync_run, ahead=0)}
    fast, slow = report["async"]["steps_per_hour"], report["sync"]["steps_per_hour"]
    report["async_speedup"] = fast / slow if fast and slow else None
    if (args.deep_run / "metrics.jsonl").is_file():
        report["deep"] = summarise(args.deep_run, ahead=ASYNC_AHEAD)
    for name, run_dir in (("deep_on_policy", args.deep_on_policy_run),
                          ("deep_sft_on_policy", args.deep_sft_on_policy_run)):
        if (run_dir / "metrics.jsonl").is_file():
            report[name] = summarise(run_dir, ahead=0)
    for name, key, _ in R3_FIGURES:
        if name in report:
            report[key], report[f"{key}_step_median"] = (report[name]["r3_kl_reduction"],
                                                         report[name]["r3_step_ratio_median"])
    if (args.graphs_run / "metrics.jsonl").is_file():
        graphs = report["async_cuda_graphs"] = summarise(args.graphs_run, ahead=ASYNC_AHEAD)
        report["cuda_graphs_run_speedup"] = (graphs["steps_per_hour"] / fast
                                             if graphs["steps_per_hour"] and fast else None)
    preset = args.created_model or "glm-air-5b"
    if args.measure:
        model_dir = args.model_dir
        if args.created_model or not (model_dir / "config.json").is_file():  # the created model's weights
            from agentrl.models import ensure_model

            model_dir = ensure_model(preset)
            import torch

            torch.cuda.empty_cache()  # the creation's cached blocks go back before vLLM sizes its share
        measured = measure_updates(model_dir, served_name=preset, cuda_graphs=not args.no_cuda_graphs,
                                   updates=not args.eval_only, throughput=not args.updates_only,
                                   repeats_fs=args.repeats_fs)
        report.update({(key if preset == "glm-air-5b" else f"{key}_{preset.replace('-', '_')}"): value
                       for key, value in measured.items()})
    if args.results.is_file():  # keep an earlier measurement of what this run did not measure
        earlier = json.loads(args.results.read_text())
        for key, value in earlier.items():
            if key.startswith(("weight_update", "eval_throughput")) and value and key not in report:
                report[key] = value

    from rich.console import Console
    from rich.table import Table

    table = Table(title="agentrl on one H200: glm-air-5b, reverse-text")
    for column in ("measure", "async (ahead 1)", "sync", "target"):
        table.add_column(column)
    split_a, split_s = report["async"]["split_median_s"], report["sync"]["split_median_s"]
    for key in split_a:
        table.add_row(f"{key} (median)", f"{split_a[key]:.2f}", f"{split_s[key]:.2f}", "")
    table.add_row("steps/hour", f"{fast:.0f}", f"{slow:.0f}", "async >= 1.5x sync")
    table.add_row("async_speedup", f"{report['async_speedup']:.2f}x", "", ">= 1.5")
    table.add_row("reward first 10 -> last 10", f"{report['async']['reward_first10']:.3f} -> "
                  f"{report['async']['reward_last10']:.3f}", "", "rising")
    for key in sorted(key for key in report if key.startswith("weight_update") and key != "weight_update_nccl"):
        update = report[key]
        arms = [(name, update[f"{name}_median_s"]) for name in ("ipc", "ipc_unpacked", "ipc_kernel", "filesystem")
                if update.get(f"{name}_median_s") is not None]
        table.add_row(f"{key}: {' / '.join(name for name, _ in arms)} (median s)",
                      " / ".join(f"{seconds:.2f}" for _, seconds in arms)
                      + (f"; {update['tensors']} tensors" if update.get("tensors") else ""), "", "ipc < 2 s")
        for name in ("ipc", "ipc_unpacked", "ipc_kernel"):
            if update.get(f"{name}_error"):
                table.add_row(f"{key}: {name}", f"failed: {update[f'{name}_error'][:200]}", "", "")
    graphs = report.get("async_cuda_graphs")
    if graphs:
        table.add_row("with CUDA graphs: steps/hour, step split (median)",
                      f"{graphs['steps_per_hour']:.0f} ({report['cuda_graphs_run_speedup']:.2f}x eager); "
                      + ", ".join(f"{key} {value:.2f}" for key, value in graphs["split_median_s"].items()), "", "")
        table.add_row("with CUDA graphs: reward first 10 -> last 10, mismatch KL (R3 / live)",
                      f"{graphs['reward_first10']:.3f} -> {graphs['reward_last10']:.3f}; "
                      f"{graphs['mismatch_kl_replayed']:.2e} / {graphs['mismatch_kl_live_routing']:.2e}", "", "")
    for name in ("async", "async_cuda_graphs", "deep", "deep_on_policy", "deep_sft_on_policy"):
        if (report.get(name) or {}).get("live_routing_agreement") is not None:
            table.add_row(f"live routing agrees with inference's ({name})",
                          f"{report[name]['live_routing_agreement']:.4f} of (token, layer) sets", "", "")
    for _name, key, label in R3_FIGURES:
        if report.get(key) is not None:
            table.add_row(f"{key}{label} (pooled / step median)",
                          f"{report[key]:.2f}x / {report[f'{key}_step_median']:.2f}x", "", ">= 5")
    throughput = report.get("eval_throughput") or {}
    for mode in ("eager", "cuda_graphs"):
        row = throughput.get(mode) or {}
        if row.get("error"):
            table.add_row(f"completion tokens/s agentrl / raw ({mode})", f"not measured: {row['error']}", "", ">= 0.9")
        if "ratio" in row:
            table.add_row(f"completion tokens/s agentrl / raw ({mode})", f"{row['agentrl_tokens_per_s']:.0f} / "
                          f"{row['raw_tokens_per_s']:.0f} = {row['ratio']:.2f}", "", ">= 0.9")
        if row.get("raw_single_pool_tokens_per_s"):
            table.add_row(f"raw through one httpx pool of 128 ({mode})",
                          f"{row['raw_single_pool_tokens_per_s']:.0f} tokens/s", "", "")
    if throughput.get("cuda_graphs_speedup_raw"):
        table.add_row("CUDA graphs vs eager, raw tokens/s", f"{throughput['cuda_graphs_speedup_raw']:.2f}x", "", "")
    Console().print(table)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
