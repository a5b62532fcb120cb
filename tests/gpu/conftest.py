"""The GPU tests' pytest hooks: each failure is reported the moment it happens (`tests/early_failures.py`), so a
phase the lent machine's scripts kill at its limit still returns the tracebacks of what failed before."""

from __future__ import annotations

import pytest

from tests.early_failures import write_failure

_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        write_failure(report, _config)
