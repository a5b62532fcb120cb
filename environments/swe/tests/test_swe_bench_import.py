"""`agentrl env import swebench`: SWE-bench rows (a jsonl, or a folder written by datasets' save_to_disk) become a
package; its tasks run through the real tool loop in Docker sandboxes and are graded through the row's eval script
and swebench's Django log parser (oracle 1, do-nothing 0)."""

from __future__ import annotations

import sys
from pathlib import Path

for _folder in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(_folder) not in sys.path:  # the package's modules and the shared test helpers
        sys.path.insert(0, str(_folder))

import json
import subprocess

import pytest
from swe_task import SweInstance
from swe_testlib import DJANGO_FAIL_TO_PASS, DJANGO_INSTANCE_ID, DJANGO_NAMESPACE, django_row

pytest.importorskip("swebench", reason="the swebench extra is not installed (pip install 'agentrl[swebench]')")
pytestmark = pytest.mark.integration  # the rows name a locally built image (its base commit comes from it)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "env", "import", "swebench", *args],
                          capture_output=True, text=True, timeout=300)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


async def test_imported_rows_run_and_grade_as_swebench_grades_them(tmp_path):
    import agentrl
    from agentrl.hub.entrypoint import import_package_attr
    from agentrl.hub.package import validate_package
    from agentrl.policies import ScriptedPolicy, tool_call
    from agentrl.sampling import SamplingConfig

    rows = _write_jsonl(tmp_path / "verified-mini.jsonl", [django_row()])
    imported = _cli(str(rows), "--out", str(tmp_path / "pkg"))
    assert imported.returncode == 0, imported.stderr
    package = tmp_path / "pkg"
    manifest, splits = validate_package(package)
    assert manifest.name == "swebench-verified-mini" and set(splits) == {"test", "train"}
    assert manifest.sandbox.image == django_row()["image"] and manifest.sandbox.workdir == "/testbed"
    assert manifest.requirements == ["swebench==5.0.2"]  # its rows are graded through swebench's parsers

    env = agentrl.load_environment(package)
    [task] = env.tasks("test")
    assert task.info["eval_script"] and task.info["log_parser"] == "parse_log_django"
    sampling = SamplingConfig(max_tokens=100_000)
    oracle = import_package_attr(package, "swebench_rows:oracle_policy", package_name=env.name)()
    [solved] = await env.run_group(oracle, task, n=1, sampling=sampling)
    assert solved.error is None, solved.error
    assert solved.reward == 1.0 and solved.metrics["fail_to_pass"] == 1.0, solved.state.get("grade")
    idle_policy = ScriptedPolicy([{"tool_calls": [tool_call("submit", answer="nothing to change")]}])
    [idle] = await env.run_group(idle_policy, task, n=1, sampling=sampling)
    assert idle.error is None and idle.reward == 0.0 and idle.metrics["empty_patch"] == 1.0
    assert idle.metrics["pass_to_pass"] == 1.0  # the log was parsed: only the FAIL_TO_PASS tests failed


def test_saved_hf_dataset_folders_import_with_the_image_namespace(tmp_path):
    import datasets

    from agentrl.hub.interop.swebench import import_swebench_rows
    from agentrl.hub.package import validate_package

    row = django_row(swebench5=False)  # no image: SWE-bench's name under the namespace given
    datasets.Dataset.from_list([row]).save_to_disk(str(tmp_path / "lite"))
    assert _cli(str(tmp_path / "lite"), "--out", str(tmp_path / "one"), "--namespace", DJANGO_NAMESPACE).returncode == 0
    _, splits = validate_package(tmp_path / "one")
    info = json.loads(splits["test"][0]["info"])
    assert info["image_name"] == f"{DJANGO_NAMESPACE}/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert SweInstance.from_row(info).FAIL_TO_PASS == DJANGO_FAIL_TO_PASS
    dev = dict(row, instance_id=DJANGO_INSTANCE_ID.replace("11099", "11100"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list([row]), "dev": datasets.Dataset.from_list([dev])}) \
        .save_to_disk(str(tmp_path / "both"))
    import_swebench_rows(tmp_path / "both", out=tmp_path / "two", split="dev")
    _, splits = validate_package(tmp_path / "two")
    assert set(splits) == {"dev", "train", "test"} and len(splits["test"]) == 1  # aliases of the one split
    assert json.loads(splits["dev"][0]["info"])["image_name"] == \
        "swebench/sweb.eval.x86_64.django_1776_django-11100:latest"


def test_rows_nothing_can_grade_and_bad_sources_are_refused_in_one_line(tmp_path):
    from agentrl.errors import AgentrlError
    from agentrl.hub.interop.swebench import import_swebench_rows

    row = django_row(swebench5=False) | {"repo": "someone/runner"}  # Django-style ids, no eval_script, no command
    refused = _cli(str(_write_jsonl(tmp_path / "rows.jsonl", [row])), "--out", str(tmp_path / "pkg"))
    assert refused.returncode == 2 and not (tmp_path / "pkg").exists()
    message = refused.stderr.strip()
    assert "\n" not in message and "rows.jsonl[test]:1" in message and "not pytest node ids" in message
    assert "test_command" in message
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.jsonl").write_text("{nope\n")
    cases = [(_write_jsonl(tmp_path / "parser.jsonl", [django_row() | {"log_parser": "parse_log_nope"}]),
              "log_parser 'parse_log_nope' is not one of swebench's parsers"),
             (tmp_path / "empty", "not a folder written by datasets' save_to_disk"),
             (tmp_path / "missing.jsonl", "no such file or folder"),
             (tmp_path / "broken.jsonl", "not JSON lines of SWE-bench rows")]
    for source, expected in cases:
        with pytest.raises(AgentrlError, match=expected) as error:
            import_swebench_rows(source, out=tmp_path / "out")
        assert "\n" not in str(error.value)
    import_swebench_rows(_write_jsonl(tmp_path / "ok.jsonl", [django_row()]), out=tmp_path / "out")
    with pytest.raises(AgentrlError, match="folder exists and is not empty"):
        import_swebench_rows(tmp_path / "ok.jsonl", out=tmp_path / "out")


def test_a_row_whose_image_is_missing_stops_before_start_up_with_the_command_that_gets_it(tmp_path):
    """A missing SWE-bench image named `agentrl env swebench-image ... --instance ...` only in each failed rollout;
    `check_sandboxes` (train and eval, before any start-up) said "pull or build them"."""
    import agentrl
    from agentrl.errors import NotFoundError
    from agentrl.hub.interop.swebench import import_swebench_rows
    from agentrl.hub.sandbox_check import check_sandboxes

    row = django_row(swebench5=False)
    import_swebench_rows(_write_jsonl(tmp_path / "rows.jsonl", [row]), out=tmp_path / "pkg",
                         namespace="agentrl-test-missing")
    with pytest.raises(NotFoundError) as raised:
        check_sandboxes(agentrl.load_environment(str(tmp_path / "pkg")))
    assert str(raised.value).endswith(f"get it with `agentrl env swebench-image {tmp_path / 'pkg'} --instance "
                                      f"{DJANGO_INSTANCE_ID}` (pulls SWE-bench's published image; add --task-repo "
                                      "REPO, or --source GIT --env-image IMAGE, to build it from the row)")
