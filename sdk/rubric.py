"""Rubrics: turn finished rollouts into a reward and metrics.

A `Rubric` holds reward functions and weights. Each function is sync or async and is
called with whichever of these keyword arguments its signature names:

    completion  the messages the rollout added after the prompt (list[Message])
    answer      the task's reference answer (str)
    prompt      the prompt messages (list[Message])
    state       the environment state kept on the rollout (dict)
    task        the Task
    info        the task's info dict
    parser      the rubric's parser (or None)
    rollout     the whole Rollout

A function whose signature names a plural of those (`completions`, `answers`, `prompts`,
`states`, `tasks`, `infos`, `rollouts`) is a *group* function: it is called once per
group with lists and returns one value per rollout (useful for rewards relative to the
group, e.g. "shortest correct answer").

The reward is the weighted sum of the functions' values; a function with weight 0 is a
metric only. Every value lands in `Rollout.metrics` under the function's name. A function
that raises (or returns NaN/inf) gives 0 for that rollout, `metrics["<name>_error"] = 1.0` and the error text
in `rollout.state["reward_errors"]`; scoring never crashes a training run.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.types import Rollout

__all__ = ["RewardFunc", "Rubric", "RubricGroup", "group_reward"]

RewardFunc = Callable[..., Any]

_SINGLE_ARGS = ("completion", "answer", "prompt", "state", "task", "info", "parser", "rollout")
_GROUP_ARGS = {
    "completions": "completion", "answers": "answer", "prompts": "prompt", "states": "state",
    "tasks": "task", "infos": "info", "rollouts": "rollout",
}


def group_reward(func: RewardFunc) -> RewardFunc:
    """Mark a reward function as group-level even if its parameter names are singular."""
    func.__agentrl_group__ = True  # type: ignore[attr-defined]
    return func


def _rollout_args(rollout: Rollout, parser: Any) -> dict[str, Any]:
    prompt_len = len(rollout.task.prompt)
    return {
        "completion": rollout.messages[prompt_len:],
        "answer": rollout.task.answer,
        "prompt": rollout.messages[:prompt_len] or rollout.task.prompt,
        "state": rollout.state,
        "task": rollout.task,
        "info": rollout.task.info,
        "parser": parser,
        "rollout": rollout,
    }


class _Func:
    """A reward function with its signature analysed once."""

    def __init__(self, func: RewardFunc, weight: float) -> None:
        if not callable(func):
            raise AgentrlError(f"Rubric: reward function {func!r} is not callable")
        self.func = func
        self.weight = float(weight)
        self.name = getattr(func, "__name__", type(func).__name__)
        params = inspect.signature(func).parameters
        self.takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        names = set(params)
        self.is_group = bool(getattr(func, "__agentrl_group__", False)) or bool(names & set(_GROUP_ARGS))
        known = set(_GROUP_ARGS) | {"parser"} if self.is_group else set(_SINGLE_ARGS)
        unknown = [
            p.name for p in params.values()
            if p.name not in known and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        ]
        if unknown:
            allowed = ", ".join(sorted(known))
            raise AgentrlError(
                f"Rubric: reward function {self.name!r} needs argument(s) {', '.join(unknown)}; "
                f"reward functions may take only: {allowed}"
            )
        self.wanted = names if not self.takes_kwargs else None
        call_method = None if inspect.isroutine(func) else type(func).__call__
        self.is_async = inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(call_method)

    def _select(self, available: dict[str, Any]) -> dict[str, Any]:
        if self.wanted is None:
            return available
        return {key: value for key, value in available.items() if key in self.wanted}

    async def _call(self, kwargs: dict[str, Any]) -> Any:
        result = self.func(**kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def score_one(self, rollout: Rollout, parser: Any) -> float:
        value = await self._call(self._select(_rollout_args(rollout, parser)))
        return _finite(value)

    async def score_group(self, rollouts: list[Rollout], parser: Any) -> list[float]:
        per_rollout = [_rollout_args(r, parser) for r in rollouts]
        available: dict[str, Any] = {"parser": parser}
        for plural, singular in _GROUP_ARGS.items():
            available[plural] = [args[singular] for args in per_rollout]
        values = await self._call(self._select(available))
        values = [_finite(v) for v in values]
        if len(values) != len(rollouts):
            raise ValueError(f"returned {len(values)} values for a group of {len(rollouts)}")
        return values


def _finite(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"returned {number}, not a finite number")
    return number


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


def _note_error(rollout: Rollout, name: str, exc: BaseException) -> None:
    rollout.metrics[f"{name}_error"] = 1.0
    rollout.state.setdefault("reward_errors", {})[name] = _error_text(exc)


class Rubric:
    """Weighted reward functions (sync or async, per rollout or per group) plus metrics."""

    def __init__(
        self,
        funcs: Sequence[RewardFunc] | None = None,
        weights: Sequence[float] | None = None,
        *,
        parser: Any = None,
    ) -> None:
        funcs = list(funcs or [])
        weights = [1.0] * len(funcs) if weights is None else list(weights)
        if len(weights) != len(funcs):
            raise AgentrlError(
                f"Rubric: {len(funcs)} reward functions but {len(weights)} weights; give one weight per function"
            )
        self.parser = parser
        self._funcs = [_Func(func, weight) for func, weight in zip(funcs, weights)]
        names = [f.name for f in self._funcs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise AgentrlError(f"Rubric: reward function names must be unique; repeated: {', '.join(duplicates)}")

    def add_reward_func(self, func: RewardFunc, weight: float = 1.0) -> None:
        """Append a reward function (weight 0 makes it a metric)."""
        entry = _Func(func, weight)
        if entry.name in self.func_names:
            raise AgentrlError(f"Rubric: a reward function named {entry.name!r} is already registered")
        self._funcs.append(entry)

    @property
    def func_names(self) -> list[str]:
        return [f.name for f in self._funcs]

    @property
    def weights(self) -> list[float]:
        return [f.weight for f in self._funcs]

    async def _values(self, rollouts: list[Rollout]) -> list[dict[str, float]]:
        """Every function's value for every rollout (errors noted, value 0)."""
        table: list[dict[str, float]] = [{} for _ in rollouts]

        async def run_func(entry: _Func) -> None:
            if entry.is_group:
                try:
                    values = await entry.score_group(rollouts, self.parser)
                except Exception as exc:  # noqa: BLE001 - a reward bug must not stop training
                    values = [0.0] * len(rollouts)
                    for rollout in rollouts:
                        _note_error(rollout, entry.name, exc)
                for row, value in zip(table, values):
                    row[entry.name] = value
                return

            async def one(index: int, rollout: Rollout) -> None:
                try:
                    table[index][entry.name] = await entry.score_one(rollout, self.parser)
                except Exception as exc:  # noqa: BLE001
                    table[index][entry.name] = 0.0
                    _note_error(rollout, entry.name, exc)

            if entry.is_async:
                await asyncio.gather(*(one(i, r) for i, r in enumerate(rollouts)))
            else:  # no tasks to schedule for plain functions
                for index, rollout in enumerate(rollouts):
                    await one(index, rollout)

        await asyncio.gather(*(run_func(entry) for entry in self._funcs))
        return table

    def _weighted(self, row: dict[str, float]) -> float:
        return sum(entry.weight * row.get(entry.name, 0.0) for entry in self._funcs)

    async def score_group(self, rollouts: list[Rollout]) -> list[Rollout]:
        """Fill `reward` and `metrics` of one group of rollouts (same task), in place; returns them."""
        table = await self._values(rollouts)
        for rollout, row in zip(rollouts, table):
            rollout.metrics.update(row)
            rollout.reward = self._weighted(row)
            if rollout.error is not None:
                rollout.reward = 0.0
                rollout.metrics["rollout_error"] = 1.0
        return rollouts

    async def score_rollout(self, rollout: Rollout) -> Rollout:
        """Score a single rollout (group functions see a group of one)."""
        return (await self.score_group([rollout]))[0]


class RubricGroup(Rubric):
    """Several rubrics scored together: rewards add up, metrics merge."""

    def __init__(self, rubrics: Sequence[Rubric]) -> None:
        if not rubrics:
            raise AgentrlError("RubricGroup: give at least one rubric")
        super().__init__(parser=rubrics[0].parser)
        self.rubrics = list(rubrics)

    @property
    def func_names(self) -> list[str]:
        return [name for rubric in self.rubrics for name in rubric.func_names]

    def add_reward_func(self, func: RewardFunc, weight: float = 1.0) -> None:
        self.rubrics[0].add_reward_func(func, weight)

    async def score_group(self, rollouts: list[Rollout]) -> list[Rollout]:
        totals = [0.0] * len(rollouts)
        for rubric in self.rubrics:
            table = await rubric._values(rollouts)
            for index, (rollout, row) in enumerate(zip(rollouts, table)):
                rollout.metrics.update(row)
                totals[index] += rubric._weighted(row)
        for rollout, total in zip(rollouts, totals):
            rollout.reward = total
            if rollout.error is not None:
                rollout.reward = 0.0
                rollout.metrics["rollout_error"] = 1.0
        return rollouts
