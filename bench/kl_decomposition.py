"""Where the mismatch KL comes from, on the same samples: inference's own numerics, the trainer's kernels, routing.

    python3 bench/kl_decomposition.py                        # CPU: tiny-moe's reverse-text warm start, bf16
    python3 bench/kl_decomposition.py --dtype float32 --samples 32

One vLLM server (`rl.inference_actor.replica_server`, routed experts on) samples `--samples` completions of random
prompts at temperature 1, all at once as rollouts are (the sampled tokens' logprobs and routed experts: what a
rollout records), then scores every whole sequence again in one prefill pass, again all at once (`prompt_logprobs`,
and that pass's routed experts). A trainer on the
same weights (`trainer.optimizer.lr = 0`, Router Replay with its diagnostics) then takes a step on the samples twice:
against the decode-time logprobs with the decode-time routing, and against the prefill logprobs with the prefill
routing. Every figure is the mean k3 estimate of KL(reference || other) over the completion tokens (the loop's
`mismatch_kl`):

- `total_live`: decode-time logprobs against the trainer's own routing (what a run without R3 sees);
- `total_replayed`: against the trainer replaying the decode-time routing (the loop's `mismatch_kl` with R3);
- `routing_flips` = total_live - total_replayed: what replaying the routing removes;
- `inference_self`: decode-time against vLLM's own prefill of the same tokens (batching, KV cache, decode against
  prefill kernels: inference disagreeing with itself, which no trainer can remove);
- `kernels`: vLLM's prefill against the trainer replaying the prefill routing (the trainer's kernels against
  vLLM's at identical tokens, routing and mode);
- `prefill_routing_agreement`: the share of (token, MoE layer) expert sets the decode and prefill passes chose alike.

Prints a table with each part's share of `total_replayed` and writes `--results` (bench/results/kl_decomposition.json).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results" / "kl_decomposition.json"
MODEL = ROOT / "cookbook" / "cpu-default" / "tiny-moe-sft"


def k3_mean(reference: list[float], other: list[float]) -> float:
    """Mean of k3 = exp(x) - 1 - x, x = other - reference, over paired logprobs (the loop's estimator of
    KL(reference || other))."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"k3_mean: {len(reference)} and {len(other)} logprobs; give the same tokens, at least one")
    return sum(math.expm1(b - a) - (b - a) for a, b in zip(reference, other, strict=True)) / len(reference)


def decompose(*, total_live: float, total_replayed: float, inference_self: float, kernels: float) -> dict:
    """The parts and each one's share of what R3 leaves (`total_replayed`)."""
    parts = {"total_live": total_live, "total_replayed": total_replayed,
             "routing_flips": total_live - total_replayed, "inference_self": inference_self, "kernels": kernels}
    base = total_replayed if total_replayed > 0 else float("nan")
    parts["share_of_replayed"] = {"inference_self": inference_self / base, "kernels": kernels / base,
                                  "unexplained": (total_replayed - inference_self - kernels) / base}
    parts["r3_reduction"] = total_live / total_replayed if total_replayed > 0 else None
    return parts


async def _generate(client, url: str, body: dict) -> dict:
    response = await client.post(f"{url}/inference/v1/generate", json=body)
    response.raise_for_status()
    return response.json()


async def sample_and_rescore(url: str, *, samples: int, prompt_tokens: int, tokens: int, vocab: int) -> list[dict]:
    """Each sample's prompt, completion, decode-time logprobs and rows, and the prefill pass's logprobs and rows.
    All samples are decoded at once, as rollouts are, and then all re-scored at once: the batches differ."""
    import asyncio

    import httpx

    from agentrl.clients.http_pool import vllm_limits
    from agentrl.routed import decode_routed_experts_array

    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens + index % 7)] for index in range(samples)]
    async with httpx.AsyncClient(timeout=600, limits=vllm_limits(samples + 4)) as client:
        decoded = await asyncio.gather(*(_generate(client, url, {
            "token_ids": prompt, "sampling_params": {"max_tokens": tokens, "temperature": 1.0, "seed": index,
                                                     "logprobs": 0, "ignore_eos": True}})
            for index, prompt in enumerate(prompts)))
        completions = [answer["choices"][0]["token_ids"] for answer in decoded]
        rescored = await asyncio.gather(*(_generate(client, url, {
            "token_ids": prompt + completion, "sampling_params": {"max_tokens": 1, "temperature": 0,
                                                                  "prompt_logprobs": 0}})
            for prompt, completion in zip(prompts, completions, strict=True)))
    out = []
    for prompt, completion, answer, whole in zip(prompts, completions, decoded, rescored, strict=True):
        choice = answer["choices"][0]
        entries = whole["prompt_logprobs"][len(prompt):]
        out.append({"prompt": prompt, "completion": completion,
                    "decode_logprobs": [entry["logprob"] for entry in choice["logprobs"]["content"]],
                    "decode_rows": decode_routed_experts_array(choice["routed_experts"]),
                    "prefill_logprobs": [entry[str(token)]["logprob"]
                                         for entry, token in zip(entries, completion, strict=True)],
                    "prefill_rows": decode_routed_experts_array(whole["choices"][0]["routed_experts"])[
                        : len(prompt) + len(completion) - 1]})
    return out


