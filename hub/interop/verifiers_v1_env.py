"""A v1 package's exported `vf.Env`: what agentrl runs with verifiers' semantics, what it refuses in one line.

verifiers pairs a taskset with the `Env` subclass its package exports (else `SingleAgentEnv`): the Env
decides how one task becomes one episode (`run(task, agents)`), judges the finished episode
(`finalize(task, episode)`: `record_reward` / `record_metric` on its traces) and may own resources
(`setup`, `start`/`stop`). agentrl trains one policy on one token sequence per rollout, so:

- run: an Env whose episode is one agent seat playing the task as `SingleAgentEnv` plays it (its
  `run` not overridden) runs in agentrl's loop; its `finalize` runs after the trace is scored, on an
  `Episode` holding that trace, and what it records counts in the reward as in verifiers;
- refused at load, one line each: several seats (a user simulator: a seat named `user` or a
  `UserSimEnv`; otherwise a multi-agent Env), an overridden `run` (extra turns, interactions),
  `setup` / `start` / `stop` overrides, and a seat whose harness is not `null` or `bash` (a
  third-party agent program such as codex: agentrl's loop is the harness).

`resolve_env` builds the Env as verifiers' loader does (`EnvClass(EnvConfig(taskset={"id": module}))`,
its taskset and harness configs resolved by verifiers) and returns it with its one seat's config.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentrl.errors import AgentrlError

__all__ = ["finalize_episode", "resolve_env"]

HARNESSES = ("null", "bash")


def _overrides(env_class: type, base: type, method: str) -> bool:
    return getattr(env_class, method) is not getattr(base, method)


def resolve_env(env_class: type, module: str, *, name: str, options: dict[str, Any]) -> tuple[Any, Any]:
    """The package's Env built by verifiers' rules, and its one seat's AgentConfig; refusals as one line."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.env import EnvConfig
    from verifiers.v1.envs.user_sim import UserSimEnv
    from verifiers.v1.utils.generic import concrete_type

    label = f"verifiers package {name!r}: its Env {env_class.__name__}"
    config_type = concrete_type(env_class, EnvConfig, origin=vf.Env) or EnvConfig
    env_fields = {key: options.pop(key) for key in list(options) if key in config_type.model_fields}
    try:
        config = config_type.model_validate({**env_fields, "taskset": {"id": module, **options}})
        env = env_class(config)
    except (TypeError, ValueError) as error:
        raise AgentrlError(f"{label} could not be built: {' '.join(str(error).split())}") from None
    seats = env._agent_specs
    if len(seats) > 1:
        if issubclass(env_class, UserSimEnv) or "user" in seats:
            raise AgentrlError(f"{label} has a user simulator (seats: {', '.join(seats)}), which agentrl does not "
                               "run: an agentrl rollout is one policy's conversation; write the user's turns as "
                               "an agentrl MultiTurnEnv.env_response")
        raise AgentrlError(f"{label} is a multi-agent Env (seats: {', '.join(seats)}), which agentrl does not run: "
                           "an agentrl rollout is one policy's token sequence")
    (seat, spec), = seats.items()
    harness = env._harnesses[seat].config.id
    if harness not in HARNESSES:
        raise AgentrlError(f"{label} runs the harness {harness!r} (a third-party agent program), which agentrl "
                           "does not run: agentrl's loop is the harness (null or bash)")
    if _overrides(env_class, vf.SingleAgentEnv if issubclass(env_class, vf.SingleAgentEnv) else vf.Env, "run"):
        raise AgentrlError(f"{label} overrides run() (its own turns or interactions), which agentrl does not run: "
                           "an episode is the task's prompt and agentrl's loop")
    for hook in ("setup", "start", "stop"):
        if _overrides(env_class, vf.Env, hook):
            raise AgentrlError(f"{label} overrides {hook}(), which agentrl does not run")
    return env, spec


def has_finalize(env: Any) -> bool:
    import verifiers.v1 as vf

    return env is not None and _overrides(type(env), vf.Env, "finalize")


async def finalize_episode(env: Any, vf_task: Any, trace: Any) -> None:
    """`env.finalize(task, episode)` on an Episode of the one scored trace, under the Env's finalize timeout."""
    from verifiers.v1.episode import EnvInfo, Episode
    from verifiers.v1.trace import TraceTask

    episode = Episode(
        env=EnvInfo(id=env.config.env_id),
        task=TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash),
        traces=[trace],
    )
    async with asyncio.timeout(env.config.timeout.finalize):
        await env.finalize(vf_task, episode)
