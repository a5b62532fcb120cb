"""Benchmark of the inference features on one GPU, on one model in one run: bf16 against FP8 serving.

    python3 bench/inference_features.py --model runs/gpu-1xh200/glm-air-5b-sft [--requests 256 --tokens 256]

For each variant (`--variants`, default bf16, fp8 with one scale per tensor, fp8 with 128 x 128 block
scales), one CUDA vLLM server as `agentrl train` starts it (`rl.inference_actor.replica_server`: routed
experts on, CUDA graphs on, the KV cache in bf16 so that only the weights differ), then:

- throughput: `--requests` concurrent token-in requests of `--prompt-tokens` random tokens, each
  decoding `--tokens` tokens (ignore_eos); completion tokens per second of wall time, and whether every
  choice returned its routed experts;
- agreement with bf16: the prompt logprobs of 16 fixed sequences, mean and largest |difference| from
  the bf16 server's (the first variant's).

Prints a table and writes bench/results/inference_features.json (after each variant, so a run cut short
keeps what it measured). KV offload and prefill/decode disaggregation join this table as they land.
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
}


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

    deployment = InferenceConfig(device="gpu", gpu_memory_utilization=args.memory, max_model_len=1024,
                                  max_num_seqs=args.requests, routed_experts=True, cuda_graphs=True,
                                  fp8_kv_cache=False, **VARIANTS[name])
    server = replica_server(deployment, model, served_name="policy", dtype="bfloat16", log_path=work / f"{name}.log")
    with server:
        row = {"variant": name, "server_start_s": round(server.startup_s or 0.0, 1)}
        row.update(asyncio.run(throughput(server.url, requests=args.requests, prompt_tokens=args.prompt_tokens,
                                          tokens=args.tokens, vocab=vocab)))
        logprobs = prompt_logprobs(server.url, vocab=vocab)
    return row, logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "runs" / "gpu-1xh200" / "glm-air-5b-sft")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--memory", type=float, default=0.5, help="gpu_memory_utilization of each server")
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
    reference: list[list[float]] | None = None
    for name in names:
        console.print(f"[dim]{name}: starting the server...[/dim]")
        row, logprobs = bench_variant(name, args.model, args=args, vocab=vocab, work=args.work)
        if reference is None:
            reference = logprobs
        differences = [abs(a - b) for ours, theirs in zip(logprobs, reference) for a, b in zip(ours, theirs)]
        row["logprob_diff_vs_first_mean"] = sum(differences) / len(differences)
        row["logprob_diff_vs_first_max"] = max(differences)
        rows.append(row)
        base = rows[0]["tokens_per_s"]
        for item in rows:
            item["speedup_vs_first"] = round(item["tokens_per_s"] / base, 3)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"model": str(args.model), "host": platform.node(),
                                            "settings": {k: v for k, v in vars(args).items() if k not in ("results",
                                                         "work", "model")}, "rows": rows}, indent=2, default=str))
    table = Table(title=f"inference features, {args.requests} requests x {args.tokens} tokens")
    for column in ("variant", "tok/s", "x first", "routed experts", "|dlogprob| mean", "max", "start s"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["variant"], f"{row['tokens_per_s']:.0f}", f"{row['speedup_vs_first']:.2f}",
                      f"{row['routed_experts_returned']}/{row['requests']}", f"{row['logprob_diff_vs_first_mean']:.4f}",
                      f"{row['logprob_diff_vs_first_max']:.3f}", f"{row['server_start_s']:.0f}")
    console.print(table)
    console.print(f"written: {args.results}")


if __name__ == "__main__":
    main()
