"""SWE-bench rows graded as SWE-bench grades them: image names, non-pytest test ids, eval scripts, swebench's parsers.

The integration tests grade a SWE-bench-format row on a locally built image (agentrl-base plus a tiny
Django-style project whose tests/runtests.py prints Django's test-runner output) through its
`eval_script` and the `swebench` package's Django log parser: the gold patch scores 1, the empty one 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

for _folder in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(_folder) not in sys.path:  # the package's modules and the shared test helpers
        sys.path.insert(0, str(_folder))

import pytest
from swe_bench import build_eval_script, is_pytest_id, swebench_image_name, uses_eval_script
from swe_task import SweInstance
from swe_testlib import (
    DJANGO_FAIL_TO_PASS,
    DJANGO_INSTANCE_ID,
    DJANGO_NAMESPACE,
    DJANGO_PASS_TO_PASS,
    django_row,
)

from agentrl.errors import ConfigError, MissingExtraError
from tests.integration.sandbox_backends import runsc_ok

try:
    import swebench  # noqa: F401

    needs_swebench = pytest.mark.skipif(False, reason="swebench is installed")
except ImportError:
    needs_swebench = pytest.mark.skip(reason="the swebench extra is not installed (pip install 'agentrl[swebench]')")

BASE = "0123456789abcdef0123456789abcdef01234567"
TEST_PATCH = ("diff --git a/tests/auth_tests/test_validators.py b/tests/auth_tests/test_validators.py\n"
              "--- a/tests/auth_tests/test_validators.py\n+++ b/tests/auth_tests/test_validators.py\n"
              "@@ -1 +1,2 @@\n import unittest\n+import re\n")


def _row(**fields) -> dict:
    row = {"instance_id": "django__django-11099", "repo": "django/django", "base_commit": BASE, "patch": "",
           "test_patch": TEST_PATCH, "problem_statement": "bug", "FAIL_TO_PASS": DJANGO_FAIL_TO_PASS,
           "PASS_TO_PASS": DJANGO_PASS_TO_PASS}
    return row | fields


def test_image_names_follow_swebench_or_the_row(monkeypatch):
    assert swebench_image_name("django__django-11099") == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert swebench_image_name("Org__Repo-1", namespace="127.0.0.1:5000/mirror") == \
        "127.0.0.1:5000/mirror/sweb.eval.x86_64.org_1776_repo-1:latest"
    # no namespace: the name swebench's image builder gives a local build (no `_1776_`)
    assert swebench_image_name("django__django-11099", namespace="") == "sweb.eval.x86_64.django__django-11099:latest"
    assert SweInstance.from_row(_row()).image_name == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert SweInstance.from_row(_row(), namespace="mine").image_name == \
        "mine/sweb.eval.x86_64.django_1776_django-11099:latest"
    monkeypatch.setenv("AGENTRL_SWEBENCH_NAMESPACE", "fromenv")
    assert SweInstance.from_row(_row()).image_name.startswith("fromenv/sweb.eval.x86_64.")
    # the row's own image: swebench 5's `image`, or `image_name`, which wins
    assert SweInstance.from_row(_row(image="reg/img:1")).image_name == "reg/img:1"
    assert SweInstance.from_row(_row(image="reg/img:1", image_name="other:2")).image_name == "other:2"


def test_only_pytest_node_ids_name_test_files():
    assert is_pytest_id("tests/test_x.py::TestA::test_b[a b-1]") and is_pytest_id("test_requests.py")
    for name in [*DJANGO_FAIL_TO_PASS, "test_issue_12345", "test_Symbol", "--version is equivalent to version",
                 "test_foo (module.Class.test_foo)", "Regression test for #10348: ChangeList.get_results() ..."]:
        assert not is_pytest_id(name), name
    django = SweInstance.from_row(_row())
    assert django.test_files == [] and uses_eval_script(django)
    pytest_row = SweInstance.from_row(_row(repo="psf/requests", FAIL_TO_PASS=["test_requests.py::test_a"],
                                           PASS_TO_PASS=["test_requests.py::TestB::test_c[x]"]))
    assert pytest_row.test_files == ["test_requests.py"] and not uses_eval_script(pytest_row)
    # the row's own non-pytest runner: never pytest's report plugin
    assert uses_eval_script(pytest_row.model_copy(update={"test_command": "tox -e py --"}))


def test_eval_script_of_an_older_row_runs_the_repos_own_command():
    script = build_eval_script(SweInstance.from_row(_row()))
    test_line = script.split(": '>>>>> Start Test Output'\n")[1].split("\n")[0]
    assert test_line == "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 auth_tests.test_validators"
    assert "source /opt/miniconda3/bin/activate; conda activate testbed" in script
    assert "-c /dev/null" not in script and "agentrl_swe_report" not in script and "-p no:" not in script
    assert script.count(f"git checkout {BASE} -- tests/auth_tests/test_validators.py") == 2
    assert script.index("git apply -v -") < script.index(">>>>> Start Test Output") < script.index(">>>>> End")
    sympy = SweInstance.from_row(_row(repo="sympy/sympy", instance_id="sympy__sympy-20590",
                                      test_patch=TEST_PATCH.replace("tests/auth_tests/test_validators.py",
                                                                    "sympy/core/tests/test_basic.py"),
                                      FAIL_TO_PASS=["test_immutable"], PASS_TO_PASS=["test__aresame"]))
    assert "bin/test -C --verbose sympy/core/tests/test_basic.py\n" in build_eval_script(sympy)
    custom = SweInstance.from_row(_row(repo="me/proj", test_command="python3 -m unittest -v"))
    assert "\npython3 -m unittest -v tests/auth_tests/test_validators.py\n" in build_eval_script(custom)


def test_a_row_nothing_can_run_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"not pytest node ids and the row has no eval_script.*test_command") as error:
        build_eval_script(SweInstance.from_row(_row(repo="me/proj")), where="rows.jsonl:3")
    assert "rows.jsonl:3" in str(error.value) and "\n" not in str(error.value)


@needs_swebench
def test_swebench_parses_the_log_and_decides():
    from swe_bench_grade import eval_report, log_parser_name, swebench_test_spec

    instance = SweInstance.from_row(_row())
    assert log_parser_name(instance) == "parse_log_django"  # swebench's parser for django/django
    for repo, parser in [("sympy/sympy", "parse_log_sympy"), ("astropy/astropy", "parse_log_pytest_v2"),
                         ("chartjs/Chart.js", "parse_log_chart_js"), ("caddyserver/caddy", "parse_log_gotest")]:
        assert log_parser_name(instance.model_copy(update={"repo": repo})) == parser, repo
    chart = instance.model_copy(update={"repo": "chartjs/Chart.js", "eval_script": "echo"})
    assert swebench_test_spec(chart).eval_type == "fail_only"  # swebench grades these repos on failures only
    with pytest.raises(ConfigError, match="swebench has no log parser for repo 'me/proj'; set the row's log_parser"):
        log_parser_name(instance.model_copy(update={"repo": "me/proj"}))
    spec = swebench_test_spec(instance)
    assert "SWEBENCH_TEST_EXIT_CODE=$?" in spec.eval_script  # swebench records the test command's status
    lines = [f"{name} ... ok" for name in DJANGO_PASS_TO_PASS] + [f"{DJANGO_FAIL_TO_PASS[0]} ... ok",
                                                                  f"{DJANGO_FAIL_TO_PASS[1]} ... FAIL"]
    log = "+ : '>>>>> Start Test Output'\n" + "\n".join(lines) + "\n+ : '>>>>> End Test Output'\n"
    report = eval_report(spec, log, patch="diff")
    assert not report["resolved"]
    assert report["tests_status"]["FAIL_TO_PASS"]["failure"] == [DJANGO_FAIL_TO_PASS[1]]
    assert eval_report(spec, log.replace("... FAIL", "... ok"), patch="diff")["resolved"]
    with pytest.raises(ConfigError, match="log_parser 'parse_log_nope' is not one of swebench's parsers"):
        swebench_test_spec(SweInstance.from_row(_row(log_parser="parse_log_nope")))
    with pytest.raises(ConfigError, match="eval_type 'sometimes'"):
        swebench_test_spec(SweInstance.from_row(_row(eval_type="sometimes")))
    assets = '{"test_patch": [{"path": "baseline/expected.png", "url": "https://example.invalid/e.png"}]}'
    with pytest.raises(ConfigError, match="image_assets .* are not supported"):
        swebench_test_spec(SweInstance.from_row(_row(image_assets=assets)))
    swebench_test_spec(SweInstance.from_row(_row(image_assets="{}")))  # rows without assets carry an empty one


def test_without_the_swebench_extra_the_error_names_it(monkeypatch):
    from swe_bench_grade import swebench_test_spec

    monkeypatch.setitem(sys.modules, "swebench", None)  # `import swebench` now raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'agentrl\[swebench\]'"):
        swebench_test_spec(SweInstance.from_row(_row()))


@pytest.fixture(scope="module")
def django_rows() -> dict[str, SweInstance]:
    return {"swebench5": SweInstance.from_row(django_row()),
            "older": SweInstance.from_row(django_row(swebench5=False), namespace=DJANGO_NAMESPACE)}


@needs_swebench
@pytest.mark.integration
@pytest.mark.parametrize("form, runtime", [
    ("swebench5", "runc"), ("older", "runc"),
    pytest.param("swebench5", "runsc", marks=pytest.mark.skipif(not runsc_ok(), reason="gVisor runsc not registered")),
])
async def test_django_row_graded_through_its_eval_script(django_rows, form, runtime):
    from swe_grade import grade

    instance = django_rows[form]
    assert instance.image_name == swebench_image_name(DJANGO_INSTANCE_ID, namespace=DJANGO_NAMESPACE)
    assert bool(instance.eval_script) == (form == "swebench5") and uses_eval_script(instance)
    gold = await grade(instance, instance.patch, runtime=runtime)
    assert (gold.reward, gold.fail_to_pass, gold.pass_to_pass, gold.patch_applied) == (1.0, 1.0, 1.0, 1.0), gold
    empty = await grade(instance, "", runtime=runtime)
    assert (empty.reward, empty.fail_to_pass, empty.pass_to_pass) == (0.0, 0.0, 1.0), empty


@needs_swebench
@pytest.mark.integration
async def test_a_diff_that_fakes_the_runners_output_is_undone(django_rows):
    """The log is the agent's code's output: a diff that makes tests/runtests.py print `... ok` lines would pass
    under any log parser, so (as SWE-bench keeps every path with `test` in it out of gold patches) it is put back."""
    from swe_bench_grade import eval_report, run_eval_script, swebench_test_spec
    from swe_grade import grade
    from swe_sandbox import open_sandbox
    from swe_task import prepare_repository

    instance = django_rows["swebench5"]
    names = DJANGO_FAIL_TO_PASS + DJANGO_PASS_TO_PASS
    fake = "".join(f"    print({name + ' ... ok'!r}, file=sys.stderr)\n" for name in names) + "    sys.exit(0)\n"
    spec = swebench_test_spec(instance)
    async with open_sandbox(instance.image_name) as sandbox:
        await prepare_repository(sandbox, instance)
        runner = await sandbox.read_file("tests/runtests.py")
        anchor = "    args = parser.parse_args()\n"
        await sandbox.write_file("tests/runtests.py", runner.replace(anchor, anchor + fake), mode=0o755)
        hack = (await sandbox.exec("git diff", timeout=60)).stdout
        # the hack works when nothing stops it: swebench's parser reads every test as passed
        log, _ = await run_eval_script(sandbox, spec, timeout_s=120)
        assert eval_report(spec, log, patch=hack)["resolved"]
    result = await grade(instance, hack)
    assert result.patch_applied == 1.0 and result.test_files_reverted == 1.0, result
    assert (result.reward, result.fail_to_pass, result.pass_to_pass) == (0.0, 0.0, 1.0), result


# Run by git's core.fsmonitor in every git command of the grader: once the eval script is written (after the
# test-file revert), the fake runner goes over tests/runtests.py.
FSMONITOR_HOOK = """#!/bin/sh
[ -e /tmp/agentrl_swe/armed ] && exit 1
touch /tmp/agentrl_swe/armed
(while [ ! -e /tmp/agentrl_swe/eval.sh ]; do sleep 0.01; done; cp /testbed/.git/fake_runner.py /testbed/tests/runtests.py) \\
  >/dev/null 2>&1 </dev/null &
