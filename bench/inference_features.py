"""Benchmark of the inference features on one GPU, on one model in one run: bf16 against FP8 serving, and a
KV-bound multi-turn workload without and with KV offload.

    python3 bench/inference_features.py --model runs/gpu-1xh200/glm-air-5b-sft [--requests 256 --tokens 256]
    python3 bench/inference_features.py --variants kv-none,kv-native [--sessions 32 --context 3000 --kv-tokens 32768]

For each variant (`--variants`, default bf16, fp8 with one scale per tensor, fp8 with 128 x 128 block
scales; also kv-none and kv-native), one CUDA vLLM server as `agentrl train` starts it
(`rl.inference_actor.replica_server`: routed experts on, CUDA graphs on, the KV cache in bf16 so that only
the weights differ), then:

- throughput (bf16, fp8, fp8-block): `--requests` concurrent token-in requests of `--prompt-tokens` random
  tokens, each decoding `--tokens` tokens (ignore_eos); completion tokens per second of wall time, and
  whether every choice returned its routed experts;
- multi-turn (kv-none, kv-native with `--offload-gib` of vLLM's native CPU offload): `--sessions` sessions
  at once, each a `--context`-token prompt then `--turns` turns that add the answer (`--turn-tokens`) and a
  32-token tool output, with a GPU KV cache of `--kv-tokens` tokens, far fewer than the sessions hold:
  completion tokens/s, the prompt tokens computed again (vLLM's counters: prompt tokens less cached ones,
  local and loaded through the connector), preemptions, and routed-experts rows unknown (-1; Router Replay
  through offload is agentrl's plugin, `inference/vllm_plugin/routed_offload.py`);
- agreement: the prompt logprobs of 16 fixed sequences, mean and largest |difference| from the first
  variant's of the same workload.

Prints a table and writes bench/results/inference_features.json (after each variant, so a run cut short
keeps what it measured). Prefill/decode disaggregation joins this table when it lands.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "inference_features.json"
VARIANTS = {
    "bf16": {"fp8": False},
    "fp8": {"fp8": True, "fp8_scales": "tensor"},
    "fp8-block": {"fp8": True, "fp8_scales": "block"},
    # the KV-bound multi-turn workload (`multi_turn`), without and with vLLM's native CPU offload
    "kv-none": {"fp8": False, "workload": "multi-turn"},
    "kv-native": {"fp8": False, "kv_offload": "cpu", "workload": "multi-turn"},
}
COUNTERS = ("vllm:prompt_tokens", "vllm:prompt_tokens_cached", "vllm:external_prefix_cache_hits",
            "vllm:num_preemptions", "vllm:generation_tokens")


def counters(text: str) -> dict[str, float]:
    """Prometheus text -> the `COUNTERS`, each summed over its labels (`_total` samples; `_created` left out)."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0]
        if metric.endswith("_total") and metric.removesuffix("_total") in totals:
            totals[metric.removesuffix("_total")] += float(value)
    return totals


def multi_turn_sessions(*, sessions: int, context: int, turns: int, vocab: int) -> list[dict]:
    """Each session: a long context of its own, then `turns` turns that each add the last answer and a short tool
    output (fixed here, from a seed), so every turn's prompt is the previous one grown: a KV-bound agent workload."""
    rng = random.Random(2)
    return [{"context": [rng.randrange(3, vocab) for _ in range(context)],
             "outputs": [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(turns)]} for _ in range(sessions)]


