"""A `swe` task instance (SWE-bench row form) and how a sandbox is put into its start state.

Rows follow SWE-bench (`instance_id, repo, version, base_commit, patch, test_patch,
FAIL_TO_PASS, PASS_TO_PASS, image_name, problem_statement`); FAIL_TO_PASS / PASS_TO_PASS
may be lists or JSON-encoded strings as in the published SWE-bench datasets, so real
SWE-bench / SWE-Gym / R2E-Gym style rows load through the same code when their images
exist locally, and `swebench` 5 rows bring `image`, `eval_script`, `log_parser` and
`eval_type` (swe_bench.py: image names, test ids and which grader a row gets).
Generated rows add `bug_patch` (the injected mutation) and `source_digest`.

Start state (`prepare_repository`): for a generated row the image holds the clean project
at its release; the bug patch is applied and the repository re-initialised as a single
commit with fixed author and dates, so its hash is the row's `base_commit` and `git log`
shows nothing of the bug. For a row without `bug_patch` the image must already hold the
repository at `base_commit`, which is checked.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from swe_bench import is_pytest_id, swebench_image_name

from agentrl.errors import AgentrlError, ConfigError

__all__ = ["REPO_DIR", "SweInstance", "load_instances", "prepare_repository", "task_commit_script"]

REPO_DIR = "/testbed"
COMMIT_ENV = ("GIT_AUTHOR_DATE='2000-01-01T00:00:00Z' GIT_COMMITTER_DATE='2000-01-01T00:00:00Z' "
              "GIT_AUTHOR_NAME=agentrl GIT_AUTHOR_EMAIL=agentrl@localhost "
              "GIT_COMMITTER_NAME=agentrl GIT_COMMITTER_EMAIL=agentrl@localhost")
# Generated rows (sdists whose pytest config may need plugins the image lacks) run without the config;
# other rows run pytest under the repository's own config.
GENERATED_TEST_COMMAND = "python3 -m pytest -c /dev/null --rootdir /testbed"
PYTEST_TEST_COMMAND = "python3 -m pytest --rootdir /testbed"


class SweInstance(BaseModel):
    """One task: the repository state, the gold fix, the tests that decide it, the image."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    instance_id: str
    """Unique id, e.g. `parse__Parser.evaluate_result__3f2a9c1b7e`."""
    repo: str
    """Upstream repository (`owner/name`)."""
    version: str = ""
    """Project version the task is built on."""
    base_commit: str
    """Commit the agent starts from (for generated rows: the single re-initialised commit)."""
    patch: str
    """Gold patch: the diff that fixes the task."""
    test_patch: str = ""
    """Diff applied before grading (new or changed tests); empty for generated rows."""
    FAIL_TO_PASS: list[str]
    """Tests that fail at the start state and must pass after the fix (pytest node ids, or the names the
    repo's test runner prints, e.g. Django's `test_x (module.Class)`)."""
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    """Tests that pass at the start state and must still pass."""
    image_name: str
    """Sandbox image holding the repository at /testbed."""
    problem_statement: str
    """The issue text the agent gets."""
    bug_patch: str = ""
    """Generated rows: the injected bug, applied to the image's clean tree at start."""
    source_digest: str = ""
    """Generated rows: `sha256:` of the upstream sdist the image was built from."""
    test_command: str = ""
    """The repo's test command (test files or Django test modules are appended); empty: pytest under the repo's
    config for pytest node ids, else the command SWE-bench uses for the repo (swe_bench.KNOWN_TEST_COMMANDS)."""
    eval_script: str = ""
    """swebench 5: the bash script that applies test_patch and runs the tests between SWE-bench's output markers."""
    log_parser: str = ""
    """swebench 5: name of the `swebench` log parser for the eval script's output (e.g. `parse_log_django`);
    empty: swebench's parser for the repo."""
    eval_type: str = ""
    """swebench 5: `pass_and_fail` or `fail_only` (only failures are reported); empty: as swebench decides."""

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _decode_json_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return json.loads(value) if value.strip() else []
        return value

    @property
    def test_files(self) -> list[str]:
        """The files holding the FAIL_TO_PASS and PASS_TO_PASS tests (pytest node ids only: other ids name no file)."""
        return sorted({node.split("::")[0] for node in self.FAIL_TO_PASS + self.PASS_TO_PASS if is_pytest_id(node)})

    @classmethod
    def from_row(cls, row: dict[str, Any], *, where: str = "row", namespace: str | None = None) -> SweInstance:
        """Validate a dataset row (also a verifiers row whose `info` holds the fields).

        A row without `image_name` takes its `image` (swebench 5), else SWE-bench's name for the instance
        under `namespace` (swe_bench.swebench_image_name).
        """
        data = dict(row)
        info = data.get("info")
        if isinstance(info, str) and info.strip().startswith("{"):
            info = json.loads(info)
        if isinstance(info, dict) and "instance_id" in info and "instance_id" not in data:
            data = {**info, **{k: v for k, v in data.items() if k not in ("info", "prompt", "answer", "task")}}
        if not data.get("image_name") and data.get("image"):
            data["image_name"] = data["image"]
        elif not data.get("image_name") and data.get("instance_id"):
            data["image_name"] = swebench_image_name(str(data["instance_id"]), namespace=namespace)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            raise ConfigError(f"swe: {where}: field {field!r}: {first['msg']}") from None


