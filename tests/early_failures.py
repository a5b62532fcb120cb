"""Reports each test failure the moment it happens, not at the end of the session.

The GPU tests run on a lent machine under a phase timeout (`scripts/gpu_check.sh`, `scripts/gpu_run.sh`). pytest
prints tracebacks only in its final summary, so a phase killed at its limit returned an `F` and nothing else: on
2026-12-06 the H100 run of `tests/gpu` lost why the gate-weights test and both KV-offload tests failed.
`tests/gpu/conftest.py` calls `write_failure` from its `pytest_runtest_makereport` (so for the GPU tests alone):
every failed setup, call or teardown writes its node id, phase, duration and traceback to the terminal at once
and, where `AGENTRL_FAILURES_FILE` names a file (the GPU scripts point it into `$OUT`, whose files come back even
when the command is killed), appends the same text there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl import env_vars


def failure_text(report: pytest.TestReport) -> str:
    """The block written for one failed report: a header line, then pytest's own traceback text."""
    return f"=== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n"


def write_failure(report: pytest.TestReport, config: pytest.Config) -> None:
    """Write `report`'s failure to the terminal (flushed) and to `$AGENTRL_FAILURES_FILE` when it is set."""
    text = failure_text(report)
    terminal = config.pluginmanager.get_plugin("terminalreporter")  # absent under -p no:terminal
    if terminal is not None:
        terminal.write("\n" + text, flush=True)
    target = env_vars.FAILURES_FILE.get()
    if target:
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