async def multi_turn(url: str, *, sessions: int, context: int, turns: int, tokens: int, vocab: int) -> dict:
    """All sessions at once, each turn waiting for the last: wall time, completion tokens/s, the prompt tokens vLLM
    computed again (prompt tokens less cached ones, local and loaded through a connector), and routed-experts rows
    unknown (-1) in the answers."""
    from agentrl.routed import decode_routed_experts_array

    work = multi_turn_sessions(sessions=sessions, context=context, turns=turns, vocab=vocab)
    limits = httpx.Limits(max_connections=sessions + 8)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        async def session(item: dict, index: int) -> tuple[int, int]:
            prompt, completion, unknown = list(item["context"]), 0, 0
            for turn, output in enumerate(item["outputs"]):
                body = {"token_ids": prompt, "sampling_params": {"max_tokens": tokens, "temperature": 1.0,
                                                                  "seed": index * 100 + turn, "ignore_eos": True}}
                response = await client.post(f"{url}/inference/v1/generate", json=body)
                response.raise_for_status()
                choice = response.json()["choices"][0]
                rows = decode_routed_experts_array(choice.get("routed_experts"))
                unknown += 0 if rows is None else int((rows < 0).any(axis=(1, 2)).sum())
                completion += len(choice["token_ids"])
                prompt += choice["token_ids"] + output
            return completion, unknown

        before = counters((await client.get(f"{url}/metrics")).text)
        started = time.perf_counter()
        done = await asyncio.gather(*(session(item, i) for i, item in enumerate(work)))
        wall = time.perf_counter() - started
        after = counters((await client.get(f"{url}/metrics")).text)
    moved = {name.removeprefix("vllm:"): after[name] - before[name] for name in COUNTERS}
    completion = sum(count for count, _ in done)
    return {"completion_tokens": completion, "wall_s": round(wall, 2), "tokens_per_s": round(completion / wall, 1),
            "prompt_tokens": moved["prompt_tokens"], "prompt_tokens_cached": moved["prompt_tokens_cached"],
            "prompt_tokens_loaded": moved["external_prefix_cache_hits"],
            "prefill_recomputed": moved["prompt_tokens"] - moved["prompt_tokens_cached"],
            "preemptions": moved["num_preemptions"], "routed_rows_unknown": sum(unknown for _, unknown in done),
            "requests": sessions * turns}


