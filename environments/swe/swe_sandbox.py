"""The sandbox the `swe` environment runs commands in, and pytest runs with per-test outcomes.

`open_sandbox(image)` starts a sandbox from a task image through the project's sandbox
layer (`agentrl.sandbox.create_sandbox`: no network, CPU/memory/pids/disk limits, the
non-root sandbox user, commands killed at their timeout) with the repository at /testbed.

`run_pytest` runs test files inside a sandbox with a tiny pytest plugin that writes every
test's outcome (node id -> passed / failed / skipped / error) to a JSON file, so outcomes
do not depend on parsing pytest's console output; in an image with SWE-bench's conda env
`testbed`, that env is activated first. It trusts the code it tests (task generation).

`run_checked_pytest` is the grader's run, which does not: pytest starts with the repository
after the standard library, a canary test is added, and the outcomes are cross-checked
against the other channels of the run (swe_verdict.py); background processes are killed
before anything is read.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from swe_bench import CONDA_ACTIVATE
from swe_verdict import (
    LAUNCHER,
    LAUNCHER_PATH,
    PLUGIN_DIR,
    REPORT_PLUGIN,
    Evidence,
    canary_test,
    check_verdict,
    collected_ids,
    launch_env,
    safe_pytest_command,
    stream_calls,
    stream_outcomes,
    summary_counts,
)

from agentrl.errors import AgentrlError, ProcessesSurvived

__all__ = ["SANDBOX_ENV", "TestRun", "open_sandbox", "run_checked_pytest", "run_pytest", "sandbox_config"]

SANDBOX_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "HOME": "/tmp", "GIT_CONFIG_NOSYSTEM": "1"}


def sandbox_config(image: str, *, cpus: float = 1.0, memory_mb: int = 1024, pids: int = 256,
                   disk_mb: int = 2048, default_timeout_s: float = 120.0, runtime: str = "runc",
                   sandbox_type: str = "docker"):
    """The `agentrl.sandbox.SandboxConfig` of a task sandbox: no network, repository at /testbed (`sandbox_type`
    'bwrap': the image's exported tree under bubblewrap)."""
    from agentrl.sandbox import SandboxConfig

    return SandboxConfig(
        type=sandbox_type, image=image, workdir="/testbed", cpus=cpus, memory_mb=memory_mb, pids_limit=pids,
        disk_mb=disk_mb,
        exec_timeout_s=default_timeout_s, network=False, runtime=runtime, env=dict(SANDBOX_ENV),
    )


@contextlib.asynccontextmanager
async def open_sandbox(image: str, *, cpus: float = 1.0, memory_mb: int = 1024, pids: int = 256,
                       default_timeout_s: float = 120.0, runtime: str = "runc",
                       sandbox_type: str = "docker") -> AsyncIterator[Any]:
    """Start a sandbox from `image` (no network) and destroy it on exit, also on errors."""
    from agentrl.sandbox import SandboxError, create_sandbox

    config = sandbox_config(image, cpus=cpus, memory_mb=memory_mb, pids=pids,
                            default_timeout_s=default_timeout_s, runtime=runtime, sandbox_type=sandbox_type)
    sandbox = create_sandbox(config)
    try:
        await sandbox.start()
    except SandboxError as exc:
        hint = " (build it with 'python3 environments/swe/swe_images.py')" if "not in the local" in str(exc) else ""
        raise AgentrlError(f"swe: {exc}{hint}") from None
    try:
        yield sandbox
    finally:
        await sandbox.close()


_PLUGIN_DIR = PLUGIN_DIR
_REPORT_PATH = "/tmp/agentrl_swe/report.json"


@dataclass
class TestRun:
    """Outcome of one pytest run: per node id 'passed', 'failed', 'skipped' or 'error'."""

    __test__ = False  # not a pytest test class

    outcomes: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False
    exit_code: int = 0
    output: str = ""

    def passed(self, node_id: str) -> bool:
        return self.outcomes.get(node_id) == "passed"


async def run_pytest(sandbox, test_files: list[str], *, timeout_s: float = 120.0,
                     test_command: str = "python3 -m pytest -c /dev/null --rootdir /testbed",
                     cwd: str = "/testbed") -> TestRun:
    """Run pytest on `test_files` in the sandbox and return every test's outcome."""
    await sandbox.write_file(f"{_PLUGIN_DIR}/agentrl_swe_report.py", REPORT_PLUGIN)
    files = " ".join(shlex.quote(path) for path in sorted(set(test_files)))
    command = (
        f"{CONDA_ACTIVATE}; rm -f {_REPORT_PATH}; "
        f"PYTHONPATH={_PLUGIN_DIR}:$PYTHONPATH AGENTRL_SWE_REPORT={_REPORT_PATH} "
        f"{test_command} -p agentrl_swe_report -p no:cacheprovider -q --tb=short -W ignore {files}"
    )
    result = await sandbox.exec(command, timeout=timeout_s, cwd=cwd)
    run = TestRun(timed_out=result.timed_out, exit_code=result.exit_code, output=result.stdout + result.stderr)
    if not result.timed_out:
        try:
            run.outcomes = json.loads(await sandbox.read_file(_REPORT_PATH))
        except (AgentrlError, FileNotFoundError, json.JSONDecodeError):
            run.outcomes = {}
    return run


@dataclass
class CheckedRun(TestRun):
    """A grading pytest run: outcomes plus the disagreements between its channels (`problems`) and why it did not
    complete (`error`: timed out, crashed, could not start)."""

    problems: list[str] = field(default_factory=list)
    error: str = ""


# Files whose content decides how the tests run; fingerprinted around the run (a change during it is tampering).
_FINGERPRINT = ("find . -path ./.git -prune -o \\( -name conftest.py -o -name pytest.ini -o -name '*.pth' "
                "-o -name sitecustomize.py \\) -print | LC_ALL=C sort | xargs -r sha256sum; sha256sum -- ")


async def _write_grader_files(sandbox) -> None:
    await sandbox.write_file(f"{_PLUGIN_DIR}/agentrl_swe_report.py", REPORT_PLUGIN)
    await sandbox.write_file(LAUNCHER_PATH, LAUNCHER)


async def run_checked_pytest(sandbox, test_files: list[str], *, test_command: str, timeout_s: float = 120.0,
                             cwd: str = "/testbed") -> CheckedRun:
    """Run `test_files` as the grader: safe start-up, a canary, outcomes cross-checked (swe_verdict.py).

    The agent's processes must already be gone (a fresh sandbox). The repository's `.git` is moved out of the
    tree while the tests run (nothing there tells the canary apart); the sandbox is not reusable afterwards.
    """
    launcher = safe_pytest_command(test_command)
    if launcher is None:
        return CheckedRun(error=f"test_command {test_command!r} does not start pytest as `python -m pytest` "
                                "or `pytest`; the grader cannot start it safely")
    files = sorted(set(test_files))
    canary = canary_test(files[0])
    token = secrets.token_hex(8)
    report = f"{_PLUGIN_DIR}/report-{secrets.token_hex(6)}.json"
    quoted = " ".join(shlex.quote(path) for path in files)
    hidden_git = f"{_PLUGIN_DIR}/git-{secrets.token_hex(6)}"
    appended = await sandbox.exec(["/bin/sh", "-c", 'cat >> "$1" && mv .git "$2"', "sh", canary.path, hidden_git],
                                  stdin=canary.source, timeout=60, cwd=cwd)
    if appended.exit_code != 0:
        return CheckedRun(error=f"could not add the canary test to {canary.path}: {appended.stderr.strip()[:200]}")
    fingerprint = _FINGERPRINT + quoted
    before = await sandbox.exec(fingerprint, timeout=60, cwd=cwd)
    await _write_grader_files(sandbox)
    options = f"-p agentrl_swe_report -p no:cacheprovider -q --tb=line -W ignore {quoted}"
    result = await sandbox.exec(f"{CONDA_ACTIVATE}; {launch_env(report, token)} {launcher} {options}",
                                timeout=timeout_s, cwd=cwd)
    outlived = await _kill(sandbox)  # a process the tests left cannot rewrite anything from here on
    run = CheckedRun(timed_out=result.timed_out, exit_code=result.exit_code, output=result.stdout + result.stderr)
    streamed = stream_outcomes(result.stderr, token)
    run.outcomes = streamed or {}
    if result.timed_out:
        run.error = f"tests timed out after {timeout_s:.0f}s"
        return run
    if result.exit_code not in (0, 1) or result.stdout_truncated or result.stderr_truncated:
        why = "its output was cut at the sandbox's cap" if result.exit_code in (0, 1) else \
            f"pytest exited {result.exit_code}"
        run.error = f"the tests did not complete: {why}: {' '.join(result.stdout.split()[-30:])[:300]}"
        return run
    after = await sandbox.exec(fingerprint, timeout=60, cwd=cwd)
    try:
        written = json.loads(await sandbox.read_file(report))
    except (AgentrlError, json.JSONDecodeError):
        written = None
    await _write_grader_files(sandbox)  # what the test run may have changed there is not used again
    collect = await sandbox.exec(f"{CONDA_ACTIVATE}; {launcher} --collect-only -q -p no:cacheprovider -W ignore "
                                 f"{quoted}", timeout=timeout_s, cwd=cwd)
    outlived += await _kill(sandbox)
    evidence = Evidence(exit_code=result.exit_code, report=written, streamed=streamed,
                        summary=summary_counts(result.stdout), canary=canary.node_id,
                        calls=stream_calls(result.stderr, token),
                        collected=collected_ids(collect.stdout) if collect.exit_code == 0 else None)
    run.problems = check_verdict(evidence)
    if outlived:
        run.problems.append(f"{outlived} processes the tests started outlived the kill")
    if before.stdout != after.stdout or before.exit_code != 0:
        run.problems.append("the test files or conftest.py files changed while the tests ran")
    run.outcomes.pop(canary.node_id, None)
    return run


async def _kill(sandbox) -> int:
    """Kill what the tests left; how many processes outlived the kill (forks outpacing it: tampering)."""
    try:
        await sandbox.kill_processes()
    except ProcessesSurvived as error:
        return error.count
    return 0
