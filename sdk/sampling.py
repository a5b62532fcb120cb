"""Sampling settings and the chat-client protocol that environments talk to.

Environments never see HTTP or tokenizers: they hand the conversation so far to a
`ChatClient` and get back the assistant message plus the `Turn` (token ids, logprobs,
routed experts, versions) that produced it. The token client (`agentrl.clients.token_client`) extends
`previous`'s token ids instead of re-rendering the conversation; the OpenAI client and
scripted policies implement the same protocol.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pydantic import Field

from agentrl.config import BaseConfig
from agentrl.types import Message, Turn

__all__ = ["SamplingConfig", "ChatClient"]


class SamplingConfig(BaseConfig):
    """How completions are sampled."""

    max_tokens: int = Field(default=128, ge=1)
    """Most tokens generated per model call (at least 1)."""
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    """Softmax temperature; 0 means greedy (a finite number, not negative)."""
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = Field(default=-1, ge=-1)
    """Sample among the k most likely tokens (-1: all)."""
    seed: int | None = None
    """Per-request seed for reproducible sampling."""
    stop: list[str] = []
    """Strings that end a completion."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens up to max_tokens (vLLM's ignore_eos; load tests, benchmarks)."""


@runtime_checkable
class ChatClient(Protocol):
    """Anything that can continue a conversation: token client, OpenAI client, scripted policy."""

    async def chat(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingConfig,
        previous: Turn | None = None,
    ) -> tuple[Message, Turn]:
        """Return the assistant's next message and the turn's tokens.

        `messages` is the whole conversation so far. `previous` is this rollout's last
        turn; a token client renders only the messages added since then and appends
        their tokens to `previous.prompt_token_ids + previous.completion.token_ids`.
        """
        ...
