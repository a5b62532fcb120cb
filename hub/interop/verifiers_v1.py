"""verifiers v1 Tasksets (verifiers >= 0.4) as agentrl Environments.

`VerifiersTasksetEnv` runs a package's `vf.Taskset` the way verifiers' own rollout does, with
agentrl in the harness's seat:

- rows: the taskset's tasks in `load()` order (its config built from the caller's keyword
  arguments), each a row whose prompt is what verifiers' harnesses send (the task's
  `system_prompt` as a system message, then its `prompt`); `info` keeps the task's idx, key and
  wire data. A taskset has no splits, so `train` and `test` are both the whole taskset.
- episodes: agentrl's chat loop plays the harness. `harness="null"` (default) is verifiers'
  `null` harness for a task without tools: the model answers the prompt. `harness="bash"`
  (default when a task needs a container) is modelled on verifiers' `bash` harness: one `bash`
  tool whose commands run in the task's runtime.
- runtime: a task that needs one (`NEEDS_CONTAINER`, an `image`, setup/finalize/stage_verifier
  hooks, a scoring hook taking `runtime`, or the bash harness) gets an agentrl sandbox behind
  verifiers' `Runtime` interface (`SandboxRuntime`): `image`, `workdir` and `resources` from
  the task data, network off. `setup(trace, runtime)` runs before the first model call,
  `finalize` after the agent's processes are killed; then the workdir is carried into a fresh
  sandbox (`agentrl.sandbox.grading`), where `stage_verifier` and scoring run.
- rewards: the rollout becomes a verifiers `Trace` (its messages as the message graph, one
  `ModelCall` per model turn) and verifiers' own `Task.score(trace, runtime)` runs the task's
  `@vf.reward`/`@vf.metric` methods and config-plugged functions; the reward is
  `trace.reward` (sum of score x weight), every reward and metric lands in the metrics.

`SandboxRuntime` and the rollout-to-`Trace` conversion are in `verifiers_v1_bridge.py`.

Refused in one line at load time: MCP toolsets (taskset or task), infinite tasksets without
`max_tasks`, `agent_user`, GPU resources. `@vf.stop`/`@vf.intercept` hooks do not run
(agentrl's budgets end episodes).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import uuid
from dataclasses import dataclass
from typing import Any

from agentrl.errors import AgentrlError
from agentrl.hub.interop.verifiers_legacy import from_vf_message
from agentrl.hub.interop.verifiers_v1_bridge import build_trace, fill_trace, sandbox_runtime_class
from agentrl.hub.interop.verifiers_v1_env import finalize_episode, has_finalize
from agentrl.hub.interop.verifiers_v1_hooks import HookedEpisode, has_boundary_hooks
from agentrl.rubric import Rubric
from agentrl.sampling import ChatClient, SamplingConfig
from agentrl.tool_env import ToolEnv
from agentrl.tools import Tool
from agentrl.types import Rollout, Task

# build_trace, fill_trace and sandbox_runtime_class are defined in verifiers_v1_bridge.
__all__ = ["BASH_SYSTEM_PROMPT", "VerifiersTasksetEnv", "build_trace", "fill_trace", "sandbox_runtime_class"]

TASK_KEY = "verifiers_task"
_LIVE_KEY = "verifiers_rollout"
_ADAPTER_OPTIONS = ("harness", "sandbox", "max_turns", "max_tasks")
BASH_SYSTEM_PROMPT = "You work as a coding agent: a bash tool runs your shell commands."
_HOOKS = ("setup", "finalize", "stage_verifier")



def _takes_runtime(func: Any) -> bool:
    param = inspect.signature(func).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _prompt_messages(data: Any, extra_system: str | None) -> list[dict[str, Any]]:
    system = "\n\n".join(text for text in (extra_system, data.system_prompt) if text) or None
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [from_vf_message(message).model_dump(exclude_none=True) for message in data.prompt or []]
    return messages


@dataclass
class _Live:
    """What one rollout holds while it runs (not serialisable, so kept off Rollout.state)."""

    vf_task: Any
    trace: Any
    sandbox: Any = None
    runtime: Any = None
    hooks: Any = None
    """The task's @vf.stop / @vf.intercept hooks in verifiers' RolloutSession (`verifiers_v1_hooks`), or None."""


async def bash(command: str, sandbox: Any) -> str:
    """Run a bash command and return its combined stdout and stderr.

    Args:
        command: The bash command to run.
    """
    result = await sandbox.exec(["bash", "-c", command])
    return result.stdout + result.stderr


class VerifiersTasksetEnv(ToolEnv):
    """A verifiers v1 Taskset: its tasks as rows, agentrl's loop as the harness, verifiers' own scoring."""

    def __init__(
        self,
        *,
        name: str,
        taskset: Any,
        harness: str | None = None,
        sandbox: dict[str, Any] | None = None,
        max_turns: int = 10,
        max_tasks: int | None = None,
        vf_env: Any = None,
    ) -> None:
        self.vf_env = vf_env
        """The package's exported vf.Env (`verifiers_v1_env.resolve_env`: its finalize runs), or None."""
        try:
            tasks = list(taskset.take(max_tasks) if max_tasks is not None else _bounded(taskset, name))
        except AgentrlError:
            raise
        except Exception as error:  # the package's own load(): one line that names it
            raise AgentrlError(f"verifiers taskset {name!r}: loading its tasks failed: "
                               f"{' '.join(f'{type(error).__name__}: {error}'.split())}") from None
        if not tasks:
            raise AgentrlError(f"verifiers taskset {name!r}: load() yielded no tasks")
        _refuse_unsupported(name, taskset, tasks)
        self._shared_toolsets = taskset.toolsets(taskset.config)
        """The taskset's MCP toolsets (one instance for every rollout; `verifiers_v1_toolsets`)."""
        self._has_toolsets = bool(self._shared_toolsets) or any(type(t).toolsets(t.config) for t in tasks[:1])
        self._shared_servers: list[tuple[Any, Any]] | None = None
        self._serving = asyncio.Lock()
        needs = any(self._needs_runtime(task) for task in tasks)
        self.harness = harness or ("bash" if needs else "null")
        """`null` (the model answers) or `bash` (one bash tool in the task's runtime)."""
        if self.harness not in ("null", "bash"):
            raise AgentrlError(
                f"verifiers taskset {name!r}: harness must be 'null' or 'bash', got {self.harness!r}"
            )
        from agentrl.sandbox.base import SandboxConfig

        try:
            self.sandbox_config = SandboxConfig.model_validate(sandbox or {})
        except ValueError as error:
            raise AgentrlError(
                f"verifiers taskset {name!r}: bad sandbox option: {' '.join(str(error).split())}"
            ) from None
        self.vf_tasks = tasks
        tools = [Tool(bash, hidden=("sandbox",))] if self.harness == "bash" else []
        super().__init__(
            name=name,
            splits={"train": self._rows, "test": self._rows},
            rubric=Rubric(),
            tools=tools,
            max_turns=max_turns if self.harness == "bash" or self._has_toolsets else 1,
        )
        self._live: dict[str, _Live] = {}

    @classmethod
    def from_package(
        cls, taskset_class: type | None, env_class: type | None, *, module: str, name: str, options: dict[str, Any]
    ) -> VerifiersTasksetEnv:
        """The package's exported Taskset, or its exported Env over it (verifiers pairs them by the module),
        as an agentrl Environment."""
        if env_class is None:
            return cls.from_class(taskset_class, name=name, options=options)
        from agentrl.hub.interop.verifiers_v1_env import resolve_env

        adapter = {key: options.pop(key) for key in list(options) if key in _ADAPTER_OPTIONS}
        vf_env, seat = resolve_env(env_class, module, name=name, options=options)
        if seat.harness is not None:
            adapter.setdefault("harness", seat.harness.id)
        if seat.max_turns is not None:
            adapter.setdefault("max_turns", seat.max_turns)
        return cls(name=name, taskset=vf_env.taskset, vf_env=vf_env, **adapter)

    @classmethod
    def from_class(cls, taskset_class: type, *, name: str, options: dict[str, Any]) -> VerifiersTasksetEnv:
        """Build the taskset from its config type (verifiers' own resolution) and the caller's options."""
        from verifiers.v1 import Taskset, TasksetConfig
        from verifiers.v1.utils.generic import concrete_type

        config_type = concrete_type(taskset_class, TasksetConfig, origin=Taskset) or TasksetConfig
        fields = set(getattr(config_type, "model_fields", {}))
        adapter = {
            key: options.pop(key) for key in list(options) if key in _ADAPTER_OPTIONS and key not in fields
        }
        try:
            config = config_type.model_validate(options)
        except ValueError as error:
            problem = " ".join(str(error).split())
            raise AgentrlError(
                f"verifiers taskset {name!r}: bad options for {config_type.__name__}: {problem}"
            ) from None
        return cls(name=name, taskset=taskset_class(config), **adapter)

    # ----- rows ---------------------------------------------------------------------------------
    def _rows(self) -> list[dict[str, Any]]:
        extra = BASH_SYSTEM_PROMPT if self.harness == "bash" else None
        rows = []
        for position, vf_task in enumerate(self.vf_tasks):
            data = vf_task.data
            answer = getattr(data, "answer", "")
            rows.append(
                {
                    "prompt": _prompt_messages(data, extra),
                    "answer": answer if isinstance(answer, str) else json.dumps(answer),
                    "task": type(vf_task).__name__,
                    "example_id": data.id if data.id is not None else data.idx,
                    "info": {
                        TASK_KEY: position,
                        "key": vf_task.key,
                        "data": data.model_dump(mode="json", exclude_none=True),
                    },
                }
            )
        return rows

    @staticmethod
    def _needs_runtime(vf_task: Any) -> bool:
        from verifiers.v1 import Task as VfTask

        if vf_task.NEEDS_CONTAINER or vf_task.data.image:
            return True
        if any(getattr(type(vf_task), hook) is not getattr(VfTask, hook) for hook in _HOOKS):
            return True
        return any(_takes_runtime(func) for kind in ("reward", "metric") for func in vf_task.hooks(kind))

    def _sandbox_spec(self, vf_task: Any) -> Any:
        data, update = vf_task.data, {}
        if data.image:
            update["image"] = data.image
        if data.workdir:
            update["workdir"] = data.workdir
        if data.resources.cpu:
            update["cpus"] = float(data.resources.cpu)
        if data.resources.memory:
            update["memory_mb"] = int(data.resources.memory * 1024)
        if data.resources.disk:
            update["disk_mb"] = int(data.resources.disk * 1024)
        return self.sandbox_config.model_copy(update=update)

    # ----- episodes -----------------------------------------------------------------------------
    def hidden_tool_args(self, tool: Tool, state: dict[str, Any]) -> dict[str, Any]:
        return {"sandbox": self._live[state[_LIVE_KEY]].sandbox, "state": state}

    async def setup_state(self, task: Task) -> dict[str, Any]:
        position = task.info.get(TASK_KEY)
        if not isinstance(position, int) or not 0 <= position < len(self.vf_tasks):
            raise AgentrlError(
                f"environment {self.name!r}: task info has no {TASK_KEY!r} index of this taskset"
            )
        from verifiers.v1.utils.decorators import invoke

        vf_task = self.vf_tasks[position]
        live = _Live(vf_task=vf_task, trace=build_trace(vf_task))
        if has_boundary_hooks(vf_task):
            live.hooks = HookedEpisode(vf_task, live.trace, tools=self.tool_schemas)
            live.hooks.prompt_len = len(task.prompt)
        try:
            if self.harness == "bash" or self._needs_runtime(vf_task):
                from agentrl.sandbox import create_sandbox

                live.sandbox = create_sandbox(self._sandbox_spec(vf_task))
                await live.sandbox.start()
                live.runtime = sandbox_runtime_class()(live.sandbox)
            async with asyncio.timeout(vf_task.data.timeout.setup):
                await invoke(vf_task.setup, {"trace": live.trace, "runtime": live.runtime})
        except BaseException:
            if live.sandbox is not None:
                await live.sandbox.close()
            raise
        key = uuid.uuid4().hex
        self._live[key] = live
        state = {_LIVE_KEY: key}
        if self._has_toolsets:
            try:
                await self._attach_toolsets(vf_task, state)
            except BaseException:
                self._live.pop(key, None)
                if live.sandbox is not None:
                    await live.sandbox.close()
                raise
        return state

    async def _attach_toolsets(self, vf_task: Any, state: dict[str, Any]) -> None:
        """The rollout's MCP session: the taskset's toolsets (served once) and fresh instances of the task's."""
        from agentrl.hub.interop.verifiers_v1_toolsets import ToolsetMcp

        async with self._serving:
            if self._shared_servers is None:
                self._shared_servers = [(t, await ToolsetMcp.serve(t)) for t in self._shared_toolsets]
        session = ToolsetMcp(self._shared_servers, type(vf_task).toolsets(vf_task.config))
        try:
            await session.start(vf_task)
        except BaseException:
            await session.aclose()
            raise
        await self.attach_mcp(session, state)

    async def cleanup_state(self, state: dict[str, Any]) -> None:
        await self.stop_mcp(state)

    async def before_model_call(self, messages: list[Any], state: dict[str, Any]) -> str | None:
        live = self._live.get(state.get(_LIVE_KEY))
        return None if live is None or live.hooks is None else await live.hooks.before_call(messages)

    async def is_completed(self, messages: list[Any], state: dict[str, Any]) -> bool:
        live = self._live.get(state.get(_LIVE_KEY))
        if live is not None and live.hooks is not None:
            stopped = await live.hooks.after_call(messages)
            if stopped is not None:
                state["stop_reason"] = stopped
                return True
        return super().is_completed(messages, state)

    async def call_tool(self, call: Any, state: dict[str, Any]) -> str:
        live = self._live.get(state.get(_LIVE_KEY))
        verdict = None if live is None or live.hooks is None else live.hooks.verdict(call.id)
        return verdict if verdict is not None else await super().call_tool(call, state)

    async def rollout(self, client: ChatClient, task: Task, *, sampling: SamplingConfig) -> Rollout:
        rollout = await super().rollout(client, task, sampling=sampling)
        live = self._live.pop(rollout.state.get(_LIVE_KEY), None)
        if live is None:
            return rollout
        if live.hooks is not None and live.trace.stop_condition is not None:  # a @vf.stop ended it
            rollout.state["stop_reason"] = live.trace.stop_condition
        try:
            if rollout.error is None:
                await self._finish(live, rollout)
        except Exception as exc:  # noqa: BLE001 - a scoring failure is the rollout's error, never a crash
            rollout.error = f"verifiers scoring failed: {type(exc).__name__}: {exc}"
        finally:
            if live.sandbox is not None and not live.sandbox.closed:
                await live.sandbox.close()
        return rollout

    async def _finish(self, live: _Live, rollout: Rollout) -> None:
        """Finalize, then score with verifiers' own Task.score (in a fresh sandbox if there is a runtime)."""
        from verifiers.v1.utils.decorators import invoke

        trace, vf_task, data = live.trace, live.vf_task, live.vf_task.data
        fill_trace(trace, rollout)

        async def score(runtime: Any) -> None:
            if runtime is not None:
                await invoke(vf_task.stage_verifier, {"trace": trace, "runtime": runtime})
            async with asyncio.timeout(data.timeout.scoring):
                await vf_task.score(trace, runtime)

        if live.sandbox is None:
            await invoke(vf_task.finalize, {"trace": trace, "runtime": None})
            await score(None)
        else:
            from agentrl.sandbox.grading import WorkdirRejected, grade_in_fresh_sandbox

            await live.sandbox.kill_processes()
            async with asyncio.timeout(data.timeout.finalize):
                await invoke(vf_task.finalize, {"trace": trace, "runtime": live.runtime})

            async def grade(fresh: Any) -> None:
                await score(sandbox_runtime_class()(fresh))

            try:
                await grade_in_fresh_sandbox(live.sandbox, grade)
            except WorkdirRejected as error:  # the episode's files broke the carry: its own doing, scored 0
                rollout.state["workdir_rejected"] = str(error)
                trace.rewards.clear()
        if has_finalize(self.vf_env) and "workdir_rejected" not in rollout.state:
            await finalize_episode(self.vf_env, vf_task, trace)  # after scoring, as verifiers' Env.run_episode
        rollout.state["verifiers_rewards"] = {
            name: None if value is None else {"score": value.score, "weight": value.weight}
            for name, value in trace.rewards.items()
        }
        rollout.state["verifiers_metrics"] = dict(trace.metrics)

    async def score(self, rollouts: list[Rollout]) -> list[Rollout]:
        """Each rollout's verifiers scores (computed at the end of its episode, as verifiers does)."""
        from agentrl.sandbox.grading import WORKDIR_REJECTED_METRIC

        for rollout in rollouts:
            rewards = rollout.state.get("verifiers_rewards") or {}
            for name, value in rewards.items():
                rollout.metrics[name] = 0.0 if value is None else float(value["score"])
            for name, value in (rollout.state.get("verifiers_metrics") or {}).items():
                rollout.metrics[name] = 0.0 if value is None else float(value)
            rollout.reward = sum(
                value["score"] * value["weight"] for value in rewards.values() if value is not None
            )
            if "workdir_rejected" in rollout.state:
                rollout.reward, rollout.metrics[WORKDIR_REJECTED_METRIC] = 0.0, 1.0
            if rollout.error is not None:
                rollout.reward, rollout.metrics["rollout_error"] = 0.0, 1.0
        return rollouts


