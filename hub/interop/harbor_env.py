"""The environment behind packages imported from Harbor tasks (`agentrl env import harbor`).

One rollout = one Harbor trial. A sandbox starts from the task's image with its limits, user
(`[agent] user`, else the image's USER), working directory (`[environment] workdir`, else the
Dockerfile's WORKDIR), `[environment] env` and the agent phase's network; the task's
healthcheck runs; the model works through a `bash` tool until it answers without a tool call
or `[agent] timeout_sec` (a total budget) runs out. Then the verifier runs out of the agent's
reach (`agentrl.sandbox.grading.grade_in_fresh_sandbox`): the agent's working directory is
carried into a fresh sandbox as `[verifier] user`, with its env and network, where `tests/` is
uploaded to `/tests` and `/tests/test.sh` runs (default limit 600 s). The rewards are read from
`/logs/verifier/reward.json` (a number or named numbers) before `reward.txt` (a number), as
Harbor does; the reward is `[metadata] primary_reward`'s key, else `reward`, else the only key,
else their mean; every key becomes a `reward_<key>` metric.

Multi-step tasks (`[[steps]]`): each step's `workdir/` is uploaded and its `setup.sh` run, its
healthcheck checked and its instruction given as a user message; its verifier runs in a fresh
copy while the agent's sandbox stays; `min_reward` ends the trial early; the reward follows
`multi_step_reward_strategy` (per-key mean or the final step's).

The oracle (`harbor_oracle_policy`) is Harbor's: `solution/` (or the step's) is uploaded to
`/solution` and `/solution/solve.sh` is run there with `[solution] env`, limited by the agent
budget, not by `max_tokens` (its tool call is that one short command).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
import shlex
import time
import uuid
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, ConfigError, SandboxError
from agentrl.hub.interop.harbor_config import (
    HarborStep,
    HarborTask,
    NetworkPolicy,
    check_allow_env,
    check_carry_paths,
    read_harbor_task,
    resolve_env,
)
from agentrl.hub.interop.harbor_verifier import (
    allow_apt_as_root,
    below_min_reward,
    drop_user_site_hooks,
    run_verifier,
    settle_rewards,
    verifier_ran,
    verifier_reward,
)
from agentrl.hub.manifest import load_manifest
from agentrl.rubric import Rubric
from agentrl.tool_env import ToolEnv
from agentrl.tools import Tool
from agentrl.types import Message, Rollout, Task

__all__ = ["HarborTaskEnv", "load_harbor_environment", "harbor_oracle_policy"]

SOLUTION_DIR = "/solution"
ORACLE_COMMAND = "/solution/solve.sh"
NO_BUDGET_S = 86_400.0  # a phase Harbor leaves unlimited still ends within a day
_running_oracle: contextvars.ContextVar[bool] = contextvars.ContextVar("harbor_oracle", default=False)


class HarborTaskEnv(ToolEnv):
    """Harbor tasks as a multi-turn bash environment scored by each task's own test script."""

    def __init__(self, *, package_dir: str | Path, command_timeout_s: float = 600.0, runtime: str = "runc",
                 writable_root: str | None = None, carry_paths: str | list[str] | None = None,
                 allow_env: str | list[str] | None = None, sandbox_type: str = "docker", **kwargs: Any) -> None:
        self.package_dir = Path(package_dir)
        self.manifest = load_manifest(self.package_dir)
        if self.manifest.sandbox is None:
            raise AgentrlError(f"{self.package_dir / 'environment.toml'}: a Harbor package needs a [sandbox] "
                               "table")
        self.command_timeout_s = command_timeout_s
        """Most seconds one bash call may take (also bounded by the agent's remaining budget)."""
        self.runtime = runtime
        """Docker runtime ('runc', or 'runsc' for gVisor)."""
        self.sandbox_type = sandbox_type
        """Sandbox backend: 'docker', or 'bwrap' (the task image's tree under bubblewrap, commands as uid 1000)."""
        self.writable_root = writable_root or str(self.manifest.env_args.get("writable_root", "never"))
        """Phases whose sandbox gets a writable root: 'never', 'verifier' or 'always'."""
        if self.writable_root not in ("never", "verifier", "always"):
            raise ConfigError(f"writable_root = {self.writable_root!r}; use 'never', 'verifier' or 'always'")
        carry = carry_paths if carry_paths is not None else str(self.manifest.env_args.get("carry_paths", ""))
        self.carry_paths = check_carry_paths(carry.split(",") if isinstance(carry, str) else carry)
        """Folders besides the working directory carried from the agent's sandbox to the verifier's."""
        allowed = allow_env if allow_env is not None else str(self.manifest.env_args.get("allow_env", ""))
        self.allow_env = check_allow_env(allowed.split(",") if isinstance(allowed, str) else allowed)
        """Host variables the task's `${VAR}` env templates may take (others take their default)."""
        self._live: dict[str, Any] = {}  # sandbox_key -> the agent's sandbox
        self._services: dict[str, Any] = {}  # sandbox_key -> the trial's compose services
        self._rows: dict[str, Task] = {}  # sandbox_key -> the row it plays
        self._tasks: dict[str, HarborTask] = {}

        async def bash(command: str, sandbox, state) -> str:
            """Run a shell command in the task's container and return its output.

            Args:
                command: The bash command to run.
            """
            limit = self._command_limit(state)
            result = await sandbox.exec(command, timeout=limit, env=state.get("command_env"))
            output = result.stdout + (("\n" + result.stderr) if result.stderr else "")
            note = " (timed out)" if result.timed_out else ""
            return f"{output.rstrip()}\n[exit code {result.exit_code}{note}]".lstrip()

        from agentrl.hub.package import build_dataset

        kwargs.setdefault("name", self.manifest.name)
        kwargs.setdefault("splits", build_dataset(self.package_dir, manifest=self.manifest))
        kwargs.setdefault("max_turns", 50)
        rubric = Rubric(funcs=[verifier_reward, verifier_ran], weights=[1.0, 0.0])
        super().__init__(tools=[Tool(bash, hidden=("sandbox", "state"))], rubric=rubric, **kwargs)

    # --- the task and its sandboxes ------------------------------------------------------------
    def harbor_task(self, task: Task) -> HarborTask:
        """The Harbor task behind a row (its folder is `info.harbor_dir`, the package root by default)."""
        folder = str(task.info.get("harbor_dir") or ".")
        if folder not in self._tasks:
            self._tasks[folder] = read_harbor_task(self.package_dir / folder)
        return self._tasks[folder]

    def image(self, task: Task) -> str:
        """The row's image, else the manifest's (by digest when the published manifest records one)."""
        sandbox = self.manifest.sandbox
        if task.info.get("image") and task.info["image"] != sandbox.image:
            return task.info["image"]
        if sandbox.digest:
            from agentrl.hub.images import ImageRef, parse_image

            ref = parse_image(sandbox.image)
            return str(ImageRef(ref.registry, ref.repository, None, sandbox.digest))
        return sandbox.image

    def sandbox_config(self, task: Task, *, phase: str = "agent", step: HarborStep | None = None,
                       docker_network: str | None = None):
        """The SandboxConfig of one phase ('agent' or 'verifier') of a row's trial (on a compose network)."""
        from agentrl.sandbox import SandboxConfig

        harbor = self.harbor_task(task)
        step = step or harbor.steps[0]
        limits = self.manifest.sandbox.limits
        policy = step.agent_network if phase == "agent" else step.verifier_network
        writable = self.writable_root == "always" or self.writable_root == phase == "verifier"
        return SandboxConfig(
            type=self.sandbox_type, image=self.image(task), workdir=harbor.workdir or "/app", runtime=self.runtime,
            user=step.agent_user if phase == "agent" else step.verifier_user,
            network=policy.mode == "public",
            env=resolve_env(harbor.env, where=f"{harbor.folder}: [environment] env", allowed=self.allow_env),
            cpus=harbor.cpus, memory_mb=harbor.memory_mb, pids_limit=limits.pids, disk_mb=harbor.storage_mb,
            disk_limit="none" if writable else "auto", exec_timeout_s=limits.timeout_s,
            docker_network=docker_network,
            max_output_bytes=limits.output_bytes,
            # where a read-only root (tmpfs disk limits) still lets the trial and its verifier write
            writable_paths=["/tmp", "/root", "/home", "/tests", "/logs", SOLUTION_DIR],
        )

    def _network_note(self, policy: NetworkPolicy, phase: str, state: dict[str, Any], *, compose: bool) -> None:
        if compose and policy.mode != "no-network":  # the trial's internal network: its services, no route out
            state.setdefault("network_notes", []).append(
                f"{phase}: network_mode {policy.mode!r} in a compose trial: the sandbox is on the trial's internal "
                "network (its services only), with no route out")
        elif policy.mode == "allowlist":
            state.setdefault("network_notes", []).append(
                f"{phase}: network_mode 'allowlist' ({', '.join(policy.allowed_hosts) or 'no hosts'}) cannot "
                "be enforced by agentrl's sandboxes (no egress filter); this phase runs with no network")

    def _command_limit(self, state: dict[str, Any]) -> float:
        remaining = max(1.0, state.get("deadline", time.monotonic() + NO_BUDGET_S) - time.monotonic())
        return remaining if state.get("oracle") else min(self.command_timeout_s, remaining)

    # --- the trial -----------------------------------------------------------------------------
    async def rollout(self, client, task: Task, *, sampling) -> Rollout:
        token = _running_oracle.set(bool(getattr(client, "runs_harbor_solution", False)))
        try:
            return await super().rollout(client, task, sampling=sampling)
        finally:
            _running_oracle.reset(token)

    async def setup_state(self, task: Task) -> dict[str, Any]:
        harbor = self.harbor_task(task)
        key = uuid.uuid4().hex
        state: dict[str, Any] = {"step": 0, "oracle": _running_oracle.get(), "step_rewards": [],
                                 "sandbox_key": key}
        step = harbor.steps[0]
        self._network_note(step.agent_network, "agent", state, compose=bool(harbor.compose))
        self._rows[key] = task
        try:
            await self._start_trial(task, harbor, state)
        except BaseException:  # the rollout gets no state back: release what started here
            state["stop_reason"] = "error"
            await self.cleanup_state(state)
            raise
        return state

    async def _start_trial(self, task: Task, harbor: HarborTask, state: dict[str, Any]) -> None:
        """The trial's compose services (if any), the agent's sandbox, healthchecks, the first step."""
        from agentrl.sandbox import create_sandbox

        key, step, network = state["sandbox_key"], harbor.steps[0], None
        if harbor.compose:
            from agentrl.hub.interop.harbor_compose import ComposeServices, read_compose

            services = ComposeServices(read_compose(Path(harbor.folder) / harbor.compose)[0],
                                       task_image=self.image(task), runtime=self.runtime, cpus=harbor.cpus,
                                       memory_mb=harbor.memory_mb)
            self._services[key] = services
            network = (await services.start()).network
        sandbox = create_sandbox(self.sandbox_config(task, step=step, docker_network=network))
        self._live[key] = sandbox
        await sandbox.start()
        try:
            await sandbox.exec(["true"], timeout=60)
        except SandboxError as error:
            if self.writable_root == "always":
                raise
            raise SandboxError(f"{error}; if the image's ENTRYPOINT writes to its root filesystem, give it a "
                               "writable root (writable_root = 'always')") from None
        await allow_apt_as_root(sandbox)
        if getattr(sandbox, "network_note", None):
            state.setdefault("network_notes", []).append(f"agent: {sandbox.network_note}")
        if harbor.healthcheck is not None:
            await self._healthcheck(sandbox, harbor.healthcheck, "[environment] healthcheck")
        if harbor.mcp_servers and not state["oracle"]:  # their tools beside bash (the oracle runs solve.sh)
            await self.start_mcp(sandbox, harbor.mcp_servers, state)
        await self._start_step(sandbox, harbor, step, state)

    async def _healthcheck(self, sandbox, check, where: str) -> None:
        """Harbor's healthcheck: failures in the start period do not count; `retries` in a row fail it."""
        start_period_end = time.monotonic() + check.start_period_sec
        failures = 0
        while True:
            in_start_period = time.monotonic() < start_period_end
            result = await sandbox.exec(check.command, timeout=check.timeout_sec)
            if result.ok:
                return
            if not in_start_period:
                failures += 1
                if failures >= check.retries:
                    output = (result.stderr or result.stdout).strip()[-200:]
                    raise AgentrlError(f"{where} failed {check.retries} times in a row: {check.command!r} "
                                       f"(exit code {result.exit_code}: {output})")
            await asyncio.sleep(check.start_interval_sec if in_start_period else check.interval_sec)

    async def _start_step(self, sandbox, harbor: HarborTask, step: HarborStep, state: dict[str, Any]) -> None:
        """Before a step's agent: its workdir files and setup.sh, its healthcheck, the oracle's /solution."""
        folder = Path(harbor.folder) / step.folder
        if harbor.multi_step:
            if (folder / "workdir").is_dir():
                await sandbox.upload(folder / "workdir", sandbox.config.workdir)
                if (folder / "workdir" / "setup.sh").is_file():
                    script = shlex.quote(sandbox.config.workdir.rstrip("/") + "/setup.sh")
                    setup = await sandbox.exec(f"bash {script}", timeout=NO_BUDGET_S)
                    if not setup.ok:
                        raise AgentrlError(f"step {step.name!r}: setup.sh exited with {setup.exit_code}: "
                                           f"{setup.stderr.strip()[-200:]}")
            if step.healthcheck is not None:
                await self._healthcheck(sandbox, step.healthcheck, f"steps {step.name!r} healthcheck")
        state["command_env"] = {}
        if state["oracle"]:
            solution = folder / "solution" if (folder / "solution" / "solve.sh").is_file() else \
                Path(harbor.folder) / "solution"
            if not (solution / "solve.sh").is_file():
                raise AgentrlError(f"{solution / 'solve.sh'}: this Harbor task has no reference solution")
            await sandbox.exec(["/bin/sh", "-c", f"rm -rf {SOLUTION_DIR}/*; mkdir -p {SOLUTION_DIR}"])
            await sandbox.upload(solution, SOLUTION_DIR)
            await sandbox.exec(["chmod", "+x", ORACLE_COMMAND])
            state["command_env"] = {"DEBIAN_FRONTEND": "noninteractive",
                                    **resolve_env(harbor.solution_env, where=f"{harbor.folder}: [solution] env",
                                                  allowed=self.allow_env)}
        if step.agent_timeout_s is not None:
            state["deadline"] = time.monotonic() + step.agent_timeout_s
        else:
            state.pop("deadline", None)

    def hidden_tool_args(self, tool: Tool, state: dict[str, Any]) -> dict[str, Any]:
        return {"sandbox": self._live[state["sandbox_key"]], "state": state}

    async def is_completed(self, messages: list[Message], state: dict[str, Any]) -> bool:
        out_of_time = time.monotonic() >= state.get("deadline", math.inf)
        if out_of_time:
            state.setdefault("agent_timeouts", []).append(state["step"])
        if not (out_of_time or super().is_completed(messages, state)):
            return False
        harbor = self.harbor_task(self._rows[state["sandbox_key"]])
        if state["step"] + 1 >= len(harbor.steps):
            return True
        step = harbor.steps[state["step"]]
        sandbox = self._live[state["sandbox_key"]]
        await self._verify(sandbox, harbor, step, state, keep_agent_sandbox=True)
        if below_min_reward(state["step_rewards"][-1], step.min_reward):
            state["stopped_after_step"] = step.name
            return True
        state["step"] += 1
        await self._start_step(sandbox, harbor, harbor.steps[state["step"]], state)
        state["next_instruction"] = harbor.steps[state["step"]].instruction
        return False

    async def env_response(self, messages: list[Message], state: dict[str, Any]) -> list[Message]:
        instruction = state.pop("next_instruction", None)
        if instruction is not None:
            return [Message(role="user", content=instruction)]
        return await super().env_response(messages, state)

    # --- the verifier --------------------------------------------------------------------------
    async def _verify(self, sandbox, harbor: HarborTask, step: HarborStep, state: dict[str, Any], *,
                      keep_agent_sandbox: bool = False) -> None:
        """Run the step's verifier in a fresh sandbox holding the agent's working directory."""
        from agentrl.sandbox.grading import WorkdirRejected, grade_in_fresh_sandbox

        self._network_note(step.verifier_network, f"verifier {step.name}", state, compose=bool(harbor.compose))
        services = self._services.get(state["sandbox_key"])
        config = self.sandbox_config(self._rows[state["sandbox_key"]], phase="verifier", step=step,
                                     docker_network=services.network if services else None)
        paths = [config.workdir]
        for path in self.carry_paths:  # those the trial has (an agent may never create ~/.config)
            if (await sandbox.exec(["test", "-d", path], timeout=30)).exit_code == 0:
                paths.append(path)
        try:
            await grade_in_fresh_sandbox(sandbox, lambda fresh: run_verifier(fresh, harbor, step, state,
                                                                             allow_env=self.allow_env),
                                         config=config, keep_open=keep_agent_sandbox, paths=paths,
                                         drop=drop_user_site_hooks)
        except WorkdirRejected as error:  # the episode's files broke the carry: its own doing, scored 0
            prefix = f"step {step.name}: " if harbor.multi_step else ""
            state["workdir_rejected"] = True
            state["verifier_error"] = state.get("verifier_error") or f"{prefix}{error}"
            state["tests_ran"] = [*state.get("tests_ran", []), False]
            state["step_rewards"].append(None)

    async def cleanup_state(self, state: dict[str, Any]) -> None:
        await self.stop_mcp(state)
        key = state.get("sandbox_key")
        sandbox = self._live.get(key)
        try:
            if sandbox is None:
                return
            harbor = self.harbor_task(self._rows[key])
            if sandbox.closed or not sandbox.id:  # it never started
                return
            if state.get("stop_reason") == "error" or "stopped_after_step" in state:
                await sandbox.close()
            else:
                await self._verify(sandbox, harbor, harbor.steps[state["step"]], state)
        finally:
            self._live.pop(key, None)
            self._rows.pop(key, None)
            services = self._services.pop(key, None)
            if services is not None:
                await services.close()
        settle_rewards(harbor, state)

    async def score(self, rollouts: list[Rollout]) -> list[Rollout]:
        from agentrl.sandbox.grading import TAMPER_METRIC, WORKDIR_REJECTED_METRIC

        scored = await super().score(rollouts)
        for rollout in scored:
            for key, value in (rollout.state.get("rewards") or {}).items():
                rollout.metrics[f"reward_{key}"] = value
            rollout.metrics["network_unavailable"] = float(bool(rollout.state.get("network_notes")))
            rollout.metrics[TAMPER_METRIC] = float(bool(rollout.state.get("tamper_suspected")))
            rollout.metrics[WORKDIR_REJECTED_METRIC] = float(bool(rollout.state.get("workdir_rejected")))
            rollout.grader_error = rollout.grader_error or rollout.state.get("verifier_error")
        return scored


