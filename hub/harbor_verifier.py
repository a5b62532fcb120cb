"""The Harbor verifier as Harbor runs it, and the rewards as Harbor reads them.

`run_verifier` runs in the fresh sandbox `grade_in_fresh_sandbox` gives (the agent's working
directory, the verifier phase's user, env and network): `tests/` (then the step's own) uploaded
to `/tests`, `/tests/test.sh` run directly with `[verifier] env` and its timeout, then
`/logs/verifier/reward.json` read before `reward.txt` (`parse_rewards`). `combine_rewards` makes
the one reward (the `primary` key, else `reward`, else the only key, else the mean);
`settle_rewards` combines a multi-step trial's steps (Harbor's per-key mean, or the final step's);
`below_min_reward` is Harbor's `min_reward` gate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from agentrl.hub.harbor_config import HarborStep, HarborTask, resolve_env

__all__ = ["REWARD_DIR", "parse_rewards", "combine_rewards", "run_verifier", "settle_rewards",
           "below_min_reward", "verifier_reward", "verifier_ran", "allow_apt_as_root"]

REWARD_DIR = "/logs/verifier"
# Root commands in agentrl's sandboxes hold no capabilities, so apt cannot drop to its `_apt` user
# (setgroups): where the root is writable, apt is told to stay root, and `apt-get install` works as in Harbor.
_APT_AS_ROOT = ("[ -d /etc/apt/apt.conf.d ] && [ \"$(id -u)\" = 0 ] && "
                "echo 'APT::Sandbox::User \"root\";' > /etc/apt/apt.conf.d/00agentrl-sandbox; true")


async def allow_apt_as_root(sandbox) -> None:
    """On a writable root, let apt run as root (it cannot setgroups to `_apt` without capabilities)."""
    if sandbox.config.disk_limit == "none":
        await sandbox.exec(["/bin/sh", "-c", _APT_AS_ROOT], timeout=30)


def parse_rewards(text: str, name: str) -> dict[str, float]:
    """The rewards of reward.json (a number or named numbers) or reward.txt (a number); else ValueError."""
    if not text.strip():
        raise ValueError("the file is empty")
    if name.endswith(".json"):
        data = json.loads(text)
        rewards = data if isinstance(data, dict) else {"reward": data}
    else:
        rewards = {"reward": float(text.strip())}
    for key, value in rewards.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{key} = {value!r} is not a finite number")
    return {str(key): float(value) for key, value in rewards.items()}


def combine_rewards(rewards: dict[str, float], primary: str | None) -> float:
    """The one reward: the `primary` key, else 'reward', else the only key, else the mean of all."""
    if not rewards:
        return 0.0
    for key in (primary, "reward"):
        if key and key in rewards:
            return rewards[key]
    return sum(rewards.values()) / len(rewards)


def verifier_reward(state: dict[str, Any]) -> float:
    """The reward the task's verifier wrote (0.0 when it wrote none)."""
    return float(state.get("verifier_reward") or 0.0)


def verifier_ran(state: dict[str, Any]) -> float:
    """1.0 when every verifier that ran produced a readable reward (a metric)."""
    return 0.0 if state.get("verifier_error") else 1.0


async def run_verifier(sandbox, harbor: HarborTask, step: HarborStep,
                       state: dict[str, Any]) -> None:
    """Upload tests/ (then the step's) to /tests, run /tests/test.sh, read the rewards into `state`."""
    if getattr(sandbox, "network_note", None):
        state.setdefault("network_notes", []).append(f"verifier {step.name}: {sandbox.network_note}")
    await sandbox.exec(["/bin/sh", "-c", f"mkdir -p {REWARD_DIR} /tests && "
                        f"rm -f {REWARD_DIR}/reward.json {REWARD_DIR}/reward.txt"], timeout=30)
    sources = [Path(harbor.folder) / "tests", Path(harbor.folder) / step.folder / "tests"]
    for source in dict.fromkeys(sources):
        if source.is_dir():
            await sandbox.upload(source, "/tests")
    await sandbox.exec(["chmod", "+x", "/tests/test.sh"], timeout=30)
    await allow_apt_as_root(sandbox)
    env = resolve_env(step.verifier_env, where=f"{harbor.folder}: [verifier] env")
    result = await sandbox.exec("/tests/test.sh", timeout=step.verifier_timeout_s, env=env)
    state["verifier_exit_code"] = result.exit_code
    state["verifier_output"] = (result.stdout + result.stderr)[-2000:]
    rewards, error = None, None
    for name in ("reward.json", "reward.txt"):
        probe = await sandbox.exec(["cat", f"{REWARD_DIR}/{name}"], timeout=30)
        if probe.exit_code == 0:
            try:
                rewards = parse_rewards(probe.stdout, name)
            except ValueError as problem:
                error = f"{REWARD_DIR}/{name}: {problem}"
            break
    else:
        timed_out = f" (timed out after {step.verifier_timeout_s:g} s)" if result.timed_out else ""
        error = f"tests/test.sh wrote no reward to {REWARD_DIR}{timed_out}"
    if error:
        prefix = f"step {step.name}: " if harbor.multi_step else ""
        state["verifier_error"] = state.get("verifier_error") or prefix + error
    state["step_rewards"].append(rewards)


def settle_rewards(harbor: HarborTask, state: dict[str, Any]) -> None:
    """The trial's rewards from its steps' (Harbor's per-key mean or the final step's), and the reward."""
    steps = state.get("step_rewards")
    if not steps:
        return
    if harbor.reward_strategy == "final" or len(steps) == 1:
        rewards = steps[-1] or {}
    else:
        counted = [step for step in steps if step is not None]
        keys = sorted({key for step in counted for key in step})
        rewards = {key: sum(step.get(key, 0.0) for step in counted) / len(counted) for key in keys}
    state["rewards"] = rewards
    state["verifier_reward"] = combine_rewards(rewards, harbor.primary_reward)


def below_min_reward(rewards: dict[str, float] | None, minimum: float | dict[str, float] | None) -> bool:
    """Harbor's min_reward: a float gates the 'reward' key, a table each of its keys (missing = -inf)."""
    if minimum is None:
        return False
    thresholds = minimum if isinstance(minimum, dict) else {"reward": minimum}
    return any((rewards or {}).get(key, -math.inf) < value for key, value in thresholds.items())
