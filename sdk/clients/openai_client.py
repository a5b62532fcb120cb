"""A chat client for any OpenAI-compatible endpoint: `/v1/chat/completions`, the protocol of `TokenClient`.

`OpenAIClient` is what `agentrl eval --base-url URL --api-key KEY` talks to when the server is not
agentrl's vLLM (`agentrl.evaluate` picks it): messages go out as OpenAI chat messages and come back
parsed (content, tool calls) with the sampled tokens' logprobs. Token ids are filled in only when the
server is vLLM and `return_token_ids` is on (vLLM's extension); without them a turn holds text and
logprobs, enough for evaluation but not for training.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from agentrl.clients.http_pool import ShardedAsyncClient
from agentrl.errors import InferenceError
from agentrl.sampling import SamplingConfig
from agentrl.types import Completion, FunctionCall, Message, ToolCall, Turn

__all__ = ["OpenAIClient"]


class OpenAIClient:
    """Chat-completions client for any OpenAI-compatible endpoint (same protocol as TokenClient)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        api_key: str | None = None,
        max_connections: int = 256,
        timeout_s: float = 600.0,
        return_token_ids: bool = False,
    ) -> None:
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.model = model
        self.return_token_ids = return_token_ids
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = ShardedAsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0),
            max_connections=max_connections, headers=headers,
        )

    async def chat(
        self,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        sampling: SamplingConfig,
        previous: Turn | None = None,
    ) -> tuple[Message, Turn]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [m.to_openai() for m in messages],
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": True,
        }
        if tools:
            body["tools"] = tools
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k  # vLLM extension
        if sampling.ignore_eos:
            body["ignore_eos"] = True  # vLLM extension
        if self.return_token_ids:
            body["return_token_ids"] = True  # vLLM extension
        try:
            response = await self.http.post("/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise InferenceError(f"{self.base_url}/chat/completions: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise InferenceError(
                f"{self.base_url}/chat/completions answered {response.status_code}: {response.text[:300]}",
                status=response.status_code,
            )
        data = response.json()
        choice = data["choices"][0]
        raw = choice.get("message") or {}
        calls = [
            ToolCall(
                id=call.get("id") or f"call_{index}",
                function=FunctionCall(
                    name=call["function"]["name"], arguments=call["function"].get("arguments") or "{}",
                ),
            )
            for index, call in enumerate(raw.get("tool_calls") or [])
        ]
        message = Message(role="assistant", content=raw.get("content") or "", tool_calls=calls or None)
        logprobs = [entry["logprob"] for entry in ((choice.get("logprobs") or {}).get("content") or [])]
        token_ids = list(choice.get("token_ids") or [])
        # Without vLLM's token ids only text and logprobs are known (enough for evaluation).
        completion = Completion(
            text=message.content, token_ids=token_ids, logprobs=logprobs, finish_reason=choice.get("finish_reason"),
        )
        turn = Turn(prompt_token_ids=list(data.get("prompt_token_ids") or []), completion=completion)
        return message, turn

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
