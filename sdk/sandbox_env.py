"""SandboxEnv: a tool environment whose tools act in a per-rollout sandbox.

Each rollout gets its own sandbox (started from `sandbox` config, or taken from a warm
`SandboxPool`), prepared by the `setup_sandbox(sandbox, task, state)` hook, and destroyed
after the episode even when it fails. The model sees five typed tools:

- `bash(command, timeout_s)`: run a command in the working directory;
- `read_file(path, start_line, end_line)`: a file with line numbers;
- `write_file(path, content)`: create or replace a file;
- `str_replace(path, old, new)`: replace one exact, unique occurrence;
- `submit(answer)`: hand in the answer and end the episode.

Budgets: each command is killed at `min(timeout_s, max_command_timeout_s)`; the summed
command time of a rollout (the file tools' reads included: they read in the sandbox only what they
show, `str_replace` files up to `max_edit_bytes`) is capped by `max_total_command_s`; turns and wall time are
MultiTurnEnv's `max_turns` and `max_seconds`. The submitted answer is in
`state["submission"]` (the rubric can read it from the rollout's state).

`pool_size=N` keeps N sandboxes of the config started ahead (a `SandboxPool` per event loop,
made on first use), so a rollout's set-up does not wait for a start. `state["sandbox_s"]` is
the rollout's wall time in sandbox work: getting and preparing its sandbox, its tool calls,
destroying it (the RL loop reports it per step beside the generation time).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from agentrl.sandbox import Sandbox, SandboxConfig
from agentrl.sandbox.archive import resolve_path
from agentrl.sandbox.base import ExecResult, RawExecResult
from agentrl.sandbox.pool import SandboxPool
from agentrl.tool_env import ToolEnv
from agentrl.tools import Tool
from agentrl.types import Message, Task

__all__ = ["SandboxEnv"]

# state["sandbox_key"] -> (live sandbox, the pool it came from or None), kept out of the state dict
_SANDBOXES: dict[str, tuple[Sandbox, SandboxPool | None]] = {}


# The file tools read in the sandbox only what they show, under the command budget: a regular file (a FIFO or
# /dev/zero never ends), its line count, then the lines asked for, within the output cap. A red team's read_file of
# a 250 MB sparse file took 1 GB of host memory and none of the budget (2026-12-07).
_REGULAR_FILE = ('if [ ! -e "$1" ]; then echo "no such file" >&2; exit 3; fi; '
                 'if [ ! -f "$1" ]; then echo "not a regular file" >&2; exit 3; fi; ')
_READ_LINES = _REGULAR_FILE + 'n=$(sed -n \'$=\' "$1") || exit 1; echo "${n:-0}"; sed -n "$2,$3p" "$1"'
# str_replace's file in the same command as its check (a process left running could swap a large file or a FIFO in
# between two), no more than max_edit_bytes + 1 of it: one byte more says it is too large.
_READ_CAPPED = _REGULAR_FILE + 'head -c "$2" -- "$1"'


def _result_text(result) -> str:
    parts = [f"exit code: {result.exit_code}" + (" (timed out)" if result.timed_out else "")]
    if result.stdout:
        parts.append(result.stdout.rstrip("\n") + ("\n[stdout truncated]" if result.stdout_truncated else ""))
    if result.stderr:
        parts.append(
            "stderr:\n" + result.stderr.rstrip("\n") + ("\n[stderr truncated]" if result.stderr_truncated else "")
        )
    return "\n".join(parts)


class SandboxEnv(ToolEnv):
    """ToolEnv with bash/read_file/write_file/str_replace/submit tools over a sandbox per rollout."""

    def __init__(
        self,
        *,
        sandbox: SandboxConfig | None = None,
        pool: SandboxPool | None = None,
        pool_size: int = 0,
        max_command_timeout_s: float = 120.0,
        max_total_command_s: float | None = 1800.0,
        max_edit_bytes: int = 4 << 20,
        mcp_servers: list[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("max_turns", 30)
        super().__init__(**kwargs)
        from agentrl.mcp_servers import McpServerSpec

        self.mcp_servers = [McpServerSpec.model_validate(spec) for spec in mcp_servers or []]
        """MCP servers started in each rollout's sandbox (stdio), their tools offered beside these."""
        self.sandbox_config = sandbox or (pool.config if pool is not None else SandboxConfig())
        """How each rollout's sandbox is made."""
        self.pool = pool
        """Warm pool to take sandboxes from (None: start one per rollout, or a pool of `pool_size`)."""
        if pool_size < 0:
            raise ValueError(f"{type(self).__name__}: pool_size={pool_size} must be >= 0")
        self.pool_size = pool_size
        """Without `pool`: warm sandboxes kept started per event loop (0: start one per rollout)."""
        self._pools: dict[asyncio.AbstractEventLoop, SandboxPool] = {}
        self.max_command_timeout_s = max_command_timeout_s
        """Upper bound on one command's timeout, whatever the model asks for."""
        self.max_total_command_s = max_total_command_s
        """Summed command time a rollout may use (None: no limit); the file tools' reads count too."""
        self.max_edit_bytes = max_edit_bytes
        """Largest file `str_replace` edits (it reads the whole file onto the host)."""
        for func in (self.bash, self.read_file, self.write_file, self.str_replace):
            self.add_tool(Tool(func, hidden=("sandbox", "state")))
        self.add_tool(Tool(self.submit, hidden=("state",)))

    # ----- per-rollout sandbox ---------------------------------------------------------------
    async def setup_sandbox(self, sandbox: Sandbox, task: Task, state: dict[str, Any]) -> None:
        """Prepare a rollout's sandbox for its task (files, repository...); override as needed."""

    def _pool(self) -> SandboxPool | None:
        """The given pool, or this event loop's pool of `pool_size` (made on first use), or None."""
        if self.pool is not None or not self.pool_size:
            return self.pool
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            for old in [old for old in self._pools if old.is_closed()]:
                del self._pools[old]  # a finished asyncio.run: its sandboxes went with its loop's shutdown
            pool = self._pools[loop] = SandboxPool(self.sandbox_config, size=self.pool_size)
        return pool

    async def aclose(self) -> None:
        """Destroy the warm sandboxes of this event loop's pool (a later rollout starts a new pool)."""
        pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            await pool.close()

    async def setup_state(self, task: Task) -> dict[str, Any]:
        state: dict[str, Any] = {"command_seconds": 0.0, "submitted": False, "sandbox_s": 0.0}
        started = time.monotonic()
        pool = self._pool()
        if pool is not None:
            sandbox = await pool.acquire()
            state["sandbox_pool"] = True
        else:
            from agentrl.sandbox import create_sandbox

            sandbox = await create_sandbox(self.sandbox_config).start()
        state["sandbox_id"] = sandbox.id
        state["sandbox_key"] = uuid.uuid4().hex
        _SANDBOXES[state["sandbox_key"]] = (sandbox, pool)
        try:
            await self.setup_sandbox(sandbox, task, state)
            if self.mcp_servers:
                await self.start_mcp(sandbox, self.mcp_servers, state)
        except BaseException:
            await self.cleanup_state(state)
            raise
        finally:
            state["sandbox_s"] += time.monotonic() - started
        return state

    async def cleanup_state(self, state: dict[str, Any]) -> None:
        await self.stop_mcp(state)
        sandbox, pool = _SANDBOXES.pop(state.get("sandbox_key", ""), (None, None))
        if sandbox is None:
            return
        started = time.monotonic()
        try:
            if pool is not None:
                await pool.release(sandbox)
            else:
                await sandbox.close()
        finally:
            state["sandbox_s"] = state.get("sandbox_s", 0.0) + time.monotonic() - started

    async def call_tool(self, call, state: dict[str, Any]) -> str:
        """Run one tool call; the time of tools that act in the sandbox counts into `state["sandbox_s"]`."""
        tool = self.tools.get(call.function.name)
        if tool is None or "sandbox" not in tool.hidden:
            return await super().call_tool(call, state)
        started = time.monotonic()
        try:
            return await super().call_tool(call, state)
        finally:
            state["sandbox_s"] = state.get("sandbox_s", 0.0) + time.monotonic() - started

    def sandbox_of(self, state: dict[str, Any]) -> Sandbox:
        """The live sandbox of a rollout (during the episode)."""
        return _SANDBOXES[state["sandbox_key"]][0]

    def hidden_tool_args(self, tool: Tool, state: dict[str, Any]) -> dict[str, Any]:
        return {"state": state, "sandbox": _SANDBOXES.get(state.get("sandbox_key", ""), (None, None))[0]}

    def is_completed(self, messages: list[Message], state: dict[str, Any]) -> bool:
        return bool(state.get("submitted")) or super().is_completed(messages, state)

    # ----- tools -----------------------------------------------------------------------------
    def _command_timeout(self, requested: float, state: dict[str, Any]) -> float | None:
        timeout = min(max(requested, 1.0), self.max_command_timeout_s)
        if self.max_total_command_s is not None:
            left = self.max_total_command_s - state["command_seconds"]
            if left <= 0:
                return None
            timeout = min(timeout, left)
        return timeout

    async def bash(self, command: str, sandbox: Sandbox, state: dict[str, Any], timeout_s: float = 60.0) -> str:
        """Run a bash command in the working directory and return its exit code and output.

        Args:
            command: The bash command line, e.g. `ls -la` or `python3 -m pytest -q`.
            timeout_s: Seconds before the command is killed (capped by the environment).
        """
        timeout = self._command_timeout(timeout_s, state)
        if timeout is None:
            return self._budget_error()
        result = await sandbox.exec(command, timeout=timeout)
        state["command_seconds"] += result.duration_s
        return _result_text(result)

    async def _in_sandbox(self, sandbox: Sandbox, state: dict[str, Any], script: str, *args: str,
                          max_output: int | None = None) -> RawExecResult | None:
        """A file tool's command, under the command budget like `bash` (None: the budget is used up)."""
        timeout = self._command_timeout(60.0, state)
        if timeout is None:
            return None
        raw = await sandbox.exec_bytes(["/bin/sh", "-c", script, "sh", *args], timeout=timeout, max_output=max_output)
        state["command_seconds"] += raw.duration_s
        return raw

    def _budget_error(self) -> str:
        return f"Error: the command time budget of this episode ({self.max_total_command_s:g} s) is used up"

    async def read_file(self, path: str, sandbox: Sandbox, state: dict[str, Any], start_line: int = 1,
                        end_line: int | None = None) -> str:
        """Show a text file with line numbers.

        Args:
            path: File path, relative to the working directory or absolute.
            start_line: First line to show (1-based).
            end_line: Last line to show (default: the end of the file).
        """
        first = max(start_line, 1)
        if end_line is not None and end_line < first:
            return f"Error: end_line={end_line} is before start_line={start_line}"
        last = "$" if end_line is None else str(end_line)
        raw = await self._in_sandbox(sandbox, state, _READ_LINES, resolve_path(
            sandbox.config.workdir, path, action="read_file"), str(first), last)
        if raw is None:
            return self._budget_error()
        result = ExecResult.from_raw(raw)
        if result.exit_code != 0 or result.timed_out:
            return f"Error: cannot read {path}: " + (result.stderr.strip() or _result_text(result))[:500]
        count, _, text = result.stdout.partition("\n")
        total = int(count) if count.isdigit() else 0
        if first > max(total, 1) and total:
            return f"Error: {path} has {total} lines; start_line={start_line} is past the end"
        lines = text.split("\n")
        if lines and not lines[-1]:
            lines.pop()
        if result.stdout_truncated and lines:
            lines.pop()  # the last line shown may be cut
        shown = "\n".join(f"{first + index:6d}\t{line}" for index, line in enumerate(lines))
        if not result.stdout_truncated:
            return shown
        if not lines:
            return f"[line {first} is longer than the output cap; use bash (e.g. cut -c 1-2000) to see part of it]"
        return shown + f"\n[output cut after line {first + len(lines) - 1}; ask for a later start_line]"

    async def write_file(self, path: str, content: str, sandbox: Sandbox, state: dict[str, Any]) -> str:
        """Create or overwrite a file (parent folders are created).

        Args:
            path: File path, relative to the working directory or absolute.
            content: The complete new content of the file.
        """
        await sandbox.write_file(path, content)
        return f"wrote {len(content.encode())} bytes to {path}"

    async def str_replace(self, path: str, old: str, new: str, sandbox: Sandbox, state: dict[str, Any]) -> str:
        """Replace one exact occurrence of `old` with `new` in a file; `old` must occur exactly once.

        Args:
            path: File path, relative to the working directory or absolute.
            old: The exact text to replace (include enough context to make it unique).
            new: The replacement text.
        """
        if not old:
            return "Error: old must not be empty"
        target = resolve_path(sandbox.config.workdir, path, action="str_replace")
        limit = self.max_edit_bytes + 1
        raw = await self._in_sandbox(sandbox, state, _READ_CAPPED, target, str(limit), max_output=limit)
        if raw is None:
            return self._budget_error()
        if raw.exit_code != 0 or raw.timed_out:
            return f"Error: cannot edit {path}: " + (ExecResult.from_raw(raw).stderr.strip() or "failed")[:500]
        if len(raw.stdout) >= limit or raw.stdout_truncated:
            return (f"Error: {path} is larger than {self.max_edit_bytes} bytes, the most str_replace edits "
                    "(use bash, e.g. sed, for larger ones)")
        text = raw.stdout.decode("utf-8", errors="replace")
        count = text.count(old)
        if count != 1:
            where = "not found" if count == 0 else f"found {count} times; add context to make it unique"
            return f"Error: old text {where} in {path}"
        await sandbox.write_file(path, text.replace(old, new, 1))
        line = text[: text.index(old)].count("\n") + 1
        return f"replaced 1 occurrence in {path} at line {line}"

    async def submit(self, answer: str, state: dict[str, Any]) -> str:
        """Hand in the final answer and end the episode.

        Args:
            answer: The final answer (for code tasks, a short summary of the change).
        """
        state["submitted"] = True
        state["submission"] = answer
        return "submitted"

