"""swe: fix a real bug in a real Python project, graded by the project's own tests.

Tasks come from `data/{train,test}.jsonl` (generated offline by swe_generate.py from six
PyPI projects by validated AST mutation; see README.md) or from any SWE-bench / SWE-Gym /
R2E-Gym style jsonl a user passes as `data_path` or `data_files` (its images must exist
locally; `agentrl env import swebench` makes a package of such rows).

Each rollout starts a sandbox from the task's image, puts /testbed in the task's start
state, and lets the model work with the sandbox tools of `agentrl.sandbox_env.SandboxEnv`
(bash, read_file, write_file, str_replace, submit) under budgets of turns, completion
tokens, wall-clock seconds and command time. The episode ends on `submit`
(or a reply without tool calls, or a budget); its final state is the repository diff.
Scoring grades that diff in a fresh sandbox (swe_grade.py): reward 1.0 only when every
FAIL_TO_PASS and PASS_TO_PASS test passes.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from pathlib import Path
from typing import Any

from swe_bench import CONDA_ACTIVATE, uses_eval_script
from swe_grade import GradeResult, grade, grading_spec
from swe_oracle import GOLD_PATCH_PATH, oracle_policy_for
from swe_sandbox import sandbox_config
from swe_task import REPO_DIR, SweInstance, load_instances, prepare_repository

from agentrl.environment import rows_to_dataset
from agentrl.errors import AgentrlError
from agentrl.rubric import Rubric
from agentrl.sandbox.grading import TAMPER_METRIC
from agentrl.sandbox_env import SandboxEnv
from agentrl.tools import Tool
from agentrl.types import Message, Rollout, Task

__all__ = ["SweEnv", "build_dataset", "checked_instances", "load_environment", "oracle_policy", "task_row",
           "uses_eval_script"]

DATA_DIR = Path(__file__).resolve().parent / "data"
MAX_DIFF_BYTES = 1_000_000
# Staging first includes files the agent created; --no-color keeps the diff appliable.
DIFF_COMMAND = "git add -A >/dev/null 2>&1; git diff --cached --no-color --no-ext-diff HEAD"
SYSTEM_PROMPT = (
    "You are a software engineer fixing a bug in a Python repository checked out at /testbed. "
    "Use the tools: `bash` runs a command in /testbed (no network), `read_file` shows a file with line numbers, "
    "`str_replace` edits a file by replacing one exact occurrence of a text, `write_file` writes a whole file, "
    "`submit` hands in your changes. Find the cause, fix the source code (not the tests), check with the tests, "
    "then call submit."
)
COMPACT_SYSTEM_PROMPT = "Fix the bug in /testbed with the tools, then call submit."
COMPACT_PROBLEM_CHARS = 200
COMPACT_TOOL_OUTPUT_CHARS = 300
COMPACT_MAX_TURNS = 3
# Sourced by bash before each of the agent's commands: activates SWE-bench images' conda env `testbed` when present.
AGENT_BASH_ENV = "/tmp/agentrl_swe/bash_env.sh"


def task_row(instance: SweInstance, *, max_problem_chars: int | None = None) -> dict[str, Any]:
    """A verifiers-style row (prompt, answer, info, task) for one instance (statement cut to `max_problem_chars`)."""
    info = instance.model_dump()
    statement = instance.problem_statement
    if max_problem_chars is not None and len(statement) > max_problem_chars:
        statement = statement[:max_problem_chars].rstrip() + " ..."
    return {
        "prompt": [{"role": "user", "content": statement}],
        "answer": instance.patch,
        "info": json.dumps(info),
        "task": "swe",
        "example_id": instance.instance_id,
    }


def checked_instances(rows: list[dict[str, Any]], *, where: str, namespace: str | None = None) -> list[SweInstance]:
    """Rows as grading reads them (fields, image name), each checked to be gradable (a test command for its runner,
    a swebench log parser, the swebench extra where needed); raises the first problem in one line."""
    instances = []
    for index, row in enumerate(rows):
        instances.append(SweInstance.from_row(row, where=f"{where}:{index + 1}", namespace=namespace))
        grading_spec(instances[-1], where=f"{where}:{index + 1} ({instances[-1].instance_id})")
    return instances


def build_dataset(*, data_dir: str | Path | None = None) -> dict[str, Any]:
    """The committed splits as `datasets.Dataset`s of verifiers rows."""
    folder = Path(data_dir) if data_dir else DATA_DIR
    return {split: rows_to_dataset([task_row(i) for i in load_instances(folder / f"{split}.jsonl")])
            for split in ("train", "test")}


def _grade_of(state: dict[str, Any]) -> dict[str, float]:
    return state.get("grade") or {}


def solved(state: dict[str, Any]) -> float:
    """1.0 when every FAIL_TO_PASS and PASS_TO_PASS test passed with the submitted diff."""
    return _grade_of(state).get("reward", 0.0)


def fail_to_pass(state: dict[str, Any]) -> float:
    """Share of FAIL_TO_PASS tests that pass."""
    return _grade_of(state).get("fail_to_pass", 0.0)


def pass_to_pass(state: dict[str, Any]) -> float:
    """Share of PASS_TO_PASS tests that pass."""
    return _grade_of(state).get("pass_to_pass", 0.0)


def patch_applied(state: dict[str, Any]) -> float:
    """1.0 when the diff applied cleanly in the fresh sandbox."""
    return _grade_of(state).get("patch_applied", 0.0)


def empty_patch(state: dict[str, Any]) -> float:
    """1.0 when the agent changed nothing."""
    return _grade_of(state).get("empty_patch", 1.0)


def tests_timed_out(state: dict[str, Any]) -> float:
    """1.0 when the grading test run hit its timeout."""
    return _grade_of(state).get("timed_out", 0.0)


def test_files_reverted(state: dict[str, Any]) -> float:
    """How many test files or conftest.py files the diff touched (undone before grading)."""
    return _grade_of(state).get("test_files_reverted", 0.0)


def submitted(state: dict[str, Any]) -> float:
    """1.0 when the agent called submit (rather than running out of budget)."""
    return 1.0 if state.get("submitted") else 0.0


_TASK_IMAGE: contextvars.ContextVar[str | None] = contextvars.ContextVar("swe_task_image", default=None)
_GOLD_ORACLE: contextvars.ContextVar[bool] = contextvars.ContextVar("swe_gold_oracle", default=False)


def _compact_schema(tool: Tool) -> None:
    """Cut a tool's schema to its first sentence and no argument descriptions."""
    tool.description = tool.description.split(". ")[0].rstrip(".")
    for spec in tool.parameters.get("properties", {}).values():
        spec.pop("description", None)


