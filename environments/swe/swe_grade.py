"""Grade a repository diff for a `swe` task by running the task's tests in a fresh sandbox.

`grade(instance, diff)` starts a sandbox from the task's image, puts the repository in its
start state (swe_task.prepare_repository), applies the diff with `git apply` (a diff naming a
path in .git or making a symbolic link is refused: swebench's last resort, GNU patch, writes
through either, and a hook set in .git/config would run in the grader's git commands), puts
back any test file (anything in a test folder: helpers too), conftest.py or pytest configuration the
diff touched (the tests decide the
reward, so the diff may not change them or how pytest runs them: pytest.ini, tox.ini and the
like, the pytest section of a setup.cfg or pyproject.toml; new files count whether or not a
.gitignore hides them), applies the
row's test_patch (as SWE-bench does), runs the files holding
FAIL_TO_PASS and PASS_TO_PASS with a timeout as a grader that does not trust the code it
tests (swe_sandbox.run_checked_pytest: the repository after the standard library, a canary
test, the outcomes cross-checked between channels; a disagreement scores 0 and sets
`tamper_suspected`). Rows that carry an `eval_script` (swebench 5) or whose tests are not
pytest node ids (Django's, sympy's) are graded as SWE-bench grades them instead: the eval
script runs in the fresh sandbox and swebench's log parser reads its output
(swe_bench_grade.py); rows without a `bug_patch` get the diff applied as swebench's harness
applies it. The reward
is 1.0 only when the patch applied and every FAIL_TO_PASS and PASS_TO_PASS test passed.
Nothing random is involved (PYTHONHASHSEED is fixed in the images), so the same diff gets
the same reward.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import asdict, dataclass
from typing import Any

from swe_bench import is_swebench_test_path, test_patch_files, uses_eval_script
from swe_bench_grade import apply_like_swebench, eval_report, run_eval_script, swebench_test_spec
from swe_sandbox import open_sandbox, run_checked_pytest
from swe_task import PYTEST_TEST_COMMAND, REPO_DIR, SweInstance, prepare_repository

from agentrl.errors import AgentrlError

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
    tamper_suspected: float = 0.0
    """1.0 when the run's channels disagreed (report file, streamed outcomes, exit status, summary, canary,
    separate collection; swe_verdict.py): the reward is 0."""
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


# Files that change how tests run rather than what they test: shadowing pytest or hooking the interpreter, and
# the configuration files pytest reads (from the test files' folder up) that hold nothing but its settings.
_PROTECTED_NAMES = {"conftest.py", "pytest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini", ".pytest.ini",
                    "pytest.toml", ".pytest.toml", "tox.ini"}
# Configuration files with a pytest section among others: put back when that section changed (`addopts = -p
# a_plugin_in_the_diff` passes whatever it likes where the test command does not pin `-c`).
_SHARED_CONFIGS = ("setup.cfg", "pyproject.toml")
_CONFIG_BYTES = 1 << 20


# Folders of tests: everything in them is the tests' (helpers such as tabulate's test/common.py with its
# assert_equal, an __init__.py, data files), not only the test_*.py files. A diff that made assert_equal a no-op
# was paid 1.0 on 31 of 58 tabulate tasks (red team, 2026-12-07); no task's fix touches such a folder.
_TEST_FOLDERS = {"test", "tests", "testing"}


def _is_test_file(path: str, instance: SweInstance) -> bool:
    name = path.rsplit("/", 1)[-1]
    top = path.split("/", 1)[0]
    folders = path.split("/")[:-1]
    return (path in instance.test_files or name in _PROTECTED_NAMES or top in ("pytest", "_pytest")
            or any(folder in _TEST_FOLDERS or folder.startswith("test_") for folder in folders)
            or (name.startswith("test_") and name.endswith(".py")) or path in test_patch_files(instance.test_patch)
            # SWE-bench rows: every path with `test` or `e2e` in it went into test_patch, never into the gold patch
            or (not instance.bug_patch and is_swebench_test_path(path)))


# Untracked files, ignored ones included (the diff may bring a .gitignore that hides what it adds), sorted.
_UNTRACKED = "git ls-files --others -z | LC_ALL=C sort -z"
_UNTRACKED_BEFORE = "/tmp/agentrl_swe/untracked-before"


async def _note_untracked(sandbox) -> None:
    """Record the start state's untracked files (build output, a venv) before the diff applies."""
    folder = _UNTRACKED_BEFORE.rsplit("/", 1)[0]
    noted = await sandbox.exec(f"set -o pipefail; mkdir -p {folder} && {_UNTRACKED} > {_UNTRACKED_BEFORE}",
                               timeout=60, cwd=REPO_DIR)
    if noted.exit_code != 0:
        raise AgentrlError(f"swe: could not list the untracked files of {REPO_DIR}: {noted.stderr.strip()[:200]}")