exit 1
"""


@needs_swebench
@pytest.mark.integration
async def test_a_diff_that_writes_into_git_is_refused(django_rows):
    """swebench's last resort (GNU patch) writes paths in .git, directly or through a link the diff makes: a hook in
    .git/config would run in the grader's own git commands and swap the test runner after the test-file revert."""
    from swe_grade import grade
    from swe_sandbox import open_sandbox
    from swe_task import prepare_repository

    instance = django_rows["swebench5"]
    names = DJANGO_FAIL_TO_PASS + DJANGO_PASS_TO_PASS
    fake = "".join(f"    print({name + ' ... ok'!r}, file=sys.stderr)\n" for name in names) + "    sys.exit(0)\n"
    async with open_sandbox(instance.image_name) as sandbox:
        await prepare_repository(sandbox, instance)
        runner = await sandbox.read_file("tests/runtests.py")
        anchor = "    args = parser.parse_args()\n"
        await sandbox.write_file("/tmp/new/.git/fake_runner.py", runner.replace(anchor, anchor + fake))
        await sandbox.write_file("/tmp/new/.git/hook.sh", FSMONITOR_HOOK)
        made = await sandbox.exec(
            "mkdir -p /tmp/old/.git && cp .git/config /tmp/old/.git/config && cp .git/config /tmp/new/.git/config && "
            "printf '\\tfsmonitor = sh /testbed/.git/hook.sh\\n' >> /tmp/new/.git/config && cd /tmp && "
            "diff -ruN old new | sed 's#^--- old/#--- a/#; s#^+++ new/#+++ b/#'", timeout=60)
    into_git = made.stdout
    assert "+++ b/.git/config" in into_git
    through_link = ("diff --git a/lnk b/lnk\nnew file mode 120000\n--- /dev/null\n+++ b/lnk\n@@ -0,0 +1 @@\n+.git\n"
                    "\\ No newline at end of file\n" + into_git.replace(" a/.git/", " a/lnk/").replace(" b/.git/", " b/lnk/"))
    for hack in (into_git, through_link):
        result = await grade(instance, hack)
        assert (result.reward, result.patch_applied) == (0.0, 0.0), result
        assert result.error.startswith("patch refused:"), result.error


@needs_swebench
@pytest.mark.integration
async def test_the_agent_works_in_the_images_conda_env(django_rows, tmp_path):
    """The agent's bash runs with the images' conda env `testbed` active (its `python` exists only there)."""
    import json

    import agentrl
    from agentrl.policies import ScriptedPolicy, tool_call
    from agentrl.sampling import SamplingConfig

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(django_row()) + "\n")
    env = agentrl.load_environment("swe", data_path=str(rows), max_turns=3)
    policy = ScriptedPolicy([{"tool_calls": [tool_call("bash", command="echo $CONDA_DEFAULT_ENV; python -c 'print(6 * 7)'")]},
                             {"tool_calls": [tool_call("submit", answer="looked")]}])
    [rollout] = await env.run_group(policy, env.tasks("test")[0], n=1, sampling=SamplingConfig(max_tokens=1000))
    output = next(m.content for m in rollout.messages if m.role == "tool")
    assert "testbed" in output and "42" in output, output
    assert rollout.reward == 0.0 and rollout.metrics["pass_to_pass"] == 1.0
