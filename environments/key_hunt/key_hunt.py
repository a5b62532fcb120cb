"""key-hunt: find a key hidden in a small file tree by following clues with shell commands (multi-turn).

Each rollout gets a sandbox (Docker by default; bubblewrap or gVisor by `sandbox=`) whose
working directory holds the task's files (`key_hunt_data`): the chain starts at the file
`start` (with `named_start`, at a path the prompt names), each clue says `next: PATH`, the last
file of the chain says `key: NNNN`, and decoy files hold other keys. The model has two tools: `bash(command)` (run in the sandbox; output
cut short) and `submit(answer)`. An episode that reads the chain and submits takes
`clues + 2` tool calls (3 at the default difficulty).

Grading never reads the sandbox: the reward is 1.0 when the argument of the model's
`submit` call equals the task's key, which comes from the task row on the host. What the
agent writes, leaves running or plants in its sandbox cannot change its reward.

The prompt, tool schemas, outputs and budgets are short so that `tiny-moe` (character
tokens, 2048 positions) can learn it: about 520 tokens of system prompt and tools, and
about 110 per turn.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from key_hunt_data import DATA_DIR, DEFAULT, Difficulty, read_rows, split_rows

from agentrl.errors import AgentrlError
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.rubric import Rubric
from agentrl.sandbox import Sandbox, SandboxConfig
from agentrl.sandbox_env import SandboxEnv
from agentrl.tools import ToolArgumentError
from agentrl.types import Message, Task

__all__ = ["KeyHuntEnv", "build_dataset", "load_environment", "oracle_policy", "sandbox_config"]

SYSTEM_PROMPT = "Read files with bash (cat PATH), follow each 'next:' clue, then submit the key."
TOOL_OUTPUT_CHARS = 200
_NEXT = re.compile(r"^next: (\S+)$", re.MULTILINE)
_KEY = re.compile(r"^key: (\d+)$", re.MULTILINE)
_FIRST = re.compile(r"(?:first clue is in|Begin with the file) (\S+?)\.?$")


def sandbox_config(**overrides: Any) -> SandboxConfig:
    """The sandbox of a rollout: the base image, no network, small limits; `overrides` are SandboxConfig fields."""
    fields: dict[str, Any] = {"cpus": 0.5, "memory_mb": 256, "pids_limit": 64, "disk_mb": 64,
                              "exec_timeout_s": 10.0, "network": False, "workdir": "/workspace",
                              "max_output_bytes": 64 * 1024, **overrides}
    try:
        return SandboxConfig(**fields)
    except ValueError as exc:  # pydantic's ValidationError: one line naming the field
        problem = " ".join(str(exc).split())
        raise AgentrlError(f"key-hunt: sandbox={overrides}: {problem}") from None


def _setup_command(files: dict[str, str]) -> str:
    import shlex

    folders = sorted({str(Path(path).parent) for path in files} - {"."})
    parts = [f"mkdir -p {' '.join(shlex.quote(folder) for folder in folders)}"] if folders else []
    parts += [f"printf '%s\\n' {shlex.quote(text)} > {shlex.quote(path)}" for path, text in files.items()]
    return " && ".join(parts)


def solved(state: dict[str, Any], answer: str) -> float:
    """1.0 when the submitted answer is the task's key (the key comes from the task row, never the sandbox)."""
    submission = state.get("submission")
    return float(isinstance(submission, str) and submission.strip() == answer)


def submitted(state: dict[str, Any]) -> float:
    """1.0 when the model called submit."""
    return float(bool(state.get("submitted")))


def tool_calls(state: dict[str, Any]) -> float:
    """Tool calls of the episode (submit included)."""
    return float(state.get("tool_calls", 0))


def chain_read(state: dict[str, Any], info: dict[str, Any]) -> float:
    """Share of the chain's files (clues and key file) that some bash command of the episode named."""
    chain = info.get("chain") or []
    commands = " ".join(state.get("commands", []))
    return sum(1 for path in chain if re.search(rf"(^|[\s/]){re.escape(path)}($|\s)", commands)) / max(1, len(chain))


_CAT_ONE = re.compile(r"^\s*cat\s+(?:\./)?(\S+)\s*$")


def chain_followed(state: dict[str, Any], info: dict[str, Any]) -> float:
    """How far along the chain the episode's `cat PATH` commands went, in order (a share of its files).

    Judged on the host from the agent's own commands against the task row: only a command reading exactly
    one file counts, so naming many paths at once earns nothing."""
    chain = info.get("chain") or []
    done = 0
    for command in state.get("commands", []):
        match = _CAT_ONE.match(command)
        if match and done < len(chain) and match.group(1) == chain[done]:
            done += 1
    return done / max(1, len(chain))


