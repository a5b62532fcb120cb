"""Benchmark of the Docker sandbox backend against raw Docker, measured in one run.

    python3 bench/sandbox.py [--iterations 20] [--pooled-execs 50] [--concurrent 64] [--runsc]

1. create+exec+destroy: `create_sandbox()` -> `exec("true")` -> `close()` (all security options
   on: no network, cpu/memory/pids limits, read-only root with a tmpfs workspace, caps dropped,
   no-new-privileges, labels) versus the baseline `docker run --rm --network none IMAGE true`
   (the Docker CLI), iterations interleaved so both see the same machine load.
   Target: create_ratio = agentrl p50 / baseline p50 <= 1.2.
2. pooled exec: `exec("true")` on a sandbox taken from a warm `SandboxPool`, with `docker exec`
   (CLI) on a running container as a reference. Target: p50 < 50 ms.
3. concurrency: 64 sandboxes created at once, each running a short command, all held alive
   together, then destroyed; failures counted (target 0); memory: the 64 containers' cgroup
   usage summed while all are alive, and the host's peak used memory (MemTotal - MemAvailable,
   sampled every 50 ms; on a shared machine other processes move it too).
With --runsc, step 1 is repeated under gVisor against `docker run --runtime runsc`.

Prints a rich table and writes bench/results/sandbox.json (`create_ratio`,
`pooled_exec_p50_ms`, `concurrent_failures` beside the raw figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console
from rich.table import Table

from agentrl.sandbox import SandboxConfig, SandboxPool, create_sandbox

RESULTS = ROOT / "bench" / "results" / "sandbox.json"
IMAGE = "agentrl-base:bookworm"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": round(statistics.median(ms), 1), "p95_ms": round(percentile(ms, 95), 1),
            "mean_ms": round(statistics.fmean(ms), 1), "n": len(ms)}


def used_memory_mb() -> float:
    info = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


async def raw_docker_run(runtime: str) -> float:
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        "docker", "run", "--rm", "--network", "none", "--runtime", runtime, IMAGE, "true",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"docker run failed: {err.decode()[-300:]}")
    return time.perf_counter() - started


async def agentrl_cycle(config: SandboxConfig) -> float:
    started = time.perf_counter()
    async with create_sandbox(config) as sandbox:
        result = await sandbox.exec("true")
    if result.exit_code != 0:
        raise RuntimeError(f"exec failed: {result}")
    return time.perf_counter() - started


async def bench_create(iterations: int, runtime: str) -> dict:
    config = SandboxConfig(runtime=runtime, owner="bench-sandbox")
    await agentrl_cycle(config)  # warm-up: client, image seed cache, page cache
    await raw_docker_run(runtime)
    baseline, agentrl = [], []
    for _ in range(iterations):  # interleaved, so both see the same load
        baseline.append(await raw_docker_run(runtime))
        agentrl.append(await agentrl_cycle(config))
    base, ours = summary(baseline), summary(agentrl)
    return {
        "runtime": runtime,
        "baseline_docker_run": base,
        "agentrl_create_exec_destroy": ours,
        "ratio_p50": round(ours["p50_ms"] / base["p50_ms"], 3),
        "ratio_p95": round(ours["p95_ms"] / base["p95_ms"], 3),
    }


async def bench_pooled_exec(count: int) -> dict:
    async with SandboxPool(SandboxConfig(owner="bench-sandbox"), size=1) as pool:
        async with pool.sandbox() as sandbox:
            for _ in range(3):
                await sandbox.exec("true")
            times = []
            for _ in range(count):
                started = time.perf_counter()
                result = await sandbox.exec("true")
                times.append(time.perf_counter() - started)
                assert result.exit_code == 0
            cli = []
            for _ in range(max(5, count // 5)):
                started = time.perf_counter()
                subprocess.run(["docker", "exec", sandbox.id, "true"], check=True)
                cli.append(time.perf_counter() - started)
    return {"agentrl_exec": summary(times), "docker_exec_cli": summary(cli)}


def container_memory_mb(container_id: str) -> float | None:
    """A container's memory use (cgroup v1 or v2), or None when its cgroup is not found."""
    for path in (f"/sys/fs/cgroup/memory/docker/{container_id}/memory.usage_in_bytes",
                 f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.current"):
        try:
            return int(Path(path).read_text()) / 2**20
        except OSError:
            continue
    return None


async def bench_concurrent(count: int) -> dict:
    idle = used_memory_mb()
    peak = [idle]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], used_memory_mb())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    config = SandboxConfig(owner="bench-sandbox", memory_mb=256)
    started = time.perf_counter()
    live: list[str] = []
    all_up = asyncio.Event()
    sandbox_memory: list[float] = []

    async def one(index: int) -> bool:
        ok = False
        try:
            async with create_sandbox(config) as sandbox:
                result = await sandbox.exec(f"echo sandbox-{index}", timeout=120)
                ok = result.exit_code == 0 and result.stdout == f"sandbox-{index}\n"
                live.append(sandbox.id)
                if len(live) == count:
                    all_up.set()
                try:  # hold the sandbox until all are up, to measure them side by side
                    await asyncio.wait_for(all_up.wait(), timeout=120)
                except TimeoutError:
                    pass
                if index == 0 and all_up.is_set():
                    sandbox_memory.extend(m for m in map(container_memory_mb, live) if m is not None)
        except Exception as error:  # counted as a failure, shown once
            print(f"sandbox {index} failed: {error}", file=sys.stderr)
        return ok

    outcomes = await asyncio.gather(*(one(i) for i in range(count)))
    wall = time.perf_counter() - started
    stop.set()
    sampler.join()
    left = subprocess.run(["docker", "ps", "-aq", "--filter", "label=agentrl.owner=bench-sandbox"],
                          capture_output=True, text=True).stdout.split()
    return {"sandboxes": count, "failures": outcomes.count(False), "wall_s": round(wall, 2),
            "all_alive_at_once": all_up.is_set(),
            "sandboxes_memory_mb_total": round(sum(sandbox_memory)),
            "sandbox_memory_mb_mean": round(sum(sandbox_memory) / len(sandbox_memory), 1) if sandbox_memory else None,
            "host_idle_used_mb": round(idle), "host_peak_used_mb": round(peak[0]),
            "host_peak_above_idle_mb": round(peak[0] - idle), "left_behind": len(left)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=20, help="create+exec+destroy cycles per side")
    parser.add_argument("--pooled-execs", type=int, default=50, help="execs timed on a pooled sandbox")
    parser.add_argument("--concurrent", type=int, default=64, help="sandboxes created at once")
    parser.add_argument("--runsc", action="store_true", help="also measure create under gVisor")
    args = parser.parse_args()

    console = Console()
    console.print(f"[bold]sandbox bench[/bold] on {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    create = await bench_create(args.iterations, "runc")
    create_runsc = await bench_create(max(5, args.iterations // 2), "runsc") if args.runsc else None
    pooled = await bench_pooled_exec(args.pooled_execs)
    concurrent = await bench_concurrent(args.concurrent)

    table = Table(title="agentrl sandboxes vs raw Docker")
    for column in ("measure", "p50 ms", "p95 ms", "target", "result"):
        table.add_column(column)
    rows = [create] + ([create_runsc] if create_runsc else [])
    for row in rows:
        base, ours = row["baseline_docker_run"], row["agentrl_create_exec_destroy"]
        table.add_row(f"docker run --rm ({row['runtime']})", f"{base['p50_ms']}", f"{base['p95_ms']}", "", "")
        table.add_row(f"agentrl create+exec+destroy ({row['runtime']})", f"{ours['p50_ms']}", f"{ours['p95_ms']}",
                      "ratio <= 1.2" if row["runtime"] == "runc" else "", f"ratio {row['ratio_p50']}")
    table.add_row(
        "docker exec (CLI)", f"{pooled['docker_exec_cli']['p50_ms']}", f"{pooled['docker_exec_cli']['p95_ms']}", "", ""
    )
    table.add_row("agentrl pooled exec", f"{pooled['agentrl_exec']['p50_ms']}", f"{pooled['agentrl_exec']['p95_ms']}",
                  "p50 < 50", "")
    table.add_row(
        f"{concurrent['sandboxes']} concurrent sandboxes",
        f"wall {concurrent['wall_s']} s",
        "",
        "0 failures",
        f"{concurrent['failures']} failures; sandboxes {concurrent['sandboxes_memory_mb_total']} MB, "
        f"host peak {concurrent['host_peak_used_mb']} MB (+{concurrent['host_peak_above_idle_mb']})",
    )
    console.print(table)

    results = {
        "create_ratio": create["ratio_p50"],
        "pooled_exec_p50_ms": pooled["agentrl_exec"]["p50_ms"],
        "concurrent_failures": concurrent["failures"],
        "create": create,
        "create_runsc": create_runsc,
        "pooled_exec": pooled,
        "concurrent": concurrent,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
                    "python": platform.python_version()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    asyncio.run(main())
