"""SWE-bench's conventions for rows the project did not write: image names, test ids, test commands, eval scripts.

Real SWE-bench rows (Lite, Verified, SWE-Gym, the `swebench` 5 datasets) grade differently
from the rows `swe_generate.py` writes, and this module holds what SWE-bench decides:

- **Image names.** A row's own `image_name`, or the `image` field of `swebench` 5 rows; else
  the name SWE-bench's harness derives, `<namespace>/sweb.eval.x86_64.<instance id>:latest`
  lowercased, with `__` written `_1776_` (Docker Hub refuses double underscores). The
  namespace is `swebench` unless given (`image_namespace=`, $AGENTRL_SWEBENCH_NAMESPACE);
  an empty namespace names a locally built image (`sweb.eval.x86_64.<id>:latest`, no
  substitution, as `swebench`'s image builder names them).
- **Test ids.** Only pytest node ids (`path/to/test_x.py::Class::test[param]`) name files;
  Django's (`test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)`),
  sympy's (`test_issue_1234`) and other runners' ids are opaque names that only the repo's
  log parser understands.
- **Which grader.** A row carrying `eval_script` (swebench 5) is graded by running it and
  parsing its log with the `swebench` package's parser (`log_parser`, else swebench's parser
  for the repo). A row whose tests are all pytest node ids is graded by pytest with agentrl's
  report plugin, under the repo's own pytest config. Any other row gets an eval script built
  here the way SWE-bench 4 built them (reset the test files, apply `test_patch`, run the repo's
  test command on the test patch's files between the `>>>>> Start/End Test Output` markers);
  the test command is the row's `test_command` or the one SWE-bench uses for the repo.
- **conda.** SWE-bench images keep the project's interpreter in the conda env `testbed`;
  every test run activates it when the image has `/opt/miniconda3`.
- **Test files.** SWE-bench puts every file whose path contains `test` or `e2e` into
  `test_patch`, so a gold patch never touches one: an agent's change to such a file is
  undone before grading (for rows without a `bug_patch`).
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any

from agentrl import env_vars
from agentrl.errors import ConfigError

__all__ = [
    "CONDA_ACTIVATE", "END_MARKER", "KNOWN_TEST_COMMANDS", "START_MARKER", "build_eval_script", "default_namespace",
    "is_pytest_id", "is_swebench_test_path", "swebench_image_name", "test_directives", "test_patch_files",
    "uses_eval_script",
]

DEFAULT_NAMESPACE = "swebench"
NAMESPACE_ENV = env_vars.SWEBENCH_NAMESPACE.name
# Activates the images' conda env when there is one (SWE-bench's images: /opt/miniconda3, env `testbed`).
CONDA_ACTIVATE = ("if [ -f /opt/miniconda3/bin/activate ]; then source /opt/miniconda3/bin/activate; "
                  "conda activate testbed; fi")
START_MARKER = ">>>>> Start Test Output"
END_MARKER = ">>>>> End Test Output"
# The test commands SWE-bench 4's specs give these repos (most versions); a row's test_command wins.
KNOWN_TEST_COMMANDS = {
    "django/django": "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
    "sympy/sympy": "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
}
# Files a test directive never names (SWE-bench's NON_TEST_EXTS).
_NON_TEST_SUFFIXES = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
_DIFF_FILE_RE = re.compile(r"^diff --git a/.* b/(.*)$", re.MULTILINE)
_HEREDOC = "EOF_AGENTRL_SWE_TEST_PATCH"


def default_namespace() -> str:
    """The image namespace of rows without an image: $AGENTRL_SWEBENCH_NAMESPACE, else `swebench`."""
    return os.environ.get(NAMESPACE_ENV, DEFAULT_NAMESPACE)


def swebench_image_name(instance_id: str, *, namespace: str | None = None) -> str:
    """The image SWE-bench's harness names for an instance (`swebench/sweb.eval.x86_64.<id>:latest`)."""
    namespace = default_namespace() if namespace is None else namespace.strip().rstrip("/")
    key = f"sweb.eval.x86_64.{instance_id}:latest".lower()
    return f"{namespace}/{key}".replace("__", "_1776_") if namespace else key


def is_pytest_id(test_id: str) -> bool:
    """True for a pytest node id (`path/test_x.py::name[...]` or a `.py` path), False for other runners' names."""
    path = test_id.split("::", 1)[0]
    return path.endswith(".py") and " " not in path and "(" not in path


def is_swebench_test_path(path: str) -> bool:
    """True for a path SWE-bench counts as a test file (its path contains `test` or `e2e`)."""
    return "test" in path or "e2e" in path


def test_patch_files(test_patch: str) -> list[str]:
    """The files a diff touches (its `diff --git a/... b/PATH` lines), in order."""
    return list(dict.fromkeys(_DIFF_FILE_RE.findall(test_patch)))


def test_directives(repo: str, test_patch: str) -> list[str]:
    """What SWE-bench passes the repo's test command: the test patch's files (Django: as test modules)."""
    files = [path for path in test_patch_files(test_patch) if not path.endswith(_NON_TEST_SUFFIXES)]
    if repo != "django/django":
        return files
    modules = []
    for path in files:
        path = path[:-3] if path.endswith(".py") else path
        path = path[len("tests/"):] if path.startswith("tests/") else path
        modules.append(path.replace("/", "."))
    return modules


def uses_eval_script(instance: Any) -> bool:
    """Whether a row is graded through an eval script and a log parser (else: pytest with the report plugin)."""
    if instance.eval_script.strip():
        return True
    tests = instance.FAIL_TO_PASS + instance.PASS_TO_PASS
    pytest_command = not instance.test_command or "pytest" in instance.test_command
    return not (pytest_command and all(is_pytest_id(test) for test in tests))


def _test_command(instance: Any, where: str) -> str:
    command = instance.test_command or KNOWN_TEST_COMMANDS.get(instance.repo)
    if not command:
        example = next((t for t in instance.FAIL_TO_PASS + instance.PASS_TO_PASS if not is_pytest_id(t)), "")
        raise ConfigError(
            f"swe: {where}: tests like {example!r} are not pytest node ids and the row has no eval_script; "
            f"give the swebench 5 row (eval_script, log_parser) or set test_command for repo {instance.repo!r}")
    return command


def build_eval_script(instance: Any, *, where: str = "row") -> str:
    """An eval script for a row without one, as SWE-bench 4 built them (test files reset, test_patch, markers)."""
    files = " ".join(shlex.quote(path) for path in test_patch_files(instance.test_patch))
    directives = " ".join(shlex.quote(d) for d in test_directives(instance.repo, instance.test_patch))
    base = shlex.quote(instance.base_commit)
    lines = ["#!/bin/bash", "set -uxo pipefail", CONDA_ACTIVATE, "cd /testbed", "git status",
             f"git -c core.fileMode=false diff {base}"]
    reset = [f"git checkout {base} -- {files}"] if files else []
    lines += reset
    if instance.test_patch.strip():
        body = instance.test_patch if instance.test_patch.endswith("\n") else instance.test_patch + "\n"
        lines.append(f"git apply -v - <<'{_HEREDOC}'\n{body}{_HEREDOC}")
    lines += [f": '{START_MARKER}'", f"{_test_command(instance, where)} {directives}".rstrip(),
              f": '{END_MARKER}'", *reset]
    return "\n".join(lines) + "\n"