async def _revert_test_files(sandbox, instance: SweInstance) -> int:
    """Put back every test file, conftest.py or pytest shadow the diff changed or added (SWE-bench resets test files).

    The tests decide the reward, so a diff may not edit them: changes are undone, new ones removed (also those
    a .gitignore hides: every untracked file not there before the diff counts).
    """
    listing = await sandbox.exec(f"set -o pipefail; git diff --name-only -z HEAD && {_UNTRACKED} | "
                                 f"LC_ALL=C comm -z -13 {_UNTRACKED_BEFORE} -", timeout=60, cwd=REPO_DIR)
    if listing.exit_code != 0 or listing.stdout_truncated:
        raise AgentrlError(f"swe: could not list the files the diff changed: {listing.stderr.strip()[:200]}")
    changed = {path for path in listing.stdout.split("\0") if path}
    touched = sorted({path for path in changed if _is_test_file(path, instance)}
                     | {path for path in changed if await _pytest_section_changed(sandbox, path)})
    for path in touched:
        quoted = shlex.quote(path)
        await sandbox.exec(f"git cat-file -e HEAD:{quoted} 2>/dev/null && git checkout -q HEAD -- {quoted} || rm -f -- {quoted}",
                           timeout=60, cwd=REPO_DIR)
    return len(touched)


def pytest_section(name: str, text: str) -> Any:
    """The pytest settings of a `setup.cfg` (`[tool:pytest]`) or `pyproject.toml` (`[tool.pytest...]`), None when
    there are none; raises ValueError when the file does not parse."""
    if name == "pyproject.toml":
        import tomllib

        try:
            return tomllib.loads(text).get("tool", {}).get("pytest")
        except (tomllib.TOMLDecodeError, AttributeError) as error:
            raise ValueError(str(error)) from None
    import configparser

    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read_string(text)
    except configparser.Error as error:
        raise ValueError(str(error)) from None
    return dict(parser.items("tool:pytest")) if parser.has_section("tool:pytest") else None


async def _pytest_section_changed(sandbox, path: str) -> bool:
    """Whether the diff changed the pytest section of a shared configuration file (`_SHARED_CONFIGS`); a file that
    does not parse, or is too large to check, counts as changed."""
    name = path.rsplit("/", 1)[-1]
    if name not in _SHARED_CONFIGS:
        return False
    quoted = shlex.quote(path)
    before = await sandbox.exec(f"git show HEAD:{quoted} 2>/dev/null | head -c {_CONFIG_BYTES + 1}", timeout=60,
                                cwd=REPO_DIR)
    after = await sandbox.exec(f"head -c {_CONFIG_BYTES + 1} -- {quoted}", timeout=60, cwd=REPO_DIR)
    try:
        if max(len(before.stdout), len(after.stdout)) > _CONFIG_BYTES or after.exit_code != 0:
            return True
        return pytest_section(name, before.stdout) != pytest_section(name, after.stdout)
    except ValueError:
        return True


def grading_spec(instance: SweInstance, *, where: str | None = None) -> Any:
    """swebench's TestSpec for rows graded through an eval script, else None; raises for a row that cannot be graded
    (or when the swebench extra is missing), before any sandbox starts (`where`: the row, in errors)."""
    if not uses_eval_script(instance):
        return None
    return swebench_test_spec(instance, where=where or instance.instance_id)


# Lines of a diff that name a file (git's, unified and context diffs', GNU patch's `Index:`), and git's mode lines
# that make or change a symbolic link.
_DIFF_PATH = re.compile(r"^(?:diff --git|---|\+\+\+|\*\*\*|Index:|(?:rename|copy) (?:from|to)) (.*)$", re.MULTILINE)
_GIT_PART = re.compile(r'(?:^|[\s/"])\.git(?:[\s/"]|$)', re.IGNORECASE)
_SYMLINK_MODE = re.compile(r"^(?:new file mode|new mode|index \S+) 120000\s*$", re.MULTILINE)


def _unsafe_diff(diff: str) -> str:
    """Why `diff` may not be applied ('' when it may): it names a path in .git or makes a symbolic link (GNU patch
    writes through a link into .git, where a hook in .git/config would run in the grader's git commands)."""
    for match in _DIFF_PATH.finditer(diff):
        name = re.sub(r"\\([0-7]{1,3})", lambda code: chr(int(code.group(1), 8)), match.group(1))  # quoted names
        if _GIT_PART.search(name):
            return f"it names a path in .git ({match.group(0)[:100]!r})"
    if _SYMLINK_MODE.search(diff):
        return "it makes or changes a symbolic link"
    return ""


