"""Core data types that cross every boundary: messages, tasks, completions, rollouts.

Tokens, not text, cross the inference boundary (docs/DESIGN.md section 2): a `Completion`
carries the token ids vLLM produced, their logprobs, the experts each token was routed
to (for Router Replay, one compact `RoutedExperts` array, see `agentrl.routed`) and the
policy version that produced each token. A multi-turn
`Rollout` is a list of `Turn`s whose prompt ids extend the previous turn's prompt and
completion ids, so `Rollout.sample()` can lay the whole trajectory out as one token
sequence with a loss mask and nothing is ever re-tokenized.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from agentrl.routed import RoutedExperts, RoutedExpertsField

__all__ = [
    "FunctionCall", "ToolCall", "Message", "Task", "Completion", "Turn", "Rollout", "TrainingSample", "RoutedExperts",
    "untrusted_json",
]


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def untrusted_json(text: str | bytes) -> Any:
    """JSON that a model or a sandbox wrote: ValueError for anything but plain JSON, a nesting too deep for the parser
    (RecursionError at about 1,000 levels, which callers catching ValueError let through: a red team turned a
    rollout into an error, taken out of training, with one deep tool call) and NaN or Infinity included."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class FunctionCall(_Model):
    """The function part of an OpenAI-style tool call."""

    name: str
    """Name of the tool to call."""
    arguments: str = "{}"
    """JSON-encoded arguments, as OpenAI sends them."""

    def parsed_arguments(self) -> dict[str, Any]:
        """Arguments decoded from JSON (an empty dict when blank)."""
        value = untrusted_json(self.arguments or "{}")
        if not isinstance(value, dict):
            raise ValueError(f"tool call {self.name!r}: arguments must be a JSON object")
        return value


class ToolCall(_Model):
    """One tool call made by the assistant (OpenAI chat format)."""

    id: str
    """Identifier the tool result refers back to."""
    type: Literal["function"] = "function"
    """Always 'function'."""
    function: FunctionCall
    """Which function, with which arguments."""


class Message(_Model):
    """One chat message (OpenAI chat format)."""

    role: Literal["system", "user", "assistant", "tool"]
    """Who speaks."""
    content: str = ""
    """The text."""
    tool_calls: list[ToolCall] | None = None
    """Tool calls made by an assistant message."""
    tool_call_id: str | None = None
    """For a tool message: the call it answers."""
    name: str | None = None
    """For a tool message: the tool's name."""

    def to_openai(self) -> dict[str, Any]:
        """The message as a plain dict for chat templates and OpenAI clients."""
        return self.model_dump(exclude_none=True)


class Task(_Model):
    """A dataset row (verifiers convention): chat prompt, reference answer, free-form info."""

    prompt: list[Message]
    """The chat messages the rollout starts from."""
    answer: str = ""
    """The reference answer the rubric compares against."""
    info: dict[str, Any] = Field(default_factory=dict)
    """Task-specific data (decoded from the row's JSON `info` column)."""
    task: str = "default"
    """Task family name within the environment."""
    example_id: int | str | None = None
    """Row identifier, stable across epochs."""

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Task:
        """Build a Task from a dataset row, decoding a JSON-string `info` column."""
        info = row.get("info") or {}
        if isinstance(info, str):
            info = json.loads(info) if info.strip() else {}
        prompt = row["prompt"]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        return cls(
            prompt=prompt,
            answer=str(row.get("answer") or ""),
            info=info,
            task=str(row.get("task") or "default"),
            example_id=row.get("example_id", row.get("id")),
        )


class Completion(_Model):
    """One model turn as produced by inference: tokens, logprobs, experts, versions."""

    text: str = ""
    """Decoded text of `token_ids`."""
    token_ids: list[int] = Field(default_factory=list)
    """Generated token ids."""
    logprobs: list[float] = Field(default_factory=list)
    """Log-probability of each generated token under the inference policy."""
    routed_experts: RoutedExpertsField | None = None
    """Per token, per layer, the top-k expert ids inference routed it to (Router Replay; -1: unknown)."""
    policy_versions: list[int] | None = Field(default=None,
                                              validation_alias=AliasChoices("policy_versions", "weight_versions"))
    """Per token, the policy (weight) version that produced it (`TrainingSample.policy_versions` downstream; vLLM
    reports it as `weight_versions` spans, and records written before 2026-12-03 under that name still load)."""
    finish_reason: str | None = None
    """'stop', 'length', 'abort' or None."""


class Turn(_Model):
    """One model call inside a rollout."""

    prompt_token_ids: list[int]
    """The full prompt token ids of this call (extends the previous turn's tokens)."""
    completion: Completion
    """What the model produced."""
    prompt_routed_experts: RoutedExpertsField | None = None
    """Experts for the prompt tokens, when inference reports them."""