class SweEnv(SandboxEnv):
    """SandboxEnv over per-task images (repository at /testbed), scored by executable grading.

    The sandbox tools (bash, read_file, write_file, str_replace, submit) and command-time
    budgets come from `agentrl.sandbox_env.SandboxEnv`; this class picks each task's image,
    puts the repository in the task's start state, ends the episode as soon as the model
    calls submit, keeps the final `git diff`, and grades it in a fresh sandbox.
    """

    def __init__(self, *, command_timeout_s: float = 60.0, max_total_command_s: float | None = 1800.0,
                 test_timeout_s: float = 180.0, max_parallel_sandboxes: int = 2, runtime: str = "runc",
                 cpus: float = 1.0, memory_mb: int = 2048, compact_tools: bool = False, sandbox_type: str = "docker",
                 **kwargs: Any) -> None:
        rubric = Rubric(
            funcs=[solved, fail_to_pass, pass_to_pass, patch_applied, empty_patch, tests_timed_out,
                   test_files_reverted, submitted],
            weights=[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        )
        config = sandbox_config("agentrl-swe/unset:0", cpus=cpus, memory_mb=memory_mb,
                                default_timeout_s=command_timeout_s, runtime=runtime, sandbox_type=sandbox_type)
        config.env["BASH_ENV"] = AGENT_BASH_ENV  # every bash command of the agent runs in the images' conda env
        super().__init__(sandbox=config, rubric=rubric, max_command_timeout_s=command_timeout_s,
                         max_total_command_s=max_total_command_s, **kwargs)
        if compact_tools:  # bash (which can read and edit too) and submit, with the shortest schemas
            for name in ("read_file", "write_file", "str_replace"):
                self.tools.pop(name, None)
            for tool in self.tools.values():
                _compact_schema(tool)
        self.test_timeout_s = test_timeout_s
        """Wall-clock limit of the grading test run."""
        self._gate = asyncio.Semaphore(max_parallel_sandboxes) if max_parallel_sandboxes > 0 else None

    @property
    def sandbox_config(self):
        """The sandbox config; during a rollout's set-up, with that task's image."""
        image = _TASK_IMAGE.get()
        return self._base_sandbox_config.model_copy(update={"image": image}) if image else self._base_sandbox_config

    @sandbox_config.setter
    def sandbox_config(self, value) -> None:
        self._base_sandbox_config = value

    @staticmethod
    def instance(task: Task) -> SweInstance:
        """The SWE-bench fields of a task (from its info)."""
        return SweInstance.from_row(task.info, where=f"task {task.example_id}")

    def missing_image_hint(self, image: str) -> str | None:
        """How to get a row's missing image (`agentrl.hub.sandbox_check`): SWE-bench's own, by instance."""
        from agentrl.hub.interop.swebench_images import swebench_image_hint

        for split in self.splits:
            for task in self.tasks(split):
                instance = self.instance(task)
                if instance.image_name == image:
                    return swebench_image_hint(self.path, instance.instance_id)
        return None

    async def rollout(self, client, task: Task, *, sampling) -> Rollout:
        token = _GOLD_ORACLE.set(bool(getattr(client, "swe_gold_patch", False)))
        try:
            return await super().rollout(client, task, sampling=sampling)
        finally:
            _GOLD_ORACLE.reset(token)

    async def setup_state(self, task: Task) -> dict[str, Any]:
        instance = self.instance(task)
        if self._gate is not None:
            await self._gate.acquire()
        token = _TASK_IMAGE.set(instance.image_name)
        try:
            state = await super().setup_state(task)
        except BaseException as error:
            if self._gate is not None:
                self._gate.release()
            if isinstance(error, AgentrlError) and "is not in the local Docker engine" in str(error):
                from agentrl.hub.interop.swebench_images import swebench_image_hint

                raise AgentrlError(f"swe: {error}; {swebench_image_hint(self.path, instance.instance_id)}") from None
            raise
        finally:
            _TASK_IMAGE.reset(token)
        state["instance_id"] = instance.instance_id
        state["holds_slot"] = self._gate is not None
        return state

    async def setup_sandbox(self, sandbox, task: Task, state: dict[str, Any]) -> None:
        await prepare_repository(sandbox, self.instance(task))
        await sandbox.write_file(AGENT_BASH_ENV, CONDA_ACTIVATE + "\n")
        if _GOLD_ORACLE.get():  # the oracle's own sandbox only: the gold patch its short `git apply` reads
            await sandbox.write_file(GOLD_PATCH_PATH, self.instance(task).patch)

    def is_completed(self, messages: list[Message], state: dict[str, Any]) -> bool:
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant" and any(
                call.function.name == "submit" for call in last.tool_calls or []):
            state["submitted"] = True  # end now: no extra model call after submit
            return True
        return super().is_completed(messages, state)

    async def cleanup_state(self, state: dict[str, Any]) -> None:
        try:
            if state.get("sandbox_key"):
                try:
                    sandbox = self.sandbox_of(state)
                except KeyError:
                    sandbox = None
                if sandbox is not None and "diff" not in state:
                    await sandbox.kill_processes()  # nothing the agent left running can touch the diff's output
                    result = await sandbox.exec(DIFF_COMMAND, timeout=60, cwd=REPO_DIR)
                    diff = result.stdout if result.exit_code == 0 and not result.stdout_truncated else ""
                    if len(diff.encode()) > MAX_DIFF_BYTES or result.stdout_truncated:
                        state["diff_too_large"] = True
                        diff = ""
                    state["diff"] = diff
        finally:
            try:
                await super().cleanup_state(state)
            finally:
                if state.pop("holds_slot", False) and self._gate is not None:
                    self._gate.release()

    async def grade_rollout(self, rollout: Rollout) -> GradeResult:
        """Grade the rollout's final diff in a fresh sandbox (also when the agent ran out of budget)."""
        if rollout.error is not None and "diff" not in rollout.state:
            return GradeResult(error=rollout.error)
        instance = self.instance(rollout.task)
        config = self._base_sandbox_config
        options = {"timeout_s": self.test_timeout_s, "cpus": config.cpus, "memory_mb": config.memory_mb,
                   "runtime": config.runtime, "sandbox_type": config.type}
        if self._gate is None:
            return await grade(instance, rollout.state.get("diff", ""), **options)
        async with self._gate:
            return await grade(instance, rollout.state.get("diff", ""), **options)

    async def score(self, rollouts: list[Rollout]) -> list[Rollout]:
        results = await asyncio.gather(*(self.grade_rollout(rollout) for rollout in rollouts))
        for rollout, result in zip(rollouts, results):
            rollout.state["grade"] = result.metrics()
            if result.error:
                rollout.state["grade_error"] = result.error
                rollout.grader_error = result.error
        scored = await self.rubric.score_group(rollouts)
        for rollout in scored:
            rollout.metrics[TAMPER_METRIC] = _grade_of(rollout.state).get("tamper_suspected", 0.0)
        return scored


