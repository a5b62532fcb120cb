"""swe grading in real Docker sandboxes: gold 1.0, empty 0.0, wrong 0.0, reproducible.

Runs on a fixed sample of committed rows from the two fastest projects; the session
builds their images (cached by content) on the local agentrl-base:bookworm image.
"""

from __future__ import annotations

import sys
from pathlib import Path

for _folder in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(_folder) not in sys.path:  # the package's modules and the shared test helpers
        sys.path.insert(0, str(_folder))

import pytest
from swe_grade import grade
from swe_sandbox import open_sandbox
from swe_task import SweInstance, prepare_repository
from swe_testlib import build_sample_images, sample_rows

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def instances() -> list[SweInstance]:
    build_sample_images()
    return [SweInstance.from_row(row) for row in sample_rows()]


async def _edited_diff(instance: SweInstance, script: str) -> str:
    """The diff a bash script makes in the task's start state."""
    async with open_sandbox(instance.image_name) as sandbox:
        await prepare_repository(sandbox, instance)
        result = await sandbox.exec(f"{script} && git diff", timeout=60)
        assert result.exit_code == 0, result.stderr
        return result.stdout


async def test_gold_patch_scores_one_and_is_reproducible(instances):
    for instance in instances:
        first = await grade(instance, instance.patch)
        assert (first.reward, first.fail_to_pass, first.pass_to_pass, first.patch_applied) == (1.0, 1.0, 1.0, 1.0), first
        again = await grade(instance, instance.patch)
        assert again.metrics() | {"grade_s": 0} == first.metrics() | {"grade_s": 0}


async def test_empty_diff_scores_zero(instances):
    for instance in instances:
        result = await grade(instance, "")
        assert result.reward == 0.0 and result.empty_patch == 1.0 and result.patch_applied == 1.0
        assert result.fail_to_pass == 0.0 and result.pass_to_pass == 1.0


async def test_wrong_patch_that_applies_scores_zero(instances):
    for instance in instances:
        path = instance.patch.split("\n", 1)[0].split(" b/")[-1]
        wrong = await _edited_diff(instance, f"printf '\\n# looked into this\\n' >> {path}")
        assert wrong.strip()
        result = await grade(instance, wrong)
        assert result.patch_applied == 1.0 and result.empty_patch == 0.0
        assert result.reward == 0.0 and result.fail_to_pass < 1.0


async def test_patch_that_does_not_apply_scores_zero(instances):
    instance = instances[0]
    result = await grade(instance, instance.bug_patch)  # re-injecting the bug cannot apply to the buggy tree
    assert result.reward == 0.0 and result.patch_applied == 0.0 and "does not apply" in result.error


async def test_breaking_other_tests_scores_zero(instances):
    instance = instances[0]
    path = instance.patch.split("\n", 1)[0].split(" b/")[-1]
    broken = await _edited_diff(
        instance, f"git apply - <<'EOF'\n{instance.patch}EOF\nprintf '\\nimport sys; sys.exit(3)\\n' >> {path}")
    result = await grade(instance, broken)
    assert result.patch_applied == 1.0 and result.reward == 0.0 and result.pass_to_pass < 1.0


async def test_missing_image_is_a_clear_error(instances):
    instance = instances[0].model_copy(update={"image_name": "agentrl-swe/does-not-exist:0"})
    result = await grade(instance, instance.patch)
    assert result.reward == 0.0 and "does-not-exist" in result.error and "\n" not in result.error


