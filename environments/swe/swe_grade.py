"""Grade a repository diff for a `swe` task by running the task's tests in a fresh sandbox.

`grade(instance, diff)` starts a sandbox from the task's image, puts the repository in its
start state (swe_task.prepare_repository), applies the diff with `git apply`, puts back any
test file or conftest.py the diff touched (the tests decide the reward, so the diff may not
change them), applies the row's test_patch (as SWE-bench does), runs the files holding
FAIL_TO_PASS and PASS_TO_PASS with a timeout, and reads every test's outcome from the
pytest report plugin. The reward
is 1.0 only when the patch applied and every FAIL_TO_PASS and PASS_TO_PASS test passed.
Nothing random is involved (PYTHONHASHSEED is fixed in the images), so the same diff gets
the same reward.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import asdict, dataclass

from agentrl.errors import AgentrlError
from swe_sandbox import open_sandbox, run_pytest
from swe_task import REPO_DIR, SweInstance, prepare_repository

__all__ = ["GradeResult", "grade", "grade_in_sandbox"]

_PATCH_PATH = "/tmp/agentrl_swe/agent.patch"
_TEST_PATCH_PATH = "/tmp/agentrl_swe/test.patch"


@dataclass
class GradeResult:
    """The reward and the metrics behind it."""

    reward: float = 0.0
    fail_to_pass: float = 0.0
    """Share of FAIL_TO_PASS tests that pass."""
    pass_to_pass: float = 0.0
    """Share of PASS_TO_PASS tests that pass."""
    patch_applied: float = 0.0
    """1.0 when the diff applied cleanly (an empty diff applies)."""
    empty_patch: float = 0.0
    """1.0 when the diff was empty."""
    timed_out: float = 0.0
    """1.0 when the test run hit its timeout."""
    test_files_reverted: float = 0.0
    """How many test files or conftest.py files the diff touched (they are put back before the run)."""
    grade_s: float = 0.0
    """Wall-clock seconds the grading took."""
    error: str = ""
    """Why grading could not run the tests (patch rejected, sandbox failure)."""

    def metrics(self) -> dict[str, float]:
        """Every numeric field, for Rollout.metrics."""
        return {key: float(value) for key, value in asdict(self).items() if key not in ("error",)}


def _share(tests: list[str], outcomes: dict[str, str]) -> float:
    if not tests:
        return 1.0
    return sum(1 for node in tests if outcomes.get(node) == "passed") / len(tests)


# Files that change how tests run rather than what they test: shadowing pytest or hooking the interpreter.
_PROTECTED_NAMES = {"conftest.py", "pytest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini"}


def _is_test_file(path: str, instance: SweInstance) -> bool:
    name = path.rsplit("/", 1)[-1]
    top = path.split("/", 1)[0]
    return (path in instance.test_files or name in _PROTECTED_NAMES or top in ("pytest", "_pytest")
            or (name.startswith("test_") and name.endswith(".py")))


async def _revert_test_files(sandbox, instance: SweInstance) -> int:
    """Put back every test file, conftest.py or pytest shadow the diff changed or added (SWE-bench resets test files).

    The tests decide the reward, so a diff may not edit them: changes are undone, new ones removed.
    """
    listing = await sandbox.exec("git diff --name-only HEAD; git ls-files --others --exclude-standard",
                                 timeout=60, cwd=REPO_DIR)
    touched = sorted({path for path in listing.stdout.splitlines() if path and _is_test_file(path, instance)})
    for path in touched:
        quoted = shlex.quote(path)
        await sandbox.exec(f"git cat-file -e HEAD:{quoted} 2>/dev/null && git checkout -q HEAD -- {quoted} || rm -f -- {quoted}",
                           timeout=60, cwd=REPO_DIR)
    return len(touched)


async def grade_in_sandbox(sandbox, instance: SweInstance, diff: str, *, timeout_s: float = 180.0) -> GradeResult:
    """Grade `diff` in a sandbox that is already in the task's start state."""
    result = GradeResult(empty_patch=float(not diff.strip()))
    if diff.strip():
        await sandbox.write_file(_PATCH_PATH, diff if diff.endswith("\n") else diff + "\n")
        applied = await sandbox.exec(f"git apply --whitespace=nowarn {_PATCH_PATH}", timeout=60, cwd=REPO_DIR)
        if applied.exit_code != 0:
            result.error = "patch does not apply: " + " ".join(applied.stderr.split())[:300]
            return result
    result.patch_applied = 1.0
    result.test_files_reverted = float(await _revert_test_files(sandbox, instance))
    if instance.test_patch.strip():
        await sandbox.write_file(_TEST_PATCH_PATH, instance.test_patch)
        applied = await sandbox.exec(f"git apply --whitespace=nowarn {_TEST_PATCH_PATH}", timeout=60, cwd=REPO_DIR)
        if applied.exit_code != 0:
            result.error = "test_patch does not apply: " + " ".join(applied.stderr.split())[:300]
            return result
    run = await run_pytest(sandbox, instance.test_files, timeout_s=timeout_s, test_command=instance.test_command)
    result.timed_out = float(run.timed_out)
    result.fail_to_pass = _share(instance.FAIL_TO_PASS, run.outcomes)
    result.pass_to_pass = _share(instance.PASS_TO_PASS, run.outcomes)
    if run.timed_out:
        result.error = f"tests timed out after {timeout_s:.0f}s"
    solved = not run.timed_out and result.fail_to_pass == 1.0 and result.pass_to_pass == 1.0
    result.reward = 1.0 if solved else 0.0
    return result


async def grade(instance: SweInstance, diff: str, *, timeout_s: float = 180.0, cpus: float = 1.0,
                memory_mb: int = 1024, runtime: str = "runc") -> GradeResult:
    """Grade `diff` in a fresh sandbox started from the task's image."""
    started = time.monotonic()
    try:
        async with open_sandbox(instance.image_name, cpus=cpus, memory_mb=memory_mb, runtime=runtime) as sandbox:
            await prepare_repository(sandbox, instance)
            result = await grade_in_sandbox(sandbox, instance, diff, timeout_s=timeout_s)
    except AgentrlError as exc:
        result = GradeResult(error=str(exc))
    result.grade_s = round(time.monotonic() - started, 3)
    return result
