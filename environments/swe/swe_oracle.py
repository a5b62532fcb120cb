"""The oracle policy: solves a `swe` task by issuing its gold patch through the real tools.

It is an `agentrl.policies.ScriptedPolicy` whose replies depend on the conversation: it
finds the task by its problem statement (the first user message), then

1. looks around with `bash` (`git status`, `git log`);
2. turns each hunk of the gold patch into a `str_replace` call (old text -> new text);
3. if any edit was refused (text not unique), resets the tree and applies the whole
   patch with `bash` (`git apply` from a here-document);
4. shows `git diff --stat` and calls `submit`.

With `mode="apply"` it goes straight to step 3. Used in tests to drive the full
multi-turn tool path to reward 1.0, and as a reference for what a solution looks like.

`mode="gold"` (the default of `oracle_policy()`) sends only short calls, so no `max_tokens`
cuts them (the hunks of `edit` and the here-document of `apply` are as long as the patch:
at the default 128 tokens they end with `stop=length` and score 0): the environment puts
the gold patch at `GOLD_PATCH_PATH` in the oracle's own sandbox (`swe_gold_patch` marks the
policy), and the oracle runs `git apply` on it and submits.
"""

from __future__ import annotations

import re
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.types import Message

__all__ = ["GOLD_PATCH_PATH", "oracle_policy_for", "patch_edits"]

GOLD_PATCH_PATH = "/tmp/agentrl-gold.patch"
_GOLD_COMMAND = f"git apply --whitespace=nowarn {GOLD_PATCH_PATH} && git diff --stat"

_FILE_RE = re.compile(r"^diff --git [ab]/(\S+) [ab]/(\S+)$")


def patch_edits(patch: str) -> list[tuple[str, str, str]]:
    """(path, old text, new text) for every hunk of a unified diff of existing files."""
    edits: list[tuple[str, str, str]] = []
    path: str | None = None
    old: list[str] | None = None
    new: list[str] = []

    def flush() -> None:
        if path is not None and old is not None:
            edits.append((path, "".join(old), "".join(new)))

    for line in patch.splitlines(keepends=True):
        match = _FILE_RE.match(line.rstrip("\n"))
        if match:
            flush()
            path, old, new = match.group(2), None, []
        elif line.startswith("@@"):
            flush()
            old, new = [], []
        elif old is not None and line.startswith(" "):
            old.append(line[1:])
            new.append(line[1:])
        elif old is not None and line.startswith("-") and not line.startswith("--- "):
            old.append(line[1:])
        elif old is not None and line.startswith("+") and not line.startswith("+++ "):
            new.append(line[1:])
    flush()
    return edits


def _apply_command(patch: str) -> str:
    body = patch if patch.endswith("\n") else patch + "\n"
    return f"git checkout -q -- . && git apply --whitespace=nowarn <<'AGENTRL_PATCH_EOF'\n{body}AGENTRL_PATCH_EOF"


def oracle_policy_for(instances: list[Any], *, mode: str = "edit") -> ScriptedPolicy:
    """A ScriptedPolicy solving any of `instances` (SweInstance) with its gold patch."""
    if mode not in ("edit", "apply", "gold"):
        raise AgentrlError(f"swe oracle: mode must be 'gold', 'edit' or 'apply', got {mode!r}")
    if mode == "gold":  # two short calls; the environment supplies the patch (swe_gold_patch)
        policy = ScriptedPolicy([{"content": "", "tool_calls": [tool_call("bash", command=_GOLD_COMMAND)]},
                                 {"content": "", "tool_calls": [tool_call("submit", answer="applied the fix")]}],
                                name="swe-oracle")
        policy.swe_gold_patch = True
        return policy
    by_statement = {instance.problem_statement.strip(): instance for instance in instances}

    def find(messages: list[Message]):
        for message in messages:
            if message.role == "user":
                instance = by_statement.get(message.content.strip())
                if instance is not None:
                    return instance
        raise AgentrlError("swe oracle: the conversation's problem statement matches no known task")

    def plan(instance) -> list[Any]:
        steps: list[Any] = [tool_call("bash", command="git status --short && git log --oneline -1")]
        edits = patch_edits(instance.patch) if mode == "edit" else []
        if edits:
            steps += [tool_call("str_replace", path=path, old=old, new=new) for path, old, new in edits]
        else:
            steps.append(tool_call("bash", command=_apply_command(instance.patch)))
        steps += [tool_call("bash", command="git diff --stat"), tool_call("submit", answer="applied the fix")]
        return steps

    def reply(messages: list[Message], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        instance = find(messages)
        refusal = next((index for index, message in enumerate(messages) if message.role == "tool"
                        and message.name == "str_replace" and message.content.startswith("Error")), None)
        if refusal is None:
            steps = plan(instance)
            done = sum(1 for message in messages if message.role == "assistant")
        else:  # an edit was refused: reset and apply the whole patch, then finish
            steps = [tool_call("bash", command=_apply_command(instance.patch)),
                     tool_call("bash", command="git diff --stat"), tool_call("submit", answer="applied the fix")]
            done = sum(1 for message in messages[refusal:] if message.role == "assistant")
        return {"content": "", "tool_calls": [steps[min(done, len(steps) - 1)]]}

    return ScriptedPolicy(reply, name="swe-oracle")