def oracle_policy(*, data_dir: str | Path | None = None, data_path: str | Path | None = None,
                  data_files: dict[str, str] | None = None, mode: str = "gold"):
    """A scripted policy that solves any task of the data by issuing its gold patch through the tools."""
    if data_files:
        instances = [i for path in dict.fromkeys(data_files.values()) for i in load_instances(path)]
    elif data_path:
        instances = load_instances(data_path)
    else:
        folder = Path(data_dir) if data_dir else DATA_DIR
        instances = [i for split in ("train", "test") for i in load_instances(folder / f"{split}.jsonl")]
    return oracle_policy_for(instances, mode=mode)


def load_environment(*, data_path: str | None = None, data_dir: str | None = None,
                     data_files: dict[str, str] | None = None, image_namespace: str | None = None,
                     max_turns: int | None = None,
                     max_completion_tokens: int | None = 32768, max_seconds: float | None = 1200.0,
                     command_timeout_s: float = 60.0, max_total_command_s: float | None = 1800.0,
                     test_timeout_s: float = 180.0, max_parallel_sandboxes: int = 2, runtime: str = "runc",
                     system_prompt: str | None = None, compact: bool = False,
                     max_problem_chars: int | None = None, sandbox_type: str = "docker") -> SweEnv:
    """The swe environment: the committed splits, SWE-bench style rows from `data_path` (as 'test' and 'train'), or
    from `data_files` (split name -> jsonl). Rows without an image get SWE-bench's name under `image_namespace`
    (default `swebench`, $AGENTRL_SWEBENCH_NAMESPACE; '' for locally built `sweb.eval.x86_64.<id>:latest`).

    `compact=True` fits small-context models (e.g. tiny-moe's 2048 tokens): a one-line
    system prompt, only the bash and submit tools with short schemas, problem statements
    cut to COMPACT_PROBLEM_CHARS (or `max_problem_chars`), tool output cut to
    COMPACT_TOOL_OUTPUT_CHARS, and COMPACT_MAX_TURNS turns unless `max_turns` is given.

    `sandbox_type='bwrap'` runs the task images under bubblewrap (their trees exported from the local Docker
    engine) instead of Docker.
    """
    if max_turns is None:
        max_turns = COMPACT_MAX_TURNS if compact else 30
    if system_prompt is None:
        system_prompt = COMPACT_SYSTEM_PROMPT if compact else SYSTEM_PROMPT
    if compact and max_problem_chars is None:
        max_problem_chars = COMPACT_PROBLEM_CHARS

    def rows_of(path: Path):
        return lambda: rows_to_dataset([task_row(i, max_problem_chars=max_problem_chars)
                                        for i in load_instances(path, namespace=image_namespace)])

    if data_files:
        missing = [str(path) for path in data_files.values() if not Path(path).exists()]
        if missing:
            raise AgentrlError(f"swe: data_files: {missing[0]} does not exist; give jsonl files of SWE-bench style rows")
        splits: dict[str, Any] = {split: rows_of(Path(path)) for split, path in data_files.items()}
    elif data_path:
        path = Path(data_path)
        if not path.exists():
            raise AgentrlError(f"swe: data_path {path} does not exist; give a jsonl of SWE-bench style rows")
        splits = {"train": rows_of(path), "test": rows_of(path)}
    else:
        folder = Path(data_dir) if data_dir else DATA_DIR
        splits = {split: rows_of(folder / f"{split}.jsonl") for split in ("train", "test")}
    return SweEnv(
        name="swe", splits=splits, system_prompt=system_prompt, max_turns=max_turns,
        max_completion_tokens=max_completion_tokens, max_seconds=max_seconds,
        command_timeout_s=command_timeout_s, max_total_command_s=max_total_command_s, test_timeout_s=test_timeout_s,
        max_parallel_sandboxes=max_parallel_sandboxes, runtime=runtime, compact_tools=compact,
        sandbox_type=sandbox_type,
        **({"max_tool_output_chars": COMPACT_TOOL_OUTPUT_CHARS} if compact else {}),
    )