def load_instances(path: str | Path, *, namespace: str | None = None) -> list[SweInstance]:
    """Read SWE-bench style rows from a jsonl (or json list) file (`namespace`: see SweInstance.from_row)."""
    path = Path(path)
    if not path.exists():
        raise AgentrlError(f"swe: dataset file {path} does not exist")
    text = path.read_text()
    rows: list[dict[str, Any]] = []
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"swe: {path}:{number}: not valid JSON ({exc.msg})") from None
    return [SweInstance.from_row(row, where=f"{path}:{index + 1}", namespace=namespace)
            for index, row in enumerate(rows)]


def task_commit_script(message: str) -> str:
    """Bash that re-initialises the working tree as one commit with fixed metadata; prints its hash."""
    return (f"rm -rf .git && git init -q -b main && git add -A && "
            f"{COMMIT_ENV} git commit -q -m {shlex.quote(message)} && git rev-parse HEAD")


def commit_message(instance_repo: str, version: str) -> str:
    return f"{instance_repo} {version}".strip()


async def prepare_repository(sandbox, instance: SweInstance) -> None:
    """Put /testbed into the task's start state; raise AgentrlError when it cannot."""
    if instance.bug_patch:
        await sandbox.write_file("/tmp/agentrl_swe/bug.patch", instance.bug_patch)
        script = ("git apply /tmp/agentrl_swe/bug.patch && rm -f /tmp/agentrl_swe/bug.patch && "
                  + task_commit_script(commit_message(instance.repo, instance.version)))
        result = await sandbox.exec(script, timeout=60, cwd=REPO_DIR)
        head = result.stdout.strip().splitlines()[-1:] or [""]
        if result.exit_code != 0:
            raise AgentrlError(f"swe: {instance.instance_id}: bug patch does not apply to {instance.image_name}: "
                               f"{' '.join(result.stderr.split())[:200]}")
        if head[0] != instance.base_commit:
            raise AgentrlError(f"swe: {instance.instance_id}: start state {head[0][:12]} differs from base_commit "
                               f"{instance.base_commit[:12]}; rebuild the image ({instance.image_name})")
    else:
        result = await sandbox.exec("git rev-parse HEAD", timeout=30, cwd=REPO_DIR)
        if not result.stdout.strip().startswith(instance.base_commit[:12]):
            checkout = await sandbox.exec(f"git checkout -q {shlex.quote(instance.base_commit)}", timeout=60, cwd=REPO_DIR)
            if checkout.exit_code != 0:
                raise AgentrlError(f"swe: {instance.instance_id}: {instance.image_name} lacks base_commit "
                                   f"{instance.base_commit[:12]}")
