"""verifiers v1 `@vf.stop` and `@vf.intercept` hooks around agentrl's loop, with verifiers' own session.

A v1 task's hooks act at the model boundary, which verifiers' interception server drives through a
`RolloutSession`: before each model call the limits and `Trace` stops (`refused`), then request
interceptors and stops over the new user/tool messages (`rewrite_request`); after it, response
interceptors and stops (`rewrite_response`, an interceptor may only swap in an inert text reply),
the reply is committed, then each proposed tool call is put to the request hooks (`gate_tool_calls`:
a stop ends the rollout, a rewrite is that call's result and the call does not run).

`HookedEpisode` holds one verifiers `RolloutSession` per rollout, built exactly as verifiers'
`Rollout` builds it (hook discovery, boundaries from the annotations), and calls it at the same
points of agentrl's loop (`VerifiersTasksetEnv.before_model_call` / `is_completed` / `call_tool`),
keeping the live `Trace` equal to the conversation so far. The rewritten messages are the ones the
model sees (and so the tokens agentrl trains on); a fired stop is the trace's `stop_condition` and
ends the episode, then finalize and scoring run as after any stop.
"""

from __future__ import annotations

import time
from typing import Any

from agentrl.types import Message

__all__ = ["HookedEpisode", "has_boundary_hooks"]


def has_boundary_hooks(vf_task: Any) -> bool:
    """Whether the task defines `@vf.stop` or `@vf.intercept` hooks."""
    from verifiers.v1.utils.decorators import discover_decorated

    return bool(discover_decorated(vf_task, "intercept") or vf_task.hooks("stop"))


class HookedEpisode:
    """verifiers' RolloutSession for one rollout, fed by agentrl's loop."""

    def __init__(self, vf_task: Any, trace: Any, *, tools: list[dict[str, Any]] | None) -> None:
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import EvalClientConfig
        from verifiers.v1.session import RolloutSession, hook_boundary
        from verifiers.v1.trace import Trace
        from verifiers.v1.types import Request, Response, Tool
        from verifiers.v1.utils.decorators import discover_decorated

        interceptors = [(hook_boundary(fn, allow_trace=False), fn) for fn in discover_decorated(vf_task, "intercept")]
        stops = [(hook_boundary(fn, allow_trace=True), fn) for fn in vf_task.hooks("stop")]
        self.trace = trace
        self.prompt_len = 0
        self.denied: dict[str, Any] = {}
        trace.tools = [
            Tool(name=schema["function"]["name"], description=schema["function"].get("description") or "",
                 parameters=schema["function"].get("parameters") or {})
            for schema in tools or []
        ]
        self.session = RolloutSession(
            ctx=ModelContext(model="agentrl", client=EvalClientConfig()),
            trace=trace,
            trace_stops=[fn for boundary, fn in stops if boundary is Trace],
            request_interceptors=[fn for boundary, fn in interceptors if boundary is Request],
            response_interceptors=[fn for boundary, fn in interceptors if boundary is Response],
            request_stops=[fn for boundary, fn in stops if boundary is Request],
            response_stops=[fn for boundary, fn in stops if boundary is Response],
            gates_tools=True,
        )

    def _sync(self, messages: list[Message], upto: int) -> None:
        """The trace's message graph = messages[:upto] (one chain; replies after the prompt `sampled`)."""
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import ModelCall

        from agentrl.hub.interop.verifiers_v1_bridge import to_vf_message

        trace = self.trace
        trace.nodes.clear()
        trace.calls.clear()
        for index, message in enumerate(messages[:upto]):
            sampled = index >= self.prompt_len and message.role == "assistant"
            trace.nodes.append(MessageNode(parent=index - 1 if index else None, message=to_vf_message(message),
                                           sampled=sampled))
            if sampled:
                trace.calls.append(ModelCall(node=index, finish_reason="tool_calls" if message.tool_calls else "stop"))

    def _committed(self, messages: list[Message]) -> int:
        """How many messages the trace holds before a model call: up to the last reply (none before the first)."""
        last = max((i for i, m in enumerate(messages) if m.role == "assistant" and i >= self.prompt_len), default=-1)
        return last + 1

    async def before_call(self, messages: list[Message]) -> str | None:
        """Trace stops, then request interceptors and stops; rewritten user/tool messages replace the loop's."""
        from verifiers.v1.types import Request

        from agentrl.hub.interop.verifiers_v1_bridge import to_vf_message

        committed = self._committed(messages)
        self._sync(messages, committed)
        stopped = await self.session.refused()
        if stopped is not None:  # verifiers refuses the request: its new messages never reach the trace
            del messages[committed:]
            return stopped
        request = Request(messages=[to_vf_message(m) for m in messages], tools=self.trace.tools or None)
        rewritten, records, stopped = await self.session.rewrite_request(request)
        self.trace.request_rewrites.extend(records)
        for index, (before, after) in enumerate(zip(request.messages, rewritten.messages, strict=True)):
            if before != after:
                messages[index] = messages[index].model_copy(update={"content": after.content})
        if stopped is not None:
            self._sync(messages, len(messages))
            self.trace.stop(stopped)
        return stopped

    async def after_call(self, messages: list[Message]) -> str | None:
        """Response interceptors and stops on the reply (a rewrite replaces it), then the tool-call gate."""
        from verifiers.v1.types import Response

        from agentrl.hub.interop.verifiers_v1_bridge import to_vf_message

        reply = to_vf_message(messages[-1])
        response = Response(id="agentrl", created=int(time.time()), model="agentrl", message=reply,
                            finish_reason="tool_calls" if reply.tool_calls else "stop")
        rewritten, records, stopped = await self.session.rewrite_response(response)
        self.trace.response_rewrites.extend(records)
        if records:
            messages[-1] = messages[-1].model_copy(update={"content": rewritten.message.content, "tool_calls": None})
        self._sync(messages, len(messages))
        if stopped is None:
            stopped = await self.session.gate_tool_calls(len(self.trace.nodes) - 1)
        if stopped is not None:
            self.trace.stop(stopped)
            return stopped
        for (_prefix, call_id), verdict in self.session.tool_decisions.items():
            if verdict is not None:
                self.denied[call_id] = ((_prefix, call_id), verdict)
        return None

    def verdict(self, call_id: str) -> str | None:
        """The result a request hook put in place of a call (the call does not run), or None to run it."""
        found = self.denied.pop(call_id, None)
        if found is None:
            return None
        key, verdict = found
        self.session.gated_tools.add(key)
        return verdict.content if isinstance(verdict.content, str) else str(verdict.content)
