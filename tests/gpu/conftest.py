"""The GPU tests' pytest hooks: each failure is reported the moment it happens (`tests/early_failures.py`), so a
phase the lent machine's scripts kill at its limit still returns the tracebacks of what failed before."""

from __future__ import annotations

import pytest

from tests.early_failures import write_failure


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed:
        write_failure(report, item.config)
    return report
