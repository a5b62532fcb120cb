"""agentrl's objects as verifiers v1 objects, for `VerifiersTasksetEnv` (`verifiers_v1.py`).

- `sandbox_runtime_class()`: `SandboxRuntime`, verifiers' `Runtime` interface over a started
  agentrl sandbox (commands through `Sandbox.exec` with the runtime's process environment,
  files through read/write_file, capped reads through `head -c`); its owner starts and closes
  the sandbox, so the runtime's own start/teardown do nothing. Made on first use: it
  subclasses a verifiers class, and verifiers is an optional extra.
- `build_trace` / `fill_trace`: a rollout as a verifiers `Trace`: its messages as the message
  graph (one chain; model turns `sampled`), one `ModelCall` per model turn with its finish
  reason (`tool_calls` when the reply called tools and was not cut), and the outcome: the
  rollout's error recorded, or the trace stopped with verifiers' stop condition for agentrl's
  stop reason. verifiers' own `Task.score(trace, runtime)` then scores it.
"""

from __future__ import annotations

import functools
import shlex
import uuid
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.types import Message, Rollout

__all__ = ["build_trace", "fill_trace", "sandbox_runtime_class", "to_vf_message"]

# agentrl's stop reasons -> verifiers' stop conditions (a cut reply is `is_truncated` through its ModelCall)
_STOP_CONDITIONS = {
    "completed": "agent_completed",
    "length": "agent_completed",
    "max_completion_tokens": "max_output_tokens",
}


def _vf():
    import verifiers.v1 as vf

    return vf


@functools.cache
def sandbox_runtime_class() -> type:
    """`SandboxRuntime`: verifiers' `Runtime` over a started agentrl `Sandbox` (made on first use: it needs
    verifiers)."""
    from verifiers.v1.runtimes.base import BaseRuntimeInfo, ProgramResult, Runtime

    class _Config:
        type = "agentrl"

    class SandboxRuntime(Runtime):
        """verifiers' Runtime interface on an agentrl sandbox (started and closed by its owner)."""

        def __init__(self, sandbox: Any) -> None:
            super().__init__(name=f"agentrl-{sandbox.id or uuid.uuid4().hex[:8]}")
            self.sandbox = sandbox
            self.config = _Config()
            self.info = BaseRuntimeInfo(id=sandbox.id)

        async def start(self) -> None:
            return None

        async def teardown(self) -> None:
            return None

        async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
            result = await self.sandbox.exec(list(argv), env=self.process_env(env))
            return ProgramResult(exit_code=result.exit_code, stdout=result.stdout, stderr=result.stderr)

        async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
            if max_bytes is None:
                return await self.sandbox.read_bytes(path)
            raw = await self.sandbox.exec_bytes(
                ["/bin/sh", "-c", f"head -c {int(max_bytes)} -- {shlex.quote(path)}"]
            )
            if raw.exit_code != 0:
                from verifiers.v1.errors import SandboxError

                raise SandboxError(f"read {path!r}: {raw.stderr.decode(errors='replace').strip()[-500:]}")
            return raw.stdout

        async def write(self, path: str, data: bytes) -> None:
            await self.sandbox.write_file(path, data)

    return SandboxRuntime


def to_vf_message(message: Message) -> Any:
    vf = _vf()
    if message.role == "system":
        return vf.SystemMessage(content=message.content)
    if message.role == "user":
        return vf.UserMessage(content=message.content)
    if message.role == "tool":
        return vf.ToolMessage(
            tool_call_id=message.tool_call_id or "", content=message.content, name=message.name
        )
    calls = [
        vf.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
        for call in message.tool_calls or []
    ]
    return vf.AssistantMessage(content=message.content, tool_calls=calls or None)


def build_trace(vf_task: Any, rollout: Rollout | None = None) -> Any:
    """A verifiers Trace of `vf_task`; with `rollout`, its conversation as the message graph (one chain:
    model turns `sampled`, one `ModelCall` per model turn with its finish reason)."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    trace = Trace(
        task=TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash),
        agent=AgentInfo(config=AgentConfig()),
        state=state_cls(type(vf_task))(),
    )
    if rollout is not None:
        fill_trace(trace, rollout)
    return trace


def fill_trace(trace: Any, rollout: Rollout) -> None:
    """Put the rollout's messages, model calls and outcome on `trace`."""
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import ModelCall

    prompt_len = len(rollout.task.prompt)
    turns = iter(rollout.turns)
    trace.nodes.clear()
    trace.calls.clear()
    for index, message in enumerate(rollout.messages):
        sampled = index >= prompt_len and message.role == "assistant"
        trace.nodes.append(
            MessageNode(parent=index - 1 if index else None, message=to_vf_message(message), sampled=sampled)
        )
        if sampled:
            turn = next(turns, None)
            finish = turn.completion.finish_reason if turn is not None else None
            if message.tool_calls and finish != "length":
                finish = "tool_calls"
            trace.calls.append(
                ModelCall(
                    node=index, finish_reason=finish if finish in ("stop", "length", "tool_calls") else None
                )
            )
    if rollout.error is not None:
        trace.record_error(AgentrlError(rollout.error))
    else:
        trace.ok = True
        reason = str(rollout.state.get("stop_reason") or "completed")
        trace.stop(_STOP_CONDITIONS.get(reason, reason))
