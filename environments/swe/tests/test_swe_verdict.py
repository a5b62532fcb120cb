"""swe_verdict's checks on their own: what an honest run leaves on each channel passes, each forgery is named."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swe_verdict import Evidence, check_verdict, collected_ids, safe_pytest_command, summary_counts  # noqa: E402

CANARY = "tests/test_x.py::TestOrder::test_order_value_abc123"


def honest(**changes) -> Evidence:
    outcomes = {"tests/test_x.py::test_a": "passed", "tests/test_x.py::test_b": "failed", CANARY: "failed"}
    calls = {"tests/test_x.py::test_a": "returned", "tests/test_x.py::test_b": "raised", CANARY: "raised"}
    fields = {"exit_code": 1, "report": dict(outcomes), "streamed": dict(outcomes), "calls": calls,
              "summary": {"failed": 2, "passed": 1}, "collected": set(outcomes), "canary": CANARY}
    return Evidence(**(fields | changes))


def test_an_honest_run_agrees_on_every_channel():
    assert check_verdict(honest()) == []


def test_each_forgery_is_named():
    all_passed = {"tests/test_x.py::test_a": "passed", "tests/test_x.py::test_b": "passed", CANARY: "passed"}
    assert any("differs from the streamed" in p for p in check_verdict(honest(report=all_passed)))
    assert any("exited 0" in p for p in check_verdict(honest(exit_code=0)))
    assert any("canary" in p for p in check_verdict(honest(report=all_passed, streamed=all_passed)))
    assert any("summary counts 1" in p for p in check_verdict(honest(
        report={**honest().report, "tests/test_x.py::test_b": "passed"},
        streamed={**honest().streamed, "tests/test_x.py::test_b": "passed"})))
    assert any("never collected" in p for p in check_verdict(honest(collected={CANARY, "tests/test_x.py::test_b"})))
    assert any("no summary line" in p for p in check_verdict(honest(summary=None)))
    assert any("collection run failed" in p for p in check_verdict(honest(collected=None)))
    # a patched TestReport: test_b's report says passed on every channel, pytest's summary too, but its call raised
    forged = {**honest().streamed, "tests/test_x.py::test_b": "passed"}
    problems = check_verdict(honest(report=forged, streamed=forged, summary={"failed": 1, "passed": 2}))
    assert problems == ["1 tests reported passed although their call raised or never ran: "
                        "['tests/test_x.py::test_b']"], problems
    assert any("calls are malformed" in p for p in check_verdict(honest(calls=None)))


def test_pytest_output_is_read():
    assert summary_counts("...\n1 failed, 12 passed, 2 warnings in 0.31s\n") == {"failed": 1, "passed": 12,
                                                                                "warning": 2}
    assert summary_counts("===== 3 errors, 1 xpassed in 1.00s =====") == {"error": 3, "xpassed": 1}
    assert summary_counts("no summary here") is None
    assert collected_ids("tests/a.py::t1\ntests/a.py::C::t2[x]\n\n2 tests collected in 0.01s\n") == {
        "tests/a.py::t1", "tests/a.py::C::t2[x]"}


def test_test_commands_start_through_the_launcher_or_are_refused():
    command = safe_pytest_command("python3 -m pytest -c /dev/null --rootdir /testbed")
    assert command.startswith('AGENTRL_SWE_PATH="$PYTHONPATH" PYTHONPATH= python3 -s /tmp/agentrl_swe/run_pytest.py')
    assert command.endswith("--import-mode=append -c /dev/null --rootdir /testbed")
    assert safe_pytest_command("X=1 pytest --import-mode=prepend -rA").endswith(" --import-mode=prepend -rA")
    assert safe_pytest_command("./tests/runtests.py --parallel 1") is None
