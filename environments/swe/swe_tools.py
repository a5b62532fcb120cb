"""The agent's tools in a task sandbox: bash, view, str_replace and submit.

Each tool takes a hidden `sandbox` argument the environment supplies (the rollout's
sandbox); the model sees only the other arguments. Paths are relative to the repository
(/testbed) unless absolute. Tool failures come back as text the model can read; they
never end the episode. `submit` ends the episode (the environment checks for it before
running tools), and the final state is the repository diff.
"""

from __future__ import annotations

import shlex

from agentrl.tools import Tool

__all__ = ["bash", "view", "str_replace", "submit", "make_tools", "REPO_DIR", "DIFF_COMMAND"]

REPO_DIR = "/testbed"
DEFAULT_COMMAND_TIMEOUT_S = 60.0
MAX_VIEW_LINES = 400
# Staging first includes files the agent created; --no-color keeps the diff appliable.
DIFF_COMMAND = "git add -A >/dev/null 2>&1; git diff --cached --no-color --no-ext-diff HEAD"


def _path(path: str) -> str:
    return path if path.startswith("/") else f"{REPO_DIR}/{path}"


async def bash(command: str, sandbox, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> str:
    """Run a bash command in the repository (/testbed) and return its exit code and output.

    Args:
        command: The bash command line, e.g. `grep -rn "def parse" .` or `python3 -m pytest -q tests/test_x.py`.
    """
    result = await sandbox.exec(command, timeout=timeout_s, cwd=REPO_DIR)
    parts = [f"exit code: {result.exit_code}" + (" (timed out)" if result.timed_out else "")]
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    return "\n".join(parts)


async def view(path: str, sandbox, start_line: int = 1, end_line: int | None = None) -> str:
    """Show a file with line numbers (or list a folder).

    Args:
        path: File or folder, relative to the repository root.
        start_line: First line to show (1-based).
        end_line: Last line to show (default: start_line + 399).
    """
    target = _path(path)
    listing = await sandbox.exec(f"test -d {shlex.quote(target)} && ls -la {shlex.quote(target)}", timeout=10, cwd=REPO_DIR)
    if listing.exit_code == 0:
        return listing.stdout
    try:
        text = await sandbox.read_file(target)
    except Exception:  # noqa: BLE001 - the sandbox layer raises its own error type
        return f"Error: {path} does not exist"
    lines = text.splitlines()
    first = max(1, start_line)
    last = min(len(lines), end_line if end_line is not None else first + MAX_VIEW_LINES - 1)
    if first > len(lines):
        return f"Error: {path} has {len(lines)} lines; start_line {start_line} is past the end"
    shown = [f"{number:6d}\t{lines[number - 1]}" for number in range(first, last + 1)]
    if last < len(lines):
        shown.append(f"... ({len(lines) - last} more lines; use start_line/end_line)")
    return "\n".join(shown)


async def str_replace(path: str, old_str: str, new_str: str, sandbox) -> str:
    """Replace one exact occurrence of `old_str` in a file with `new_str`.

    Args:
        path: File relative to the repository root.
        old_str: Text to replace; must occur exactly once in the file (include surrounding lines to make it unique).
        new_str: The replacement text.
    """
    target = _path(path)
    try:
        text = await sandbox.read_file(target)
    except Exception:  # noqa: BLE001
        return f"Error: {path} does not exist"
    count = text.count(old_str) if old_str else 0
    if count != 1:
        return (f"Error: old_str occurs {count} times in {path}; it must occur exactly once "
                f"(copy it exactly, with more surrounding lines)")
    await sandbox.write_file(target, text.replace(old_str, new_str, 1))
    start = text[: text.index(old_str)].count("\n") + 1
    new_lines = (text.replace(old_str, new_str, 1)).splitlines()
    end = start + new_str.count("\n")
    window = range(max(1, start - 3), min(len(new_lines), end + 3) + 1)
    snippet = "\n".join(f"{n:6d}\t{new_lines[n - 1]}" for n in window)
    return f"Edited {path}. Lines {window.start}-{window.stop - 1} now read:\n{snippet}"


async def submit(sandbox) -> str:
    """Finish: submit the repository's current changes as the fix."""
    return "submitted"


def _compact(tool: Tool) -> Tool:
    """Cut the schema to the first sentence and no argument descriptions (for small-context models)."""
    tool.description = tool.description.split(". ")[0].rstrip(".")
    for spec in tool.parameters.get("properties", {}).values():
        spec.pop("description", None)
    return tool


def make_tools(*, command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S, compact: bool = False) -> list[Tool]:
    """The four tools, with `sandbox` hidden from the model (`compact`: bash and submit, shortest schemas)."""

    async def bash_tool(command: str, sandbox) -> str:
        return await bash(command, sandbox, timeout_s=command_timeout_s)

    bash_tool.__doc__ = bash.__doc__
    tools = [
        Tool(bash_tool, name="bash", hidden=("sandbox",)),
        Tool(view, hidden=("sandbox",)),
        Tool(str_replace, hidden=("sandbox",)),
        Tool(submit, hidden=("sandbox",)),
    ]
    # compact: bash (which can view and edit too) and submit only, with the shortest schemas
    return [_compact(tools[0]), _compact(tools[3])] if compact else tools
