"""swe: fix a real bug in a real Python project, graded by the project's own tests.

Tasks come from `data/{train,test}.jsonl` (generated offline by swe_generate.py from six
PyPI projects by validated AST mutation; see README.md) or from any SWE-bench / SWE-Gym /
R2E-Gym style jsonl a user passes as `data_path` (its images must exist locally).

Each rollout starts a sandbox from the task's image, puts /testbed in the task's start
state, and lets the model work with four tools (bash, view, str_replace, submit) under
budgets of turns, completion tokens and wall-clock seconds. The episode ends on `submit`
(or a reply without tool calls, or a budget); its final state is the repository diff.
Scoring grades that diff in a fresh sandbox (swe_grade.py): reward 1.0 only when every
FAIL_TO_PASS and PASS_TO_PASS test passes.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

from agentrl.environment import rows_to_dataset
from agentrl.errors import AgentrlError
from agentrl.rubric import Rubric
from agentrl.tool_env import ToolEnv
from agentrl.tools import Tool
from agentrl.types import Message, Rollout, Task

from swe_grade import GradeResult, grade
from swe_oracle import oracle_policy_for
from swe_sandbox import open_sandbox
from swe_task import SweInstance, load_instances, prepare_repository
from swe_tools import DIFF_COMMAND, REPO_DIR, make_tools

__all__ = ["SweEnv", "load_environment", "build_dataset", "oracle_policy", "task_row"]

DATA_DIR = Path(__file__).resolve().parent / "data"
MAX_DIFF_BYTES = 1_000_000
SYSTEM_PROMPT = (
    "You are a software engineer fixing a bug in a Python repository checked out at /testbed. "
    "Use the tools: `bash` runs a command in /testbed (no network), `view` shows a file with line numbers, "
    "`str_replace` edits a file by replacing one exact occurrence of a text, `submit` hands in your changes. "
    "Find the cause, fix the source code (not the tests), check with the tests, then call submit."
)
COMPACT_SYSTEM_PROMPT = "Fix the bug in /testbed with the tools, then call submit."
COMPACT_PROBLEM_CHARS = 200
COMPACT_TOOL_OUTPUT_CHARS = 300
COMPACT_MAX_TURNS = 3


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


def submitted(state: dict[str, Any]) -> float:
    """1.0 when the agent called submit (rather than running out of budget)."""
    return 1.0 if state.get("submitted") else 0.0


class SweEnv(ToolEnv):
    """The multi-turn tool environment over task sandboxes, scored by executable grading."""

    def __init__(self, *, command_timeout_s: float = 60.0, test_timeout_s: float = 180.0,
                 max_parallel_sandboxes: int = 2, runtime: str = "runc", cpus: float = 1.0,
                 memory_mb: int = 2048, compact_tools: bool = False, **kwargs: Any) -> None:
        rubric = Rubric(
            funcs=[solved, fail_to_pass, pass_to_pass, patch_applied, empty_patch, tests_timed_out, submitted],
            weights=[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        )
        tools: list[Tool] = make_tools(command_timeout_s=command_timeout_s, compact=compact_tools)
        super().__init__(tools=tools, rubric=rubric, **kwargs)
        self.test_timeout_s = test_timeout_s
        """Wall-clock limit of the grading test run."""
        self.runtime = runtime
        """Docker runtime of the sandboxes ('runc' or 'runsc' for gVisor)."""
        self.cpus = cpus
        """CPU limit of each sandbox."""
        self.memory_mb = memory_mb
        """Memory limit of each sandbox in MiB."""
        self._gate = asyncio.Semaphore(max_parallel_sandboxes) if max_parallel_sandboxes > 0 else None
        self._live: dict[str, Any] = {}

    @staticmethod
    def instance(task: Task) -> SweInstance:
        """The SWE-bench fields of a task (from its info)."""
        return SweInstance.from_row(task.info, where=f"task {task.example_id}")

    def _open(self, image: str):
        return open_sandbox(image, cpus=self.cpus, memory_mb=self.memory_mb, runtime=self.runtime)

    async def setup_state(self, task: Task) -> dict[str, Any]:
        instance = self.instance(task)
        key = uuid.uuid4().hex
        if self._gate is not None:
            await self._gate.acquire()
        try:
            context = self._open(instance.image_name)
            sandbox = await context.__aenter__()
        except BaseException:
            if self._gate is not None:
                self._gate.release()
            raise
        self._live[key] = (context, sandbox)
        try:
            await prepare_repository(sandbox, instance)
        except BaseException:
            await self._release(key)
            raise
        return {"sandbox_key": key, "instance_id": instance.instance_id}

    async def _release(self, key: str) -> None:
        """Destroy a rollout's sandbox and free its slot."""
        entry = self._live.pop(key, None)
        if entry is None:
            return
        try:
            await entry[0].__aexit__(None, None, None)
        finally:
            if self._gate is not None:
                self._gate.release()

    def hidden_tool_args(self, tool: Tool, state: dict[str, Any]) -> dict[str, Any]:
        return {"sandbox": self._live[state["sandbox_key"]][1], "state": state}

    def is_completed(self, messages: list[Message], state: dict[str, Any]) -> bool:
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant" and any(
                call.function.name == "submit" for call in last.tool_calls or []):
            state["submitted"] = True
            return True
        return super().is_completed(messages, state)

    async def cleanup_state(self, state: dict[str, Any]) -> None:
        key = state.get("sandbox_key")
        entry = self._live.get(key) if key else None
        if entry is None:
            return
        try:
            result = await entry[1].exec(DIFF_COMMAND, timeout=60, cwd=REPO_DIR)
            diff = result.stdout if result.exit_code == 0 else ""
            if len(diff.encode()) > MAX_DIFF_BYTES:
                state["diff_too_large"] = True
                diff = ""
            state["diff"] = diff
        finally:
            await self._release(key)

    async def grade_rollout(self, rollout: Rollout) -> GradeResult:
        """Grade the rollout's final diff in a fresh sandbox (also when the agent ran out of budget)."""
        if rollout.error is not None and "diff" not in rollout.state:
            return GradeResult(error=rollout.error)
        instance = self.instance(rollout.task)
        options = dict(timeout_s=self.test_timeout_s, cpus=self.cpus, memory_mb=self.memory_mb, runtime=self.runtime)
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
        return await self.rubric.score_group(rollouts)