def trainer_kl(trainer, items: list[dict], *, logprobs: str, rows: str) -> tuple[float, float]:
    """(replayed, live) mismatch KL of one lr-0 step on the samples against `logprobs` with `rows` replayed."""
    from agentrl.routed import RoutedExperts
    from agentrl.types import TrainingSample

    samples = []
    for item in items:
        prompt, completion = item["prompt"], item["completion"]
        mask = [False] * len(prompt) + [True] * len(completion)
        samples.append(TrainingSample(
            token_ids=prompt + completion, loss_mask=mask,
            inference_logprobs=[0.0] * len(prompt) + list(item[logprobs]),
            policy_versions=[-1] * len(prompt) + [0] * len(completion), advantage=0.0,
            routed_experts=RoutedExperts(item[rows][: len(prompt) + len(completion) - 1])))
    metrics = trainer.train_on_samples(samples)
    return metrics["mismatch_kl"], metrics["mismatch_kl_live_routing"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        sys.exit(f"kl_decomposition: no model at {args.model}; give --model a HF checkpoint folder")
    import asyncio

    import numpy as np

    from agentrl.inference.deployment import InferenceConfig
    from agentrl.inference.routed_experts import routing_agreement
    from agentrl.rl.inference_actor import replica_server
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    started = time.monotonic()
    deployment = InferenceConfig(device=args.device, routed_experts=True, fp8=False if args.device == "gpu" else None,
                                 max_num_seqs=16)
    with replica_server(deployment, args.model, served_name="policy", dtype=args.dtype,
                        log_path=Path("/tmp/agentrl-kl-decomposition-vllm.log")) as server:
        items = asyncio.run(sample_and_rescore(server.url, samples=args.samples, prompt_tokens=args.prompt_tokens,
                                               tokens=args.tokens, vocab=vocab))
    trainer = Trainer(TrainerConfig(row_tokens=4096, optimizer={"lr": 0.0}, router_replay=True,
                                    router_replay_diagnostics=True, parallel={"param_dtype": args.dtype}),
                      model_dir=args.model, device="cuda:0" if args.device == "gpu" else "cpu")
    replayed, live = trainer_kl(trainer, items, logprobs="decode_logprobs", rows="decode_rows")
    kernels, _ = trainer_kl(trainer, items, logprobs="prefill_logprobs", rows="prefill_rows")
    decoded = [lp for item in items for lp in item["decode_logprobs"]]
    prefilled = [lp for item in items for lp in item["prefill_logprobs"]]
    layers = trainer.args.moe_layers
    agreement = routing_agreement(np.concatenate([item["decode_rows"][: len(item["prefill_rows"])] for item in items]),
                                  np.concatenate([item["prefill_rows"] for item in items]), layers=layers)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
              "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
              "settings": {k: v for k, v in vars(args).items() if k not in ("model", "results")},
              "completion_tokens": len(decoded), "prefill_routing_agreement": agreement,
              **decompose(total_live=live, total_replayed=replayed, inference_self=k3_mean(decoded, prefilled),
                          kernels=kernels), "wall_s": round(time.monotonic() - started, 1)}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=2, default=str) + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mismatch KL decomposed ({args.dtype}, {args.device}, {len(decoded)} completion tokens)")
    for column in ("part", "mean k3", "share of R3's remainder"):
        table.add_column(column)
    shares = report["share_of_replayed"]
    for key, label in (("total_live", "decode vs trainer, live routing"),
                       ("total_replayed", "decode vs trainer, replayed routing (R3)"),
                       ("routing_flips", "routing flips (live - replayed)"),
                       ("inference_self", "vLLM decode vs vLLM prefill"),
                       ("kernels", "vLLM prefill vs trainer, replayed")):
        table.add_row(label, f"{report[key]:.3e}", f"{shares[key]:.0%}" if key in shares else "")
    table.add_row("unexplained (replayed - self - kernels)", "", f"{shares['unexplained']:.0%}")
    table.add_row("decode/prefill routing agreement", f"{agreement:.4f}", "")
    Console().print(table)
    print(f"written: {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