def _bounded(taskset: Any, name: str) -> Any:
    if not taskset.bounded:
        raise AgentrlError(
            f"verifiers taskset {name!r} is infinite; pass max_tasks=N to take its first N tasks"
        )
    return taskset


def _refuse_unsupported(name: str, taskset: Any, tasks: list[Any]) -> None:
    """One-line refusals of what agentrl cannot run faithfully."""
    from agentrl.hub.interop.verifiers_v1_toolsets import refuse_toolsets

    refuse_toolsets(name, [*taskset.toolsets(taskset.config), *(
        toolset for task in tasks[:1] for toolset in type(task).toolsets(task.config))])
    from urllib.parse import urlsplit

    for judge in getattr(tasks[0].config, "judges", None) or []:
        if urlsplit(judge.base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise AgentrlError(
                f"verifiers taskset {name!r}: its tasks plug the judge "
                f"{judge.name or judge.id or type(judge).__name__!r} "
                f"(model {judge.model!r} at {judge.base_url}), which agentrl's scoring cannot reach (no network); "
                "point the judge's base_url at a server on 127.0.0.1 to run it"
            )
    for vf_task in tasks:
        data = vf_task.data
        if not data.prompt:
            raise AgentrlError(
                f"verifiers taskset {name!r}: task {data.idx} has no prompt (verifiers opens such a task through a "
                "user or an interaction), which agentrl does not run: its rollouts would start from an empty "
                "conversation"
            )
        if data.agent_user:
            raise AgentrlError(
                f"verifiers taskset {name!r}: task {data.idx} sets agent_user={data.agent_user!r}; "
                "agentrl sandboxes run every command as one user: set sandbox={'user': ...} instead"
            )
        if data.resources.gpu:
            raise AgentrlError(
                f"verifiers taskset {name!r}: task {data.idx} asks for GPU {data.resources.gpu!r}; "
                "agentrl sandboxes have no GPUs"
            )
