"""The environment behind packages imported from Harbor tasks (`agentrl env import harbor`).

One rollout = one Harbor trial: a sandbox starts from the task's image (built from
`environment/Dockerfile`), the model works in it through a `bash` tool until it answers
without a tool call. Then the task's verifier runs out of the agent's reach
(`agentrl.sandbox.grading.grade_in_fresh_sandbox`): the agent's processes are killed, its
working directory is carried into a fresh sandbox of the same image and the agent's
sandbox is closed; there `tests/` is uploaded to `/tests`, `bash /tests/test.sh` runs with
the verifier timeout, and the reward is read from `/logs/verifier/reward.txt` (a number)
or `/logs/verifier/reward.json` (`{"reward": x}`), which only the verifier can have
written. A missing or unreadable reward is 0 with `verifier_error` set. Changes the agent
made outside the working directory do not reach the verifier. The oracle policy replays
`solution/solve.sh` through the bash tool.
"""

from __future__ import annotations

import json
import shlex
import uuid
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.hub.manifest import load_manifest
from agentrl.rubric import Rubric
from agentrl.tool_env import ToolEnv
from agentrl.tools import Tool
from agentrl.types import Task

__all__ = ["HarborTaskEnv", "load_harbor_environment", "harbor_oracle_policy"]

REWARD_DIR = "/logs/verifier"


def verifier_reward(state: dict[str, Any]) -> float:
    """The reward the task's tests/test.sh wrote (0.0 when it wrote none)."""
    return float(state.get("verifier_reward") or 0.0)


def verifier_ran(state: dict[str, Any]) -> float:
    """1.0 when the verifier produced a readable reward (a metric)."""
    return 0.0 if state.get("verifier_error") else 1.0


def _parse_reward(text: str, name: str) -> float:
    text = text.strip()
    if name.endswith(".json"):
        data = json.loads(text)
        value = data.get("reward") if isinstance(data, dict) else data
    else:
        value = text.split()[0] if text else ""
    return float(value)


