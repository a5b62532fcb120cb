"""report.md's held-out table names each evaluation by the steps its weights had, as the console and the
checkpoints do.

An evaluation that starts after step index 19 evaluates the weights of 20 steps (version 20, checkpoint
`step_20`); the console printed "held-out after step 20" while report.md said 19.
"""

from __future__ import annotations

from agentrl.rl.report import write_report


def test_the_held_out_table_counts_steps_as_the_console_and_checkpoints_do(tmp_path):
    rows = [{"step": step, "reward": 0.5} for step in range(40)]
    for row, mean in ((rows[19], 0.61), (rows[39], 0.72)):
        row.update({"eval/step": row["step"], "eval/mean_reward": mean, "eval/mean_reward_low": mean - 0.05,
                    "eval/mean_reward_high": mean + 0.05, "eval/tasks": 64, "eval/avg@4": mean})
    report = write_report(rows, tmp_path / "report.md", title="run").read_text()
    assert "| 20 | 64 | 0.610 (0.560-0.660) | 0.610 |" in report, report
    assert "| 40 | 64 | 0.720 (0.670-0.770) | 0.720 |" in report, report
    assert not any(line.startswith(("| 19 ", "| 39 ")) for line in report.splitlines()), report