FORCE_PASS_CONFTEST = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
'''


async def test_diffs_that_edit_the_tests_are_undone_before_grading(instances):
    from swe_sandbox import run_pytest

    instance = instances[0]
    first_test_file = instance.FAIL_TO_PASS[0].split("::")[0]
    script = (f"cat > conftest.py <<'EOF'\n{FORCE_PASS_CONFTEST}EOF\n"
              f"printf '\\ndef test_extra():\\n    pass\\n' >> {first_test_file} && git add -A")
    async with open_sandbox(instance.image_name) as sandbox:
        await prepare_repository(sandbox, instance)
        result = await sandbox.exec(f"{script} && git diff --cached", timeout=60)
        gamed = result.stdout
        # the hack works when nothing stops it: every FAIL_TO_PASS test reports passed
        run = await run_pytest(sandbox, instance.test_files)
        assert all(run.passed(node) for node in instance.FAIL_TO_PASS)
    result = await grade(instance, gamed)
    assert result.patch_applied == 1.0 and result.test_files_reverted == 2.0
    assert result.reward == 0.0 and result.fail_to_pass == 0.0


async def test_a_diff_that_edits_the_test_folders_helpers_is_undone(instances):
    """Not only test_*.py: a helper module of the test folder (tabulate's test/common.py holds assert_equal; a diff
    that made it a no-op was paid 1.0 on 31 of 58 tabulate tasks, red team 2026-12-07), an __init__.py, data. The
    fix itself still counts: the gold patch with such edits scores 1, the edits alone 0, each put back."""
    instance = next(item for item in instances if item.FAIL_TO_PASS[0].startswith("tests/"))
    helpers = ("printf 'def assert_equal(*args):\\n    pass\\n' > tests/common.py && "
               "printf '\\nimport os\\n' >> tests/__init__.py && git add -A")
    async with open_sandbox(instance.image_name) as sandbox:
        await prepare_repository(sandbox, instance)
        edited = await sandbox.exec(f"{helpers} && git diff --cached", timeout=60)
        assert edited.exit_code == 0 and "tests/common.py" in edited.stdout, edited.stderr
        await sandbox.write_file("/tmp/gold.patch", instance.patch)
        both = await sandbox.exec("git apply /tmp/gold.patch && git add -A && git diff --cached", timeout=60)
        assert both.exit_code == 0, both.stderr
    result = await grade(instance, edited.stdout)
    assert (result.reward, result.test_files_reverted) == (0.0, 2.0), result
    fixed = await grade(instance, both.stdout)
    assert (fixed.reward, fixed.test_files_reverted) == (1.0, 2.0), fixed


async def test_swe_bench_style_row_with_test_patch_is_graded_through_the_same_code():
    """A row as SWE-bench publishes it: no bug patch, the image already at base_commit, the new
    test arriving in test_patch, FAIL_TO_PASS / PASS_TO_PASS as JSON strings."""
    import json

    build_sample_images()
    image = "agentrl-swe/inflection:0.5.1"
    async with open_sandbox(image) as sandbox:
        head = (await sandbox.exec("git rev-parse HEAD", timeout=30)).stdout.strip()
        await sandbox.exec("printf '\\n\\ndef shout(word):\\n    return word.upper() + \"!\"\\n' >> inflection/__init__.py", timeout=30)
        gold = (await sandbox.exec("git diff", timeout=30)).stdout
        await sandbox.exec("git checkout -q -- . && printf 'import inflection\\n\\n\\ndef test_shout():\\n"
                           "    assert inflection.shout(\"hi\") == \"HI!\"\\n' > test_shout.py && git add -N test_shout.py",
                           timeout=30)
        test_patch = (await sandbox.exec("git diff", timeout=30)).stdout
    assert "def shout" in gold and "test_shout.py" in test_patch
    row = {
        "instance_id": "jpvanhal__inflection-1", "repo": "jpvanhal/inflection", "version": "0.5.1",
        "base_commit": head, "patch": gold, "test_patch": test_patch, "image_name": image,
        "problem_statement": "Add inflection.shout(word): the word in capitals followed by '!'.",
        "FAIL_TO_PASS": json.dumps(["test_shout.py::test_shout"]),
        "PASS_TO_PASS": json.dumps(["test_inflection.py::test_titleize[Action web service-Action Web Service]"]),
    }
    instance = SweInstance.from_row(row)
    solved = await grade(instance, instance.patch)
    assert solved.reward == 1.0 and solved.fail_to_pass == 1.0 and solved.pass_to_pass == 1.0, solved
    unsolved = await grade(instance, "")
    assert unsolved.reward == 0.0 and unsolved.fail_to_pass == 0.0 and unsolved.pass_to_pass == 1.0
    elsewhere = await grade(instance.model_copy(update={"base_commit": "0" * 40}), instance.patch)
    assert elsewhere.reward == 0.0 and "lacks base_commit 000000000000" in elsewhere.error


async def test_swe_bench_pytest_row_runs_under_the_repos_own_pytest_config():
    """pytest rows of SWE-bench run under the repo's config (no `-c /dev/null`): here the repo's pytest.ini
    makes `check_*` functions tests, so the FAIL_TO_PASS test exists only under it."""
    import json

    from swe_task import GENERATED_TEST_COMMAND

    build_sample_images()
    image = "agentrl-swe/inflection:0.5.1"
    async with open_sandbox(image) as sandbox:
        head = (await sandbox.exec("git rev-parse HEAD", timeout=30)).stdout.strip()
        await sandbox.exec("printf '\\n\\ndef shout(word):\\n    return word.upper() + \"!\"\\n' >> inflection/__init__.py",
                           timeout=30)
        gold = (await sandbox.exec("git diff", timeout=30)).stdout
        await sandbox.exec("git checkout -q -- . && printf '[pytest]\\npython_functions = check_* test_*\\n' > pytest.ini"
                           " && printf 'import inflection\\n\\n\\ndef check_shout():\\n"
                           "    assert inflection.shout(\"hi\") == \"HI!\"\\n' > test_shout.py && git add -N .",
                           timeout=30)
        test_patch = (await sandbox.exec("git diff", timeout=30)).stdout
    row = {"instance_id": "jpvanhal__inflection-2", "repo": "jpvanhal/inflection", "base_commit": head, "patch": gold,
           "test_patch": test_patch, "image_name": image, "problem_statement": "Add inflection.shout(word).",
           "FAIL_TO_PASS": json.dumps(["test_shout.py::check_shout"]), "PASS_TO_PASS": "[]"}
    instance = SweInstance.from_row(row)
    assert (await grade(instance, instance.patch)).reward == 1.0
    assert (await grade(instance, "")).reward == 0.0
    # the same row with the repo's config dropped: check_shout is no test, so even the gold patch fails
    dropped = await grade(instance.model_copy(update={"test_command": GENERATED_TEST_COMMAND}), instance.patch)
    assert dropped.reward == 0.0 and dropped.fail_to_pass == 0.0
