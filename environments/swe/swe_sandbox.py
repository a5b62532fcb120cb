"""The sandbox the `swe` environment runs commands in, and pytest runs with per-test outcomes.

`open_sandbox(image)` starts a sandbox from a task image through the project's sandbox
layer (`agentrl.sandbox.create_sandbox`: no network, CPU/memory/pids/disk limits, the
non-root sandbox user, commands killed at their timeout) with the repository at /testbed.

`run_pytest` runs test files inside a sandbox with a tiny pytest plugin that writes every
test's outcome (node id -> passed / failed / skipped / error) to a JSON file, so outcomes
do not depend on parsing pytest's console output; in an image with SWE-bench's conda env
`testbed`, that env is activated first.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import AgentrlError
from swe_bench import CONDA_ACTIVATE

__all__ = ["REPORT_PLUGIN", "SANDBOX_ENV", "TestRun", "open_sandbox", "run_pytest", "sandbox_config"]

SANDBOX_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "HOME": "/tmp", "GIT_CONFIG_NOSYSTEM": "1"}


def sandbox_config(image: str, *, cpus: float = 1.0, memory_mb: int = 1024, pids: int = 256,
                   disk_mb: int = 2048, default_timeout_s: float = 120.0, runtime: str = "runc"):
    """The `agentrl.sandbox.SandboxConfig` of a task sandbox: no network, repository at /testbed."""
    from agentrl.sandbox import SandboxConfig

    return SandboxConfig(
        image=image, workdir="/testbed", cpus=cpus, memory_mb=memory_mb, pids_limit=pids, disk_mb=disk_mb,
        exec_timeout_s=default_timeout_s, network=False, runtime=runtime, env=dict(SANDBOX_ENV),
    )


@contextlib.asynccontextmanager
async def open_sandbox(image: str, *, cpus: float = 1.0, memory_mb: int = 1024, pids: int = 256,
                       default_timeout_s: float = 120.0, runtime: str = "runc") -> AsyncIterator[Any]:
    """Start a sandbox from `image` (no network) and destroy it on exit, also on errors."""
    from agentrl.sandbox import SandboxError, create_sandbox

    config = sandbox_config(image, cpus=cpus, memory_mb=memory_mb, pids=pids,
                            default_timeout_s=default_timeout_s, runtime=runtime)
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


REPORT_PLUGIN = '''
"""pytest plugin (written by agentrl's swe environment): per-test outcomes as JSON."""
import json, os
_outcomes = {}
def pytest_runtest_logreport(report):
    previous = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and previous is None:
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and previous is None:
        _outcomes[report.nodeid] = "passed"
def pytest_collectreport(report):
    if report.failed:
        _outcomes[report.nodeid or "<collection>"] = "error"
def pytest_sessionfinish(session, exitstatus):
    with open(os.environ["AGENTRL_SWE_REPORT"], "w") as handle:
        json.dump(_outcomes, handle)
'''

_PLUGIN_DIR = "/tmp/agentrl_swe"
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