class HarborTaskEnv(ToolEnv):
    """A Harbor task as a multi-turn bash environment scored by the task's own test script."""

    def __init__(self, *, package_dir: str | Path, command_timeout_s: float = 60.0,
                 verifier_timeout_s: float | None = None, runtime: str = "runc", **kwargs: Any) -> None:
        self.package_dir = Path(package_dir)
        self.manifest = load_manifest(self.package_dir)
        if self.manifest.sandbox is None:
            raise AgentrlError(f"{self.package_dir / 'environment.toml'}: a Harbor package needs a [sandbox] table")
        self.command_timeout_s = command_timeout_s
        """Wall-clock limit of one bash call."""
        self.verifier_timeout_s = verifier_timeout_s or float(self.manifest.env_args.get("verifier_timeout_s", 120.0))
        """Wall-clock limit of tests/test.sh."""
        self.runtime = runtime
        """Docker runtime ('runc', or 'runsc' for gVisor)."""
        self._live: dict[str, Any] = {}

        async def bash(command: str, sandbox) -> str:
            """Run a shell command in the task's container and return its output.

            Args:
                command: The bash command to run.
            """
            result = await sandbox.exec(command, timeout=self.command_timeout_s)
            output = result.stdout + (("\n" + result.stderr) if result.stderr else "")
            note = " (timed out)" if result.timed_out else ""
            return f"{output.rstrip()}\n[exit code {result.exit_code}{note}]".lstrip()

        rubric = Rubric(funcs=[verifier_reward, verifier_ran], weights=[1.0, 0.0])
        from agentrl.hub.package import build_dataset

        kwargs.setdefault("name", self.manifest.name)
        kwargs.setdefault("splits", build_dataset(self.package_dir, manifest=self.manifest))
        super().__init__(tools=[Tool(bash, hidden=("sandbox",))], rubric=rubric, **kwargs)

    def image(self) -> str:
        """The sandbox image: by digest when the published manifest records one, else by tag."""
        sandbox = self.manifest.sandbox
        if sandbox.digest:
            from agentrl.hub.images import ImageRef, parse_image

            ref = parse_image(sandbox.image)
            return str(ImageRef(ref.registry, ref.repository, None, sandbox.digest))
        return sandbox.image

    def sandbox_config(self):
        from agentrl.sandbox import SandboxConfig

        spec = self.manifest.sandbox
        return SandboxConfig(
            image=self.image(), workdir=spec.workdir, user=spec.user, network=spec.network, runtime=self.runtime,
            cpus=spec.limits.cpus, memory_mb=spec.limits.memory_mb, pids_limit=spec.limits.pids,
            disk_mb=spec.limits.disk_mb, exec_timeout_s=spec.limits.timeout_s,
            max_output_bytes=spec.limits.output_bytes,
            # where a read-only root (tmpfs disk limits) still lets the trial and its verifier write
            writable_paths=["/tmp", "/root", "/home", "/tests", "/logs", "/solution"],
        )

    async def setup_state(self, task: Task) -> dict[str, Any]:
        from agentrl.sandbox import create_sandbox

        sandbox = create_sandbox(self.sandbox_config())
        await sandbox.start()
        key = uuid.uuid4().hex
        self._live[key] = sandbox
        return {"sandbox_key": key}

    def hidden_tool_args(self, tool: Tool, state: dict[str, Any]) -> dict[str, Any]:
        return {"sandbox": self._live[state["sandbox_key"]], "state": state}

    async def run_verifier(self, sandbox, state: dict[str, Any]) -> None:
        """Upload tests/ to /tests, run test.sh, read the reward file into `state`."""
        await sandbox.exec(f"mkdir -p {REWARD_DIR} /tests", timeout=30)
        await sandbox.upload(self.package_dir / "tests", "/tests")
        result = await sandbox.exec("bash /tests/test.sh", timeout=self.verifier_timeout_s, cwd=self.manifest.sandbox.workdir)
        state["verifier_exit_code"] = result.exit_code
        state["verifier_output"] = (result.stdout + result.stderr)[-2000:]
        for name in ("reward.txt", "reward.json"):
            probe = await sandbox.exec(f"cat {shlex.quote(REWARD_DIR + '/' + name)}", timeout=30)
            if probe.exit_code == 0:
                try:
                    state["verifier_reward"] = _parse_reward(probe.stdout, name)
                except (ValueError, IndexError, TypeError) as error:
                    state["verifier_error"] = f"{REWARD_DIR}/{name}: not a number ({error})"
                return
        timed_out = " (timed out)" if result.timed_out else ""
        state["verifier_error"] = f"tests/test.sh wrote no reward to {REWARD_DIR}{timed_out}"

    async def cleanup_state(self, state: dict[str, Any]) -> None:
        sandbox = self._live.pop(state.get("sandbox_key"), None)
        if sandbox is None:
            return
        if state.get("stop_reason") == "error":
            await sandbox.close()
            return
        from agentrl.sandbox.grading import grade_in_fresh_sandbox

        await grade_in_fresh_sandbox(sandbox, lambda fresh: self.run_verifier(fresh, state))


def load_harbor_environment(package_dir: str | Path, **kwargs: Any) -> HarborTaskEnv:
    """The environment of an imported Harbor package (called by the package's entrypoint)."""
    return HarborTaskEnv(package_dir=package_dir, **kwargs)


def harbor_oracle_policy(package_dir: str | Path):
    """A ScriptedPolicy that runs the task's solution/solve.sh through the bash tool, then stops."""
    from agentrl.policies import ScriptedPolicy

    solve = Path(package_dir) / "solution" / "solve.sh"
    if not solve.is_file():
        raise AgentrlError(f"{solve}: this Harbor task has no reference solution")
    call = {"id": "call_oracle", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": solve.read_text()})}}
    return ScriptedPolicy([{"content": "", "tool_calls": [call]}, "done"], name="harbor-oracle")
