"""A short run of the agent recipe (`cookbook/cpu-agent/ci.toml`: key-hunt in Docker sandboxes on tiny-moe,
async RL with R3, from the committed SFT warm start): the reward does not fall, the rollouts call tools,
the step-time split shows sandbox time, and no sandbox outlives the run.

"Every rollout has at least one tool call" holds for all but a few: sampling at temperature 1, the warm
start breaks its first tool call's JSON in about 3% of rollouts (33 of 1,056 in the recipe's run). At that
rate a step of 16 has 2 or more such rollouts with probability 0.08 (0.4 that one of 6 steps does), so the
bound is on the run: at most a tenth of its 96 rollouts (expected 2.9; 10 or more has probability 7e-4 under
Poisson), and at most a quarter of any step's (5 or more of 16: 1e-5), which a broken format exceeds at once.

The run is 6 steps of 2 groups x 8 rollouts over a fixed set of 6 tasks (`train_tasks = 6` in ci.toml): the
orchestrator starts its groups pass by pass over the 6, so steps 0-2 hold (about: a step takes the groups that
finish first) one pass and steps 3-5 the next, and the halves compare task for task. "Does not fall": the
mean solve rate of the last 3 steps is at least that of the first 3 less 0.25. Each half is 6 tasks x 8
rollouts; at the warm start's solve rate (about 0.2) the paired difference has a standard error of about 0.08,
so 0.25 is 3 of them (a false failure about once in 700 runs). The bound was 0.15 over unpaired halves (12 tasks
drawn at random, whose own difficulty made the standard error larger than 0.1), and failed CI runs without any
fall of the policy. A collapse, e.g. a broken tool-call format, shows in the tool-call checks below first.
Whether the recipe learns is its full run's question (`cookbook/cpu-agent/README.md`: +16 held-out points), not this test's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agentrl.rl.report import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import ROOT, run_train

CI_CONFIG = ROOT / "cookbook" / "cpu-agent" / "ci.toml"


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_short_agent_run_keeps_its_reward_and_calls_tools(tmp_path):
    from agentrl.sandbox.gc import list_sandboxes

    before = {box.id for box in list_sandboxes(include_bwrap=False)}
    run_dir = tmp_path / "run"
    returncode, output = run_train(["--config", str(CI_CONFIG), "-o", str(run_dir)], timeout=840)
    assert returncode == 0, output[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(6))
    first, last = (sum(row["metrics/solved"] for row in part) / 3 for part in (rows[:3], rows[3:]))
    assert last >= first - 0.25, [round(row["metrics/solved"], 3) for row in rows]
    reward_first, reward_last = (sum(row["reward"] for row in part) / 3 for part in (rows[:3], rows[3:]))
    assert reward_last >= reward_first - 0.25, [round(row["reward"], 3) for row in rows]
    for row in rows:
        assert row["rollout_errors"] == 0, row.get("first_error")
        assert row["rollouts_without_tool_calls"] <= 0.25 * row["samples"], row
        assert row["tool_calls_per_rollout"] >= 1.5  # a solving episode makes 3
        assert row["rollout_sandbox_s"] > 0 and row["rollout_generation_s"] > 0
        assert row["r3/replayed_fraction"] == 1.0
    without_calls = sum(row["rollouts_without_tool_calls"] for row in rows)
    assert without_calls <= 0.1 * sum(row["samples"] for row in rows), [row["rollouts_without_tool_calls"] for row in rows]
    report = (run_dir / "report.md").read_text()
    assert "one rollout: sandbox (s), mean" in report and (run_dir / "plots" / "time_split.png").is_file()
    # the workers' warm pools were emptied: no sandbox of a process that is gone appeared during the run
    left = {box.id for box in list_sandboxes(include_bwrap=False) if box.orphan} - before
    assert not left, f"sandboxes left after the run: {left}"
