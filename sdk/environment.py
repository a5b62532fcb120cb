"""The Environment API: datasets of tasks, the rollout loop, and scoring.

`Environment` is the base every environment derives from (contract in docs/DESIGN.md and the
team's shared contracts):

    env.get_dataset(split) -> datasets.Dataset      verifiers-style rows: prompt, answer, info, task
    env.tasks(split, n=..., seed=...) -> list[Task]
    await env.rollout(client, task, sampling=...) -> Rollout     not scored; never raises for
                                                                  environment/inference failures
    await env.score(rollouts) -> rollouts                         one group, filled in by the rubric
    await env.run_group(client, task, n=..., sampling=...)        n concurrent rollouts, then score

`MultiTurnEnv` runs the chat loop against any `ChatClient` and asks its subclass hooks
(`setup_state`, `env_response`, `is_completed`, `cleanup_state`; sync or async) what to
do between model calls, under budgets of turns, total completion tokens and wall-clock
time. Each model call receives the previous `Turn` so token clients extend its token ids
instead of re-rendering; `state["generation_s"]` sums the rollout's time waiting on the model.
`SingleTurnEnv` is the one-call case; `ToolEnv` (tool_env.py) executes the assistant's tool calls.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.parsers import Parser
from agentrl.rubric import Rubric
from agentrl.sampling import ChatClient, SamplingConfig
from agentrl.types import Message, Rollout, Task, Turn

if TYPE_CHECKING:  # pragma: no cover
    import datasets

__all__ = ["Environment", "MultiTurnEnv", "SingleTurnEnv", "rows_to_dataset"]

_SPLIT_ALIASES = {"eval": "test", "validation": "test", "val": "test"}


async def maybe_await(value: Any) -> Any:
    """Await `value` when it is awaitable (hooks may be sync or async)."""
    if inspect.isawaitable(value):
        return await value
    return value


def _normalise_row(row: Mapping[str, Any]) -> dict[str, Any]:
    row = dict(row)
    if isinstance(row.get("info"), dict):
        row["info"] = json.dumps(row["info"])
    row.setdefault("info", "{}")
    row.setdefault("answer", "")
    row.setdefault("task", "default")
    if isinstance(row.get("prompt"), str):
        row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    return row


def rows_to_dataset(rows: Sequence[Mapping[str, Any]]) -> datasets.Dataset:
    """A `datasets.Dataset` from verifiers-style row dicts (an `info` dict is stored as JSON)."""
    import datasets as hf_datasets  # a core dependency, imported late because it is slow to import

    return hf_datasets.Dataset.from_list([_normalise_row(row) for row in rows])


class Environment:
    """Base environment: task datasets, a rubric, and the rollout/score/run_group contract."""

    name: str = "environment"
    rubric: Rubric

    def __init__(
        self,
        *,
        name: str | None = None,
        dataset: Any = None,
        eval_dataset: Any = None,
        splits: Mapping[str, Any] | None = None,
        rubric: Rubric | None = None,
        parser: Parser | None = None,
        system_prompt: str | None = None,
    ) -> None:
        if name is not None:
            self.name = name
        self._splits: dict[str, Any] = dict(splits or {})
        if dataset is not None:
            self._splits["train"] = dataset
        if eval_dataset is not None:
            self._splits["test"] = eval_dataset
        self.parser = parser if parser is not None else (rubric.parser if rubric and rubric.parser else Parser())
        self.rubric = rubric if rubric is not None else Rubric(parser=self.parser)
        if self.rubric.parser is None:
            self.rubric.parser = self.parser
        self.system_prompt = system_prompt
        self.manifest = None
        """The package manifest, set by `agentrl.load_environment`."""
        self.path = None
        """The package folder, set by `agentrl.load_environment`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, splits={self.splits})"

    # ----- data -----------------------------------------------------------------------------
    @property
    def splits(self) -> list[str]:
        return sorted(self._splits)

    def get_dataset(self, split: str = "train") -> datasets.Dataset:
        """The rows of one split as a `datasets.Dataset` (`eval`/`validation` mean `test`)."""
        key = _SPLIT_ALIASES.get(split, split)
        if key not in self._splits:
            available = ", ".join(self.splits) or "none"
            raise NotFoundError(f"environment {self.name!r} has no {split!r} split; available splits: {available}")
        data = self._splits[key]
        if callable(data) and not hasattr(data, "column_names"):
            data = data()
        if isinstance(data, (list, tuple)):
            data = rows_to_dataset(data)
        if not hasattr(data, "column_names"):
            raise AgentrlError(f"environment {self.name!r}: split {key!r} is not a datasets.Dataset or a list of rows")
        if "prompt" not in data.column_names:
            raise AgentrlError(
                f"environment {self.name!r}: split {key!r} has no 'prompt' column "
                f"(columns: {', '.join(data.column_names)})"
            )
        self._splits[key] = data
        return data

    def tasks(self, split: str = "test", *, n: int | None = None, seed: int = 0) -> list[Task]:
        """Tasks of a split: all rows in order, or `n` rows drawn without replacement by `seed`."""
        data = self.get_dataset(split)
        indices = list(range(len(data)))
        if n is not None:
            if n < 0:
                raise AgentrlError(f"tasks: n must be >= 0, got {n}")
            random.Random(seed).shuffle(indices)
            indices = sorted(indices[:n])
        rows = data.select(indices).to_list() if n is not None else data.to_list()
        return [self.make_task(row, index=index) for index, row in zip(indices, rows)]

    def make_task(self, row: Mapping[str, Any], *, index: int | None = None) -> Task:
        """A Task from a dataset row, with the environment's system prompt prepended if it has none."""
        try:
            task = Task.from_row(dict(row))
        except (ValueError, KeyError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            problem = " ".join(str(exc).split())
            raise AgentrlError(
                f"environment {self.name!r}: bad task row {index}: {type(exc).__name__}: {problem}"
            ) from None
        if task.example_id is None:
            task.example_id = index
        if self.system_prompt and not any(message.role == "system" for message in task.prompt):
            task.prompt = [Message(role="system", content=self.system_prompt), *task.prompt]
        return task

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """OpenAI tool definitions offered to the model (None: no tools)."""
        return None

    # ----- episodes ---------------------------------------------------------------------------
    async def rollout(self, client: ChatClient, task: Task, *, sampling: SamplingConfig) -> Rollout:
        """Run one episode of `task` (not scored)."""
        raise NotImplementedError(f"{type(self).__name__} must implement rollout()")

    async def score(self, rollouts: list[Rollout]) -> list[Rollout]:
        """Fill reward and metrics of one group (same task) through the rubric."""
        return await self.rubric.score_group(rollouts)

    async def run_group(
        self, client: ChatClient, task: Task, *, n: int, sampling: SamplingConfig
    ) -> list[Rollout]:
        """`n` concurrent rollouts of one task, then scored together.

        With a sampling seed, rollout i uses seed + i so the group is not n copies.
        """
        if n < 1:
            raise AgentrlError(f"run_group: n must be >= 1, got {n}")

        def sampling_for(index: int) -> SamplingConfig:
            if sampling.seed is None:
                return sampling
            return sampling.model_copy(update={"seed": sampling.seed + index})

        rollouts = await asyncio.gather(
            *(self.rollout(client, task, sampling=sampling_for(index)) for index in range(n))
        )
        return await self.score(list(rollouts))


class MultiTurnEnv(Environment):
    """A chat loop with environment responses between model calls, under budgets."""

    def __init__(
        self,
        *,
        max_turns: int = 10,
        max_completion_tokens: int | None = None,
        max_seconds: float | None = None,
        stop_on_length: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if max_turns < 1:
            raise AgentrlError(f"{type(self).__name__}: max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        """Most model calls per rollout."""
        self.max_completion_tokens = max_completion_tokens
        """Most generated tokens over all of a rollout's model calls (None: no limit)."""
        self.max_seconds = max_seconds
        """Wall-clock limit of a rollout in seconds (None: no limit)."""
        self.stop_on_length = stop_on_length
        """End the episode (truncated) when a completion is cut at max_tokens; False: carry on."""

    # ----- hooks (sync or async) --------------------------------------------------------------
    def setup_state(self, task: Task) -> dict[str, Any]:
        """Per-rollout state, created before the first model call."""
        return {}

    def is_completed(self, messages: list[Message], state: dict[str, Any]) -> bool:
        """True when the episode is over (checked after every model call)."""
        return False

    def tools_for(self, state: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The tools offered to the model in this rollout (default: `tool_schemas`; MCP servers add theirs)."""
        return self.tool_schemas

    def before_model_call(self, messages: list[Message], state: dict[str, Any]) -> str | None:
        """Called before every model call (it may rewrite `messages`); a returned reason ends the episode
        there (`state["stop_reason"]`), not truncated. Default: None."""
        return None

    def env_response(self, messages: list[Message], state: dict[str, Any]) -> list[Message]:
        """Messages the environment adds after the model's turn (e.g. tool results, feedback)."""
        return []

    def cleanup_state(self, state: dict[str, Any]) -> None:
        """Release per-rollout resources (sandboxes...), called after the episode, even on error."""

    # ----- the loop ---------------------------------------------------------------------------
    async def rollout(self, client: ChatClient, task: Task, *, sampling: SamplingConfig) -> Rollout:
        start = time.monotonic()
        messages: list[Message] = [message.model_copy() for message in task.prompt]  # the task stays intact
        turns: list[Turn] = []
        state: dict[str, Any] = {}
        outcome = {"truncated": False, "error": None}
        try:
            async with asyncio.timeout(self.max_seconds):
                state = dict(await maybe_await(self.setup_state(task)) or {})
                await self._loop(client, task, sampling, messages, turns, state, outcome)
        except TimeoutError:
            outcome["truncated"] = True
            state["stop_reason"] = "max_seconds"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - environment/inference failures end up on the rollout
            outcome["error"] = f"{type(exc).__name__}: {exc}".strip()
            state.setdefault("stop_reason", "error")
        finally:
            try:
                await maybe_await(self.cleanup_state(state))
            except Exception as exc:  # noqa: BLE001
                outcome["error"] = outcome["error"] or f"cleanup failed: {type(exc).__name__}: {exc}"
        return Rollout(
            task=task, messages=messages, turns=turns, error=outcome["error"],
            truncated=outcome["truncated"], elapsed_s=time.monotonic() - start, state=state,
        )

    async def _loop(
        self, client: ChatClient, task: Task, sampling: SamplingConfig,
        messages: list[Message], turns: list[Turn], state: dict[str, Any], outcome: dict[str, Any],
    ) -> None:
        used_tokens = 0
        while True:
            stopped = await maybe_await(self.before_model_call(messages, state))
            if stopped:
                state["stop_reason"] = stopped
                return
            call_sampling = sampling
            if self.max_completion_tokens is not None:
                remaining = self.max_completion_tokens - used_tokens
                if remaining <= 0:
                    outcome["truncated"] = True
                    state["stop_reason"] = "max_completion_tokens"
                    return
                if remaining < sampling.max_tokens:
                    call_sampling = sampling.model_copy(update={"max_tokens": remaining})
            started = time.monotonic()
            try:
                message, turn = await client.chat(
                    messages,
                    tools=self.tools_for(state),
                    sampling=call_sampling,
                    previous=turns[-1] if turns else None,
                )
            finally:
                state["generation_s"] = state.get("generation_s", 0.0) + time.monotonic() - started
            if message.role != "assistant":
                message = message.model_copy(update={"role": "assistant"})
            messages.append(message)
            turns.append(turn)
            used_tokens += len(turn.completion.token_ids)
            if turn.completion.finish_reason == "length" and self.stop_on_length:
                outcome["truncated"] = True
                state["stop_reason"] = "length"
                return
            if await maybe_await(self.is_completed(messages, state)):
                state["stop_reason"] = "completed"
                return
            if len(turns) >= self.max_turns:
                outcome["truncated"] = True
                state["stop_reason"] = "max_turns"
                return
            responses = await maybe_await(self.env_response(messages, state)) or []
            messages.extend(Message.model_validate(r) if isinstance(r, dict) else r for r in responses)


class SingleTurnEnv(MultiTurnEnv):
    """One model call per task: prompt in, answer out."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_turns", 1)
        super().__init__(**kwargs)

    def is_completed(self, messages: list[Message], state: dict[str, Any]) -> bool:
        return bool(messages) and messages[-1].role == "assistant"
