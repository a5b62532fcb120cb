"""A reference for verifiers' old API: verifiers' own OpenAI chat client, its HTTP call replaced by replies.

`replay_client(replies)` is verifiers' `OpenAIChatCompletionsClient` whose `get_native_response` returns
the OpenAI `ChatCompletion` of `replies[i]` for a conversation's call i (a string, or a dict with
`content` / `tool_calls` of agentrl ToolCalls): prompt conversion, response checks and parsing are
verifiers' own, nothing of agentrl's adapter is used. Tests score the same replies through
`vf_env.run_group(...)` with it and compare with agentrl's rewards.
"""

from __future__ import annotations

import time


def replay_client(replies):
    from openai.types.chat import ChatCompletion
    from verifiers.clients import OpenAIChatCompletionsClient

    class ReplayChatCompletions(OpenAIChatCompletionsClient):
        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            reply = replies[sum(1 for message in prompt if message["role"] == "assistant")]
            reply = {"content": reply} if isinstance(reply, str) else reply
            calls = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in reply.get("tool_calls", [])
            ]
            message = {
                "role": "assistant",
                "content": reply.get("content", ""),
                **({"tool_calls": calls} if calls else {}),
            }
            return ChatCompletion.model_validate(
                {
                    "id": "replay",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        {"index": 0, "finish_reason": "tool_calls" if calls else "stop", "message": message}
                    ],
                }
            )

    return ReplayChatCompletions(object())