async def throughput(url: str, *, requests: int, prompt_tokens: int, tokens: int, vocab: int) -> dict:
    """Completion tokens per second of `requests` concurrent requests, and how many returned routed experts."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    limits = httpx.Limits(max_connections=requests + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(prompt: list[int], index: int) -> tuple[int, bool]:
            body = {"token_ids": prompt, "sampling_params": {"max_tokens": tokens, "temperature": 1.0, "seed": index,
                                                              "ignore_eos": True}}
            response = await client.post(f"{url}/inference/v1/generate", json=body)
            response.raise_for_status()
            choice = response.json()["choices"][0]
            return len(choice["token_ids"]), bool(choice.get("routed_experts"))

        await asyncio.gather(*(one(prompt, i) for i, prompt in enumerate(prompts[:8])))  # warm up
        started = time.perf_counter()
        done = await asyncio.gather(*(one(prompt, i) for i, prompt in enumerate(prompts)))
        wall = time.perf_counter() - started
    completion = sum(count for count, _ in done)
    return {"completion_tokens": completion, "wall_s": round(wall, 2), "tokens_per_s": round(completion / wall, 1),
            "routed_experts_returned": sum(routed for _, routed in done), "requests": requests}


def prompt_logprobs(url: str, *, vocab: int) -> list[list[float]]:
    """The prompt logprobs of 16 fixed 256-token sequences."""
    rng = random.Random(1)
    out = []
    with httpx.Client(timeout=300) as client:
        for _ in range(16):
            tokens = [rng.randrange(3, vocab) for _ in range(256)]
            body = {"token_ids": tokens, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
            response = client.post(f"{url}/inference/v1/generate", json=body)
            response.raise_for_status()
            entries = response.json()["prompt_logprobs"][1:]
            out.append([entry[str(token)]["logprob"] for entry, token in zip(entries, tokens[1:], strict=True)])
    return out


def bench_variant(name: str, model: Path, *, args: argparse.Namespace, vocab: int, work: Path) -> tuple[dict, list]:
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.rl.inference_actor import replica_server

    fields = dict(VARIANTS[name])
    multi = fields.pop("workload", None) == "multi-turn"
    if multi:  # the GPU's KV cache holds `--kv-tokens`, far fewer than the sessions' prompts together
        fields.update(kv_cache_memory_bytes=args.kv_tokens * kv_bytes_per_token(model), max_model_len=8192,
                      kv_offload_gb=args.offload_gib)
    else:
        fields.update(max_model_len=1024)
    deployment = InferenceConfig(device="gpu", gpu_memory_utilization=args.memory, routed_experts=True,
                                  max_num_seqs=args.sessions if multi else args.requests, cuda_graphs=True,
                                  fp8_kv_cache=False, **fields)
    server = replica_server(deployment, model, served_name="policy", dtype="bfloat16", log_path=work / f"{name}.log")
    with server:
        row = {"variant": name, "workload": "multi-turn" if multi else "throughput",
               "server_start_s": round(server.startup_s or 0.0, 1)}
        if multi:
            row.update(asyncio.run(multi_turn(server.url, sessions=args.sessions, context=args.context,
                                              turns=args.turns, tokens=args.turn_tokens, vocab=vocab)))
        else:
            row.update(asyncio.run(throughput(server.url, requests=args.requests, prompt_tokens=args.prompt_tokens,
                                              tokens=args.tokens, vocab=vocab)))
        logprobs = prompt_logprobs(server.url, vocab=vocab)
    return row, logprobs


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of bf16 KV cache per token of a standard-attention HF checkpoint (all its layers)."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * kv_heads * head_dim * 2 * config["num_hidden_layers"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "gpu-1xh200" / "glm-air-5b-sft")
    parser.add_argument("--variants", default="bf16,fp8,fp8-block")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--memory", type=float, default=0.5, help="gpu_memory_utilization of each server")
    parser.add_argument("--sessions", type=int, default=32, help="multi-turn: sessions at once")
    parser.add_argument("--context", type=int, default=3000, help="multi-turn: each session's first prompt")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    parser.add_argument("--turn-tokens", type=int, default=64, help="multi-turn: tokens per answer")
    parser.add_argument("--kv-tokens", type=int, default=32768, help="multi-turn: tokens the GPU's KV cache holds")
    parser.add_argument("--offload-gib", type=float, default=16.0, help="multi-turn: CPU offload per server")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=Path("/tmp/agentrl-inference-features"))
    args = parser.parse_args()
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not (args.model / "config.json").is_file():
        sys.exit(f"inference_features: {'unknown variant ' + unknown[0] if unknown else f'no model at {args.model}'};"
                 f" variants are {', '.join(VARIANTS)}, --model a HF checkpoint folder")
    args.work.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    console = Console()
    rows: list[dict] = []
    references: dict[str, tuple[list[list[float]], float]] = {}  # per workload: the first variant's
    for name in names:
        console.print(f"[dim]{name}: starting the server...[/dim]")
        row, logprobs = bench_variant(name, args.model, args=args, vocab=vocab, work=args.work)
        reference, base = references.setdefault(row["workload"], (logprobs, row["tokens_per_s"]))
        differences = [abs(a - b) for ours, theirs in zip(logprobs, reference) for a, b in zip(ours, theirs)]
        row["logprob_diff_vs_first_mean"] = sum(differences) / len(differences)
        row["logprob_diff_vs_first_max"] = max(differences)
        row["speedup_vs_first"] = round(row["tokens_per_s"] / base, 3)
        rows.append(row)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"model": str(args.model), "host": platform.node(),
                                            "settings": {k: v for k, v in vars(args).items() if k not in ("results",
                                                         "work", "model")}, "rows": rows}, indent=2, default=str))
    table = Table(title=f"inference features: throughput {args.requests} requests x {args.tokens} tokens; multi-turn "
                        f"{args.sessions} sessions x {args.turns} turns from {args.context} tokens, KV for "
                        f"{args.kv_tokens} tokens")
    for column in ("variant", "tok/s", "x first", "routed experts", "prefill recomputed", "|dlogprob| mean", "max",
                   "start s"):
        table.add_column(column)
    for row in rows:
        routed = (f"{row['routed_experts_returned']}/{row['requests']}" if "routed_experts_returned" in row
                  else f"{row['routed_rows_unknown']} rows unknown")
        recomputed = f"{row['prefill_recomputed']:.0f}/{row['prompt_tokens']:.0f}" if "prompt_tokens" in row else "-"
        table.add_row(row["variant"], f"{row['tokens_per_s']:.0f}", f"{row['speedup_vs_first']:.2f}", routed,
                      recomputed, f"{row['logprob_diff_vs_first_mean']:.4f}", f"{row['logprob_diff_vs_first_max']:.3f}",
                      f"{row['server_start_s']:.0f}")
    console.print(table)
    console.print(f"written: {args.results}")


if __name__ == "__main__":
    main()