def oracle_policy(*, data_dir: str | Path | None = None, data_path: str | Path | None = None,
                  mode: str = "edit"):
    """A scripted policy that solves any task of the data by issuing its gold patch through the tools."""
    if data_path:
        instances = load_instances(data_path)
    else:
        folder = Path(data_dir) if data_dir else DATA_DIR
        instances = [i for split in ("train", "test") for i in load_instances(folder / f"{split}.jsonl")]
    return oracle_policy_for(instances, mode=mode)


def load_environment(*, data_path: str | None = None, data_dir: str | None = None, max_turns: int | None = None,
                     max_completion_tokens: int | None = 32768, max_seconds: float | None = 1200.0,
                     command_timeout_s: float = 60.0, test_timeout_s: float = 180.0,
                     max_parallel_sandboxes: int = 2, runtime: str = "runc", system_prompt: str | None = None,
                     compact: bool = False, max_problem_chars: int | None = None) -> SweEnv:
    """The swe environment: the committed splits, or SWE-bench style rows from `data_path` (as 'test' and 'train').

    `compact=True` fits small-context models (e.g. tiny-moe's 2048 tokens): a one-line
    system prompt, only the bash and submit tools with short schemas, problem statements
    cut to COMPACT_PROBLEM_CHARS (or `max_problem_chars`), tool output cut to
    COMPACT_TOOL_OUTPUT_CHARS, and COMPACT_MAX_TURNS turns unless `max_turns` is given.
    """
    if max_turns is None:
        max_turns = COMPACT_MAX_TURNS if compact else 30
    if system_prompt is None:
        system_prompt = COMPACT_SYSTEM_PROMPT if compact else SYSTEM_PROMPT
    if compact and max_problem_chars is None:
        max_problem_chars = COMPACT_PROBLEM_CHARS

    def rows_of(path: Path):
        return lambda: rows_to_dataset([task_row(i, max_problem_chars=max_problem_chars) for i in load_instances(path)])

    if data_path:
        path = Path(data_path)
        if not path.exists():
            raise AgentrlError(f"swe: data_path {path} does not exist; give a jsonl of SWE-bench style rows")
        splits: dict[str, Any] = {"train": rows_of(path), "test": rows_of(path)}
    else:
        folder = Path(data_dir) if data_dir else DATA_DIR
        splits = {split: rows_of(folder / f"{split}.jsonl") for split in ("train", "test")}
    return SweEnv(
        name="swe", splits=splits, system_prompt=system_prompt, max_turns=max_turns,
        max_completion_tokens=max_completion_tokens, max_seconds=max_seconds,
        command_timeout_s=command_timeout_s, test_timeout_s=test_timeout_s,
        max_parallel_sandboxes=max_parallel_sandboxes, runtime=runtime, compact_tools=compact,
        **({"max_tool_output_chars": COMPACT_TOOL_OUTPUT_CHARS} if compact else {}),
    )