async def _apply_diff(sandbox, instance: SweInstance, diff: str) -> str:
    """Apply the agent's diff; an error message when it does not apply (or may not: `_unsafe_diff`)."""
    unsafe = _unsafe_diff(diff)
    if unsafe:
        return f"patch refused: {unsafe}"
    await sandbox.write_file(_PATCH_PATH, diff if diff.endswith("\n") else diff + "\n")
    if not instance.bug_patch:  # a SWE-bench row: as swebench's harness applies it
        applied, output = await apply_like_swebench(sandbox, _PATCH_PATH)
        return "" if applied else "patch does not apply: " + " ".join(output.split())[:300]
    applied = await sandbox.exec(f"git apply --whitespace=nowarn {_PATCH_PATH}", timeout=60, cwd=REPO_DIR)
    return "" if applied.exit_code == 0 else "patch does not apply: " + " ".join(applied.stderr.split())[:300]


def _report_shares(result: GradeResult, report: dict[str, Any]) -> None:
    """Fill reward and shares from swebench's report."""
    status = report.get("tests_status")
    if status is None:
        result.error = ("the eval script's log holds no test results between SWE-bench's markers "
                        "(the test patch did not apply, or the tests did not run)")
        return
    shares = []
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        success, failure = len(status[key]["success"]), len(status[key]["failure"])
        shares.append(success / (success + failure) if success + failure else 1.0)
    result.fail_to_pass, result.pass_to_pass = shares
    result.reward = 1.0 if report.get("resolved") else 0.0


async def grade_in_sandbox(sandbox, instance: SweInstance, diff: str, *, timeout_s: float = 180.0,
                           spec: Any = None) -> GradeResult:
    """Grade `diff` in a sandbox that is already in the task's start state (`spec`: from `grading_spec`)."""
    if spec is None:
        spec = grading_spec(instance)
    result = GradeResult(empty_patch=float(not diff.strip()))
    await _note_untracked(sandbox)
    if diff.strip():
        result.error = await _apply_diff(sandbox, instance, diff)
        if result.error:
            return result
    result.patch_applied = 1.0
    result.test_files_reverted = float(await _revert_test_files(sandbox, instance))
    if spec is not None:
        log, timed_out = await run_eval_script(sandbox, spec, timeout_s=timeout_s)
        result.timed_out = float(timed_out)
        if timed_out:
            result.error = f"tests timed out after {timeout_s:.0f}s"
        else:
            _report_shares(result, eval_report(spec, log, patch=diff))
        return result
    if instance.test_patch.strip():
        await sandbox.write_file(_TEST_PATCH_PATH, instance.test_patch)
        applied = await sandbox.exec(f"git apply --whitespace=nowarn {_TEST_PATCH_PATH}", timeout=60, cwd=REPO_DIR)
        if applied.exit_code != 0:
            result.error = "test_patch does not apply: " + " ".join(applied.stderr.split())[:300]
            return result
    run = await run_checked_pytest(sandbox, instance.test_files, timeout_s=timeout_s,
                                   test_command=instance.test_command or PYTEST_TEST_COMMAND)
    result.timed_out = float(run.timed_out)
    result.fail_to_pass = _share(instance.FAIL_TO_PASS, run.outcomes)
    result.pass_to_pass = _share(instance.PASS_TO_PASS, run.outcomes)
    result.error = run.error
    if run.problems:
        result.tamper_suspected = 1.0
        result.error = "the test run's channels disagree (tampering suspected): " + "; ".join(run.problems)[:600]
    solved = not result.error and result.fail_to_pass == 1.0 and result.pass_to_pass == 1.0
    result.reward = 1.0 if solved else 0.0
    return result


async def grade(instance: SweInstance, diff: str, *, timeout_s: float = 180.0, cpus: float = 1.0,
                memory_mb: int = 1024, runtime: str = "runc", sandbox_type: str = "docker") -> GradeResult:
    """Grade `diff` in a fresh sandbox started from the task's image.

    A row that cannot be graded at all (no test command for its runner, an unknown log parser, the swebench
    extra missing) raises its one-line error; failures of this one grading run become `GradeResult.error`.
    """
    started = time.monotonic()
    spec = grading_spec(instance)
    try:
        async with open_sandbox(instance.image_name, cpus=cpus, memory_mb=memory_mb, runtime=runtime,
                                sandbox_type=sandbox_type) as sandbox:
            await prepare_repository(sandbox, instance)
            result = await grade_in_sandbox(sandbox, instance, diff, timeout_s=timeout_s, spec=spec)
    except AgentrlError as exc:
        result = GradeResult(error=str(exc))
    result.grade_s = round(time.monotonic() - started, 3)
    return result
