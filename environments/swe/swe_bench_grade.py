"""Grading a SWE-bench row as SWE-bench's harness does: its eval script in the fresh sandbox, its log through swebench.

swe_grade.grade_in_sandbox uses this for rows that carry an `eval_script` (swebench 5) or whose
tests are not pytest node ids (swe_bench.uses_eval_script). In the fresh grading sandbox,
already in the task's start state:

1. `apply_like_swebench`: the agent's diff is applied as swebench's harness tries it
   (`git apply --verbose`, `--3way`, `--reject`, then `patch --fuzz=5`, the tree reset between
   attempts, and a reverse check for a chain that applied it after all);
2. (swe_grade) test files the diff touched are put back;
3. `run_eval_script`: the eval script (the row's, or swe_bench.build_eval_script's) as
   swebench's `make_test_spec` turns it into a script that also records the test command's
   exit status, run with stdout and stderr into one log file;
4. `eval_report`: the log, read back to the host, graded by
   `swebench.harness.grading.get_eval_report` with the row's `log_parser` (else swebench's
   parser for the repo) and `eval_type` (else swebench's choice for the repo).

The log came from processes that ran the agent's code, so it is only ever parsed as text on
the host by swebench's parser. `swebench` is an optional extra (`agentrl[swebench]`); without
it these rows raise a one-line error naming the extra.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from pathlib import Path
from typing import Any

from swe_bench import build_eval_script
from swe_task import REPO_DIR, SweInstance

from agentrl.errors import ConfigError, require

__all__ = ["apply_like_swebench", "eval_report", "log_parser_name", "run_eval_script", "swebench_test_spec"]

_EVAL_PATH = "/tmp/agentrl_swe/eval.sh"
_LOG_PATH = "/tmp/agentrl_swe/eval.log"
# swebench.harness.run_evaluation.GIT_APPLY_CMDS, in its order.
_APPLY_COMMANDS = ("git apply --verbose", "git apply --verbose --3way", "git apply --verbose --reject",
                   "patch --batch --forward --fuzz=5 -p1 -i")
# swebench.harness.log_parsers.<module>.MAP_REPO_TO_PARSER_<suffix>: repo -> parser, per language.
_PARSER_MAPS = {"python": "PY", "javascript": "JS", "c": "C", "go": "GO", "java": "JAVA", "php": "PHP",
                "ruby": "RUBY", "rust": "RUST"}


def _swebench():
    """The swebench modules grading needs (a one-line error naming the extra when it is missing)."""
    require("swebench", "swebench")
    import swebench.harness.constants as constants
    import swebench.harness.grading as grading
    import swebench.harness.log_parsers as log_parsers
    import swebench.harness.utils as utils

    return constants, grading, log_parsers, utils


def log_parser_name(instance: SweInstance, *, where: str = "row") -> str:
    """The row's `log_parser`, else the name of swebench's parser for the row's repo; checked against swebench."""
    import importlib

    _, _, log_parsers, _ = _swebench()
    registry = log_parsers.PARSER_REGISTRY
    if instance.log_parser:
        if instance.log_parser not in registry:
            raise ConfigError(f"swe: {where}: log_parser {instance.log_parser!r} is not one of swebench's parsers "
                              f"(e.g. {', '.join(sorted(registry)[:4])}, ...)")
        return instance.log_parser
    for language, suffix in _PARSER_MAPS.items():
        module = importlib.import_module(f"swebench.harness.log_parsers.{language}")
        parser = getattr(module, f"MAP_REPO_TO_PARSER_{suffix}").get(instance.repo)
        if parser is not None:
            return next(name for name, function in registry.items() if function is parser)
    raise ConfigError(f"swe: {where}: swebench has no log parser for repo {instance.repo!r}; "
                      "set the row's log_parser (a name from swebench's PARSER_REGISTRY)")


def swebench_test_spec(instance: SweInstance, *, where: str = "row") -> Any:
    """swebench's TestSpec for the row (its `eval_script` property is the script that runs)."""
    constants, _, _, utils = _swebench()
    assets = getattr(instance, "image_assets", None)
    assets = json.loads(assets) if isinstance(assets, str) and assets.strip() else assets
    if isinstance(assets, dict) and any(entry.get("path") for entries in assets.values() for entry in entries or []):
        raise ConfigError(f"swe: {where}: image_assets (binary files swebench downloads into the tree at eval time) "
                          "are not supported: grading sandboxes have no network; leave such rows out")
    eval_type = instance.eval_type or ("fail_only" if instance.repo in constants.FAIL_ONLY_REPOS else "pass_and_fail")
    if eval_type not in ("pass_and_fail", "fail_only"):
        raise ConfigError(f"swe: {where}: eval_type {eval_type!r} is not 'pass_and_fail' or 'fail_only'")
    return utils.make_test_spec({
        "instance_id": instance.instance_id, "image": instance.image_name, "repo": instance.repo,
        "version": instance.version, "FAIL_TO_PASS": instance.FAIL_TO_PASS, "PASS_TO_PASS": instance.PASS_TO_PASS,
        "eval_script": instance.eval_script or build_eval_script(instance, where=where),
        "log_parser": log_parser_name(instance, where=where), "eval_type": eval_type,
    })


async def apply_like_swebench(sandbox, patch_path: str) -> tuple[bool, str]:
    """Apply the patch at `patch_path` as swebench's harness does; (applied, the last attempt's output)."""
    output = ""
    for attempt, command in enumerate(_APPLY_COMMANDS):
        if attempt:  # a failed attempt (--reject above all) leaves partial changes behind
            await sandbox.exec("git checkout -- . ; git clean -fdq", timeout=60, cwd=REPO_DIR)
        run = await sandbox.exec(f"{command} {shlex.quote(patch_path)}", timeout=60, cwd=REPO_DIR)
        output = run.stdout + run.stderr
        if run.exit_code == 0:
            return True, output
    check = await sandbox.exec(f"git apply --check --reverse {shlex.quote(patch_path)}", timeout=60, cwd=REPO_DIR)
    return check.exit_code == 0, output


async def run_eval_script(sandbox, spec: Any, *, timeout_s: float) -> tuple[str, bool]:
    """Run the spec's eval script in the sandbox; (its log: stdout and stderr in order, timed out)."""
    await sandbox.write_file(_EVAL_PATH, spec.eval_script)
    run = await sandbox.exec(f"rm -f {_LOG_PATH}; /bin/bash {_EVAL_PATH} > {_LOG_PATH} 2>&1",
                             timeout=timeout_s, cwd=REPO_DIR)
    if run.timed_out:
        return "", True
    return await sandbox.read_file(_LOG_PATH), False


def eval_report(spec: Any, log: str, *, patch: str) -> dict[str, Any]:
    """swebench's report for one run: `resolved`, `patch_successfully_applied` and, when the log had results,
    `tests_status` ({FAIL_TO_PASS, PASS_TO_PASS, ...: {success, failure}})."""
    _, grading, _, _ = _swebench()
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-log-") as folder:
        log_path = Path(folder) / "test_output.txt"
        log_path.write_text(log)
        report = grading.get_eval_report(
            test_spec=spec, prediction={"instance_id": spec.instance_id, "model_patch": patch,
                                        "model_name_or_path": "agentrl"},
            test_log_path=str(log_path), include_tests_status=True)
    return report[spec.instance_id]