def progress(state: dict[str, Any], info: dict[str, Any], answer: str) -> float:
    """Partial credit of an unsolved episode: `chain_followed` (0 when solved, so a solved episode's reward is
    exactly 1 and every unsolved one's at most the weight of this term)."""
    return 0.0 if solved(state, answer) else chain_followed(state, info)


class KeyHuntEnv(SandboxEnv):
    """SandboxEnv with `bash` and `submit` only (short schemas and outputs), the task's files in the workdir."""

    def __init__(self, *, max_tool_output_chars: int = TOOL_OUTPUT_CHARS, progress_weight: float = 0.0,
                 **kwargs: Any) -> None:
        rubric = Rubric(funcs=[solved, progress, submitted, tool_calls, chain_read, chain_followed],
                        weights=[1.0, progress_weight, 0.0, 0.0, 0.0, 0.0])
        super().__init__(rubric=rubric, max_tool_output_chars=max_tool_output_chars, **kwargs)
        for name in ("read_file", "write_file", "str_replace"):
            self.tools.pop(name)
        for tool in self.tools.values():  # the shortest schemas: every token of them is in every prompt
            tool.description = tool.description.split(". ")[0].rstrip(".")  # the first sentence
            for spec in tool.parameters.get("properties", {}).values():
                spec.pop("description", None)

    async def setup_sandbox(self, sandbox: Sandbox, task: Task, state: dict[str, Any]) -> None:
        files = task.info.get("files")
        if not isinstance(files, dict) or not files:
            raise AgentrlError(f"key-hunt: task {task.example_id} has no files in its info")
        result = await sandbox.exec(_setup_command(files), timeout=30)
        if result.exit_code != 0:
            raise AgentrlError(f"key-hunt: writing task {task.example_id}'s files failed: "
                               f"{(result.stderr or result.stdout).strip()[:200]}")
        state["commands"] = []

    async def bash(self, command: str, sandbox: Sandbox, state: dict[str, Any]) -> str:
        """Run a shell command. (It runs in the working directory; the output is cut short.)

        Args:
            command: The command, e.g. `cat a/f1`.
        """
        timeout = self._command_timeout(self.max_command_timeout_s, state)
        if timeout is None:
            return f"Error: the command time budget of this episode ({self.max_total_command_s:g} s) is used up"
        state["commands"].append(command)
        result = await sandbox.exec(command, timeout=timeout)
        state["command_seconds"] += result.duration_s
        text = (result.stdout + result.stderr).strip()
        if result.timed_out:
            return (text + "\n" if text else "") + "(timed out)"
        if not text:
            return "(no output)" if result.exit_code == 0 else f"(exit code {result.exit_code})"
        return text

    async def submit(self, answer: str, state: dict[str, Any]) -> str:
        """Submit the key. (The episode ends.)

        Args:
            answer: The key.
        """
        return await super().submit(answer, state)

    async def is_completed(self, messages: list[Message], state: dict[str, Any]) -> bool:
        """A message calling submit ends the episode at once (no model call after it): its answer is recorded
        here (a malformed one records nothing, so it scores 0); other calls of that message are not run."""
        last = messages[-1] if messages else None
        calls = (last.tool_calls or []) if last is not None and last.role == "assistant" else []
        submits = [call for call in calls if call.function.name == "submit"]
        if not submits:
            return super().is_completed(messages, state)
        state["tool_calls"] = state.get("tool_calls", 0) + len(calls)
        try:
            await self.tools["submit"].call(submits[0].function.arguments, hidden={"state": state})
        except ToolArgumentError:
            state["submit_malformed"] = True
        return True


def _rows(difficulty: Difficulty, data_dir: Path | None) -> dict[str, list[dict[str, Any]]]:
    folder = data_dir or DATA_DIR
    if difficulty == DEFAULT and (folder / "train.jsonl").is_file():
        return {split: read_rows(folder / f"{split}.jsonl") for split in ("train", "test")}
    return split_rows(difficulty)


def build_dataset(*, clues: int = DEFAULT.clues, depth: int = DEFAULT.depth, files: int = DEFAULT.files,
                  distractors: int = DEFAULT.distractors, named_start: bool = DEFAULT.named_start,
                  data_dir: str | None = None) -> dict[str, Any]:
    """Train and test splits as `datasets.Dataset`s (the committed files at the default difficulty)."""
    from agentrl.environment import rows_to_dataset

    difficulty = _difficulty(clues=clues, depth=depth, files=files, distractors=distractors, named_start=named_start)
    return {split: rows_to_dataset(rows) for split, rows in _rows(difficulty, Path(data_dir) if data_dir else None).items()}


def _difficulty(**fields: Any) -> Difficulty:
    try:
        return Difficulty(**fields)
    except ValueError as exc:
        problem = " ".join(str(exc).split())
        raise AgentrlError(f"key-hunt: difficulty {fields}: {problem}") from None


