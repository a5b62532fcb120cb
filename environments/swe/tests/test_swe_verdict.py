"""swe_verdict's checks on their own: what an honest run leaves on each channel passes, each forgery is named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


SAMPLE_TESTS = '''import unittest


def test_pass():
    assert True


def test_fail():
    assert False


class TestU(unittest.TestCase):
    def test_u_fail(self):
        self.assertEqual(1, 2)

    def test_u_pass(self):
        self.assertEqual(1, 1)
'''


def _plugin_run(tmp_path, *extra: str):
    """The report plugin in a real pytest run of SAMPLE_TESTS here (the host's pytest): its two streams."""
    from swe_verdict import REPORT_PLUGIN, stream_calls, stream_outcomes

    (tmp_path / "agentrl_swe_report.py").write_text(REPORT_PLUGIN)
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    env = {**os.environ, "AGENTRL_SWE_REPORT": str(tmp_path / "report.json"),
           "AGENTRL_SWE_TOKEN": "tok123", "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "agentrl_swe_report", "-p", "no:cacheprovider",
                             *extra, "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    return stream_outcomes(result.stderr, "tok123"), stream_calls(result.stderr, "tok123")


EXPECTED_CALLS = {"test_sample.py::test_pass": "returned", "test_sample.py::test_fail": "raised",
                  "test_sample.py::TestU::test_u_pass": "returned", "test_sample.py::TestU::test_u_fail": "raised"}


def test_the_plugin_streams_how_each_call_ended(tmp_path):
    """A failing unittest test keeps its failure on the item instead of raising: still 'raised'."""
    outcomes, calls = _plugin_run(tmp_path)
    assert calls == EXPECTED_CALLS
    assert outcomes == {
        node: "passed" if ended == "returned" else "failed" for node, ended in EXPECTED_CALLS.items()}


def test_the_plugin_hands_its_token_to_xdist_workers(tmp_path):
    """With pytest-xdist the calls run in workers, which start without the token in their environment."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed here")
    _, calls = _plugin_run(tmp_path, "-n", "2")
    assert calls == EXPECTED_CALLS
