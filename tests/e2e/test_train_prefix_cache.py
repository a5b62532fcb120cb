"""The multi-turn agent recipe with vLLM's prefix cache on (`inference.prefix_caching`): Router Replay stays whole.

Each turn of a sandboxed episode re-sends the whole conversation, so most prompt tokens are prefix-cache hits that
the server never forwards again; agentrl's plugin gives them the routing recorded when their blocks were computed.
Synchronous and in float32, every sample comes from the weights the trainer holds, so the mismatch KL is float32
rounding (~1e-12 here) at every step only if every token's experts and every cached block are this version's: a
block computed before a weight update and reused after it gave 3e-6..7e-4 before updates dropped the cache.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from agentrl.rl.report import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import ROOT, run_train  # noqa: E402

CI_CONFIG = ROOT / "cookbook" / "cpu-agent" / "ci.toml"


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_prefix_cached_agent_run_replays_every_token_with_this_versions_blocks(tmp_path):
    run_dir = tmp_path / "run"
    returncode, output = run_train(["--config", str(CI_CONFIG), "-o", str(run_dir), "--set", "eval.every=0",
                                    "--set", "inference.prefix_caching=true",
                                    "--set", "orchestrator.max_off_policy_steps=0"], timeout=840)
    assert returncode == 0, output[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(6))
    for row in rows:
        assert row["r3/replayed_fraction"] == 1.0 and row["mismatch_kl"] < 1e-9, row
        assert row["tool_calls_per_rollout"] >= 1.5  # several turns: later ones hit the cache
    log = "\n".join(path.read_text(errors="replace") for path in (run_dir / "logs").glob("vllm-*.log"))
    rates = [float(rate) for rate in re.findall(r"Prefix cache hit rate: ([0-9.]+)%", log)]
    assert rates and max(rates) > 30.0, rates[-5:]