def oracle_policy(*, guess_rate: float = 0.0, seed: int = 0) -> ScriptedPolicy:
    """Reads what the agent sees: cat the first file the prompt names, cat each `next:` path, submit the key.

    `guess_rate`: the share of episodes in which it gives up after the first file and submits a made-up key (which
    fails), chosen per episode from what it has seen and `seed`. A warm start learned from such demonstrations
    (`agentrl sft`'s `oracle_args`) hesitates at that point as the demonstrations did: whether to follow the chain
    is then a choice the policy already knows how to make both ways, which reward alone can settle."""
    if not 0.0 <= guess_rate <= 1.0:
        raise AgentrlError(f"key-hunt oracle: guess_rate={guess_rate} must be in [0, 1]")

    def guesses(messages: list[Message]) -> str | None:
        seen = "\n".join(m.content for m in messages)  # the prompt and the first file (prompts repeat across tasks)
        digest = hashlib.sha256(f"{seed}:{seen}".encode()).digest()
        if int.from_bytes(digest[:8], "big") / 2**64 >= guess_rate:
            return None
        return f"{int.from_bytes(digest[8:12], 'big') % 10_000:04d}"

    def reply(messages: list[Message], tools: Any) -> dict[str, Any]:
        last = messages[-1]
        if last.role == "tool":
            key = _KEY.search(last.content)
            if key:
                return {"content": "", "tool_calls": [tool_call("submit", answer=key.group(1))]}
            guess = guesses(messages) if sum(m.role == "tool" for m in messages) == 1 else None
            if guess is not None:
                return {"content": "", "tool_calls": [tool_call("submit", answer=guess)]}
            following = _NEXT.search(last.content)
            if following:
                return {"content": "", "tool_calls": [tool_call("bash", command=f"cat {following.group(1)}")]}
            raise AgentrlError(f"key-hunt oracle: the tool output {last.content[:80]!r} has no clue and no key")
        first = next((_FIRST.search(m.content.strip()) for m in messages if m.role == "user"), None)
        if first is None:
            raise AgentrlError("key-hunt oracle: no user message names the first clue")
        return {"content": "", "tool_calls": [tool_call("bash", command=f"cat {first.group(1)}")]}

    return ScriptedPolicy(reply, name="key-hunt-oracle")


def load_environment(*, clues: int = DEFAULT.clues, depth: int = DEFAULT.depth, files: int = DEFAULT.files,
                     distractors: int = DEFAULT.distractors, named_start: bool = DEFAULT.named_start,
                     sandbox: dict[str, Any] | None = None,
                     pool_size: int = 0, max_turns: int | None = None, system_prompt: str = SYSTEM_PROMPT,
                     progress_weight: float = 0.0, train_tasks: int | None = None,
                     data_dir: str | None = None) -> KeyHuntEnv:
    """The key-hunt environment at a difficulty (`clues`, `depth`, `files`, `distractors`, `named_start`).

    `sandbox`: SandboxConfig fields over the defaults (`{"type": "bwrap"}`, `{"runtime": "runsc"}`, limits);
    `pool_size`: warm sandboxes kept started (`agentrl.sandbox.SandboxPool`; 0 starts one per rollout);
    `max_turns`: model calls per episode (default clues + 4: the solving path and two spare);
    `progress_weight`: partial credit for an unsolved episode, times how far along the chain its `cat PATH`
    commands went (0: the reward is 1 for the key, else 0; any weight below 1 keeps "reward 1" = solved);
    `train_tasks`: only the first this many rows of the train split (a short run that cycles a fixed set of tasks
    scores each pass over the same tasks, so its reward curve compares like with like).
    """
    if not 0.0 <= progress_weight < 1.0:
        raise AgentrlError(f"key-hunt: progress_weight={progress_weight} must be in [0, 1): a solved episode "
                           "must score more than any unsolved one")
    if train_tasks is not None and train_tasks < 1:
        raise AgentrlError(f"key-hunt: train_tasks={train_tasks} must be at least 1")
    difficulty = _difficulty(clues=clues, depth=depth, files=files, distractors=distractors, named_start=named_start)
    folder = Path(data_dir) if data_dir else None
    rows: dict[str, list[dict[str, Any]]] = {}

    def split(name: str):
        def load():
            from agentrl.environment import rows_to_dataset

            if not rows:
                rows.update(_rows(difficulty, folder))
            chosen = rows[name][:train_tasks] if name == "train" and train_tasks is not None else rows[name]
            return rows_to_dataset(chosen)
        return load

    return KeyHuntEnv(
        name="key-hunt", splits={"train": split("train"), "test": split("test")}, system_prompt=system_prompt,
        sandbox=sandbox_config(**(sandbox or {})), pool_size=pool_size,
        max_turns=max_turns if max_turns is not None else difficulty.clues + 4,
        max_command_timeout_s=10.0, max_total_command_s=60.0, max_seconds=300.0, progress_weight=progress_weight,
    )