def load_harbor_environment(package_dir: str | Path, **kwargs: Any) -> HarborTaskEnv:
    """The environment of an imported Harbor package (called by the package's entrypoint)."""
    return HarborTaskEnv(package_dir=package_dir, **kwargs)


def harbor_oracle_policy(package_dir: str | Path):
    """Harbor's oracle: per step one bash call of /solution/solve.sh (solution/ uploaded first), then done."""
    from agentrl.policies import ScriptedPolicy

    package_dir = Path(package_dir)
    folders = {json.loads(line).get("info", {}).get("harbor_dir") or "."
               for line in (package_dir / "data" / "tasks.jsonl").read_text().splitlines() if line.strip()}
    tasks = [read_harbor_task(package_dir / folder) for folder in sorted(folders)]
    if not any((Path(t.folder) / "solution" / "solve.sh").is_file() or any(
            (Path(t.folder) / s.folder / "solution" / "solve.sh").is_file() for s in t.steps) for t in tasks):
        raise AgentrlError(f"{package_dir}: no Harbor task here has a reference solution (solution/solve.sh)")
    call = {"id": "call_oracle", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": ORACLE_COMMAND})}}
    steps = max(len(task.steps) for task in tasks)
    policy = ScriptedPolicy([{"content": "", "tool_calls": [call]}, "done"] * steps, name="harbor-oracle")
    policy.runs_harbor_solution = True  # HarborTaskEnv uploads solution/ to /solution for its rollouts
    return policy