class TrainingSample(_Model):
    """A rollout laid out as one token sequence for the trainer."""

    token_ids: list[int]
    """All tokens: prompt, completions and environment responses, in order."""
    loss_mask: list[bool]
    """True where the token was generated by the policy."""
    inference_logprobs: list[float]
    """Inference logprob per token (0.0 where masked)."""
    routed_experts: RoutedExpertsField | None = None
    """Per token the routed experts (prompt tokens included when known, else -1), or None."""
    policy_versions: list[int]
    """Per token the policy version (-1 where masked)."""
    advantage: float = 0.0
    """The rollout's advantage, filled in by the orchestrator."""


_RECORD_EXCLUDE = {"turns": {"__all__": {"prompt_routed_experts": True, "completion": {"routed_experts": True}}}}
"""What `Rollout.record` leaves out."""


class Rollout(_Model):
    """A finished episode: the task, the conversation, every turn's tokens, reward, metrics."""

    task: Task
    """The task it ran."""
    messages: list[Message] = Field(default_factory=list)
    """The whole conversation, prompt included."""
    turns: list[Turn] = Field(default_factory=list)
    """Each model call's tokens."""
    reward: float = 0.0
    """Weighted sum of the rubric's reward functions."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Every reward function's and metric's value."""
    error: str | None = None
    """Set when the rollout failed (environment or inference error)."""
    grader_error: str | None = None
    """Why the grader gave the rollout no reward of its own (a task's verifier that wrote none or garbage,
    tampering it caught): the rollout is scored, by the reward it has (0), and still trains."""
    truncated: bool = False
    """True when a budget (turns, tokens, time) ended the rollout."""
    elapsed_s: float = 0.0
    """Wall-clock time of the rollout."""
    state: dict[str, Any] = Field(default_factory=dict)
    """Environment state kept for scoring (JSON-serialisable)."""

    @property
    def completion_tokens(self) -> int:
        return sum(len(turn.completion.token_ids) for turn in self.turns)

    @property
    def policy_versions(self) -> list[int]:
        """Every policy version that produced a token of this rollout."""
        versions: set[int] = set()
        for turn in self.turns:
            versions.update(turn.completion.policy_versions or [])
        return sorted(versions)

    def record(self) -> dict[str, Any]:
        """The rollout as a JSON-ready dict without routed experts: the record layout of `results.jsonl`
        (`agentrl eval`) and `rollouts.jsonl` (the run folder). Experts are (tokens, layers, top_k) per
        turn, most of a record (160 kB of JSON per rollout of a 46-layer model), and neither file's
        readers use them."""
        return self.model_dump(mode="json", exclude=_RECORD_EXCLUDE)

    def sample(self) -> TrainingSample:
        """Lay the turns out as one sequence; each turn's prompt must extend what came before."""
        if not self.turns:
            raise ValueError("rollout has no turns")
        tokens: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        versions: list[int] = []
        parts: list[tuple[int, RoutedExperts]] | None = []  # (first token, rows); uncovered tokens: -1
        for index, turn in enumerate(self.turns):
            prompt = turn.prompt_token_ids
            if prompt[: len(tokens)] != tokens:
                raise ValueError(f"turn {index}: prompt does not extend the previous turn's tokens")
            new_prompt = prompt[len(tokens):]
            completion = turn.completion
            if parts is not None:
                if completion.routed_experts is None:
                    parts = None
                else:
                    if len(completion.routed_experts) != len(completion.token_ids):
                        raise ValueError(f"turn {index}: {len(completion.routed_experts)} routed expert rows for "
                                         f"{len(completion.token_ids)} completion tokens")
                    prompt_experts = turn.prompt_routed_experts
                    if prompt_experts is not None and len(prompt_experts) >= len(prompt):
                        parts.append((len(tokens), prompt_experts[len(tokens): len(prompt)]))
                    parts.append((len(prompt), completion.routed_experts))
            tokens += new_prompt
            mask += [False] * len(new_prompt)
            logprobs += [0.0] * len(new_prompt)
            versions += [-1] * len(new_prompt)
            tokens += completion.token_ids
            mask += [True] * len(completion.token_ids)
            logprobs += list(completion.logprobs)
            versions += list(completion.policy_versions or [0] * len(completion.token_ids))
        experts = None if parts is None else RoutedExperts.assemble(len(tokens), parts)
        return TrainingSample(
            token_ids=tokens, loss_mask=mask, inference_logprobs=logprobs,
            routed_experts=experts, policy_versions=versions,
        )
