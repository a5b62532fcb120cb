"""Harbor trials in real Docker sandboxes under runc and gVisor.

The project's Harbor tasks (tests/integration/harbor_tasks.py) are imported as one dataset
package; each oracle (Harbor's: solution/ in /solution, solve.sh run there) scores 1 and a
do-nothing policy 0, with named rewards, users, workdir, env, healthcheck, two steps, a compose
service and each network mode as the tasks declare them. Then the opt-in writable root for the
verifier and the agent's total time budget."""

from __future__ import annotations

import json

import harbor_tasks
import pytest
from sandbox_backends import DOCKER_BACKENDS

from agentrl.sampling import SamplingConfig
from tests.fakes.hub_fixtures import docker_client  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def bash_call(command: str) -> dict:
    function = {"name": "bash", "arguments": json.dumps({"command": command})}
    return {"content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": function}]}


@pytest.fixture(scope="module")
def harbor_packages(tmp_path_factory, docker_client):  # noqa: F811
    """The fixture tasks as one dataset package (images built), and the install task as its own package."""
    from agentrl.hub.interop.harbor import build_harbor_images, import_harbor_task
    from agentrl.sandbox.base_image import build_base_image

    build_base_image()
    root = tmp_path_factory.mktemp("harbor")
    dataset = root / "dataset"
    harbor_tasks.named(dataset / "named")
    harbor_tasks.steps(dataset / "steps")
    for mode in ("public", "no-network", "allowlist"):
        harbor_tasks.network(dataset / f"net-{mode}", mode)
    harbor_tasks.slow(dataset / "slow")
    harbor_tasks.compose(dataset / "compose")
    harbor_tasks.compose(dataset / "compose-public", network="public")
    harbor_tasks.mcp_compose(dataset / "mcp-compose")
    harbor_tasks.home(dataset / "home")
    package = import_harbor_task(dataset, out=root / "pkg", name="harbor-fixtures", log=lambda line: None)
    installs = import_harbor_task(harbor_tasks.installs(root / "installs"), out=root / "installs-pkg",
                                  name="harbor-installs")
    starts = import_harbor_task(harbor_tasks.entrypoint(root / "entrypoint"), out=root / "entrypoint-pkg",
                                name="harbor-entrypoint")
    images = build_harbor_images(package) + build_harbor_images(installs) + build_harbor_images(starts)
    yield package, installs, starts
    for image in images:
        docker_client.images.remove(image, force=True)


def _rows(env):
    return {task.info["harbor_task"].split("/")[-1]: task for task in env.tasks("train")}


@pytest.mark.parametrize("backend", DOCKER_BACKENDS)
async def test_oracles_score_one_and_idle_policies_zero(backend, harbor_packages):
    import agentrl
    from agentrl.hub.interop.harbor_env import harbor_oracle_policy
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    package, _, _ = harbor_packages
    env = agentrl.load_environment(package, runtime=backend["runtime"])
    rows = _rows(env)
    oracle, idle = harbor_oracle_policy(package), ScriptedPolicy(["I did nothing."] * 2)
    sampling = SamplingConfig()
    names = ["named-rewards", "two-steps", "net-public", "net-no-network", "net-allowlist"]

    async def both(name):
        [solved] = await env.run_group(oracle, rows[name], n=1, sampling=sampling)
        [nothing] = await env.run_group(idle, rows[name], n=1, sampling=sampling)
        return solved, nothing

    results = {name: await both(name) for name in names}  # one trial at a time: a small shared machine
    for name, (solved, nothing) in results.items():
        assert solved.error is None and solved.reward == 1.0, (name, solved.error,
                                                                solved.state.get("verifier_output"))
        assert nothing.error is None and nothing.reward == 0.0, (name, nothing.error, nothing.state)
        assert solved.metrics["verifier_ran"] == 1.0 and "verifier_error" not in solved.state

    named, idle_named = results["named-rewards"]
    # reward.json (named, 'correctness' primary) wins over the stale reward.txt of 0; every key is a metric
    assert named.state["rewards"] == {"correctness": 1.0, "agent_user": 1.0, "verifier_root": 1.0,
                                      "host_env": 1.0}
    assert named.metrics["reward_agent_user"] == 1.0 and named.metrics["reward_verifier_root"] == 1.0
    assert idle_named.state["rewards"]["correctness"] == 0.0
    assert idle_named.metrics["reward_verifier_root"] == 1.0
    [call] = named.messages[-3].tool_calls
    assert call.function.arguments == json.dumps({"command": "/solution/solve.sh"})

    steps, idle_steps = results["two-steps"]
    assert steps.state["step_rewards"] == [{"reward": 1.0}, {"reward": 1.0}]
    user_messages = [m.content for m in steps.messages if m.role == "user"]
    assert user_messages[1].startswith("Append the content of seed.txt")
    assert idle_steps.state["stopped_after_step"] == "write"  # min_reward = 1.0 ends the trial after step one
    assert idle_steps.state["step_rewards"] == [{"reward": 0.0}]

    public, _ = results["net-public"]
    assert public.state["rewards"]["had_network"] == 0.0  # the verifier phase declares no-network
    for mode in ("net-public", "net-allowlist"):
        solved = results[mode][0]
        if solved.metrics["network_unavailable"]:  # this machine cannot give it: the rollout says why
            notes = solved.state["network_notes"]
            assert any("gives sandboxes none" in n or "cannot be enforced" in n for n in notes), notes
    assert any("allowlist" in note for note in results["net-allowlist"][0].state["network_notes"])
    assert results["net-no-network"][0].metrics["network_unavailable"] == 0.0
    assert results["net-no-network"][0].state["rewards"]["had_network"] == 0.0


@pytest.mark.parametrize("backend", DOCKER_BACKENDS)
async def test_a_partly_solved_multi_step_trial_scores_the_mean(backend, harbor_packages):
    import agentrl
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    package, _, _ = harbor_packages
    env = agentrl.load_environment(package, runtime=backend["runtime"])
    half = ScriptedPolicy([bash_call("echo one > /app/notes.txt"), "done", "done"])
    sampling = SamplingConfig(max_tokens=1024)
    [rollout] = await env.run_group(half, _rows(env)["two-steps"], n=1, sampling=sampling)
    assert rollout.error is None and rollout.state["step_rewards"] == [{"reward": 1.0}, {"reward": 0.0}]
    assert rollout.reward == 0.5  # multi_step_reward_strategy = "mean"


@pytest.mark.parametrize("backend", DOCKER_BACKENDS)
async def test_a_test_script_that_installs_needs_the_opt_in_writable_root(backend, harbor_packages):
    import agentrl
    from agentrl.hub.interop.harbor_env import harbor_oracle_policy
    from agentrl.sampling import SamplingConfig

    _, installs, _ = harbor_packages
    sampling = SamplingConfig()
    results = {}
    for writable_root in ("never", "verifier"):
        env = agentrl.load_environment(installs, runtime=backend["runtime"], writable_root=writable_root)
        [task] = env.tasks("train")
        oracle = harbor_oracle_policy(installs)
        [results[writable_root]] = await env.run_group(oracle, task, n=1, sampling=sampling)
    assert results["never"].reward == 0.0
    assert "Read-only file system" in results["never"].state["verifier_output"]
    assert results["verifier"].error is None and results["verifier"].reward == 1.0, results["verifier"].state


async def test_the_agent_timeout_is_a_total_budget_and_the_verifier_still_runs(harbor_packages):
    import time

    import agentrl
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    package, _, _ = harbor_packages
    env = agentrl.load_environment(package)
    sleeper = ScriptedPolicy([bash_call("sleep 1; echo first"), bash_call("sleep 30; echo second"), "done"])
    started = time.monotonic()
    sampling = SamplingConfig(max_tokens=1024)
    [rollout] = await env.run_group(sleeper, _rows(env)["slow"], n=1, sampling=sampling)
    assert time.monotonic() - started < 25  # 3 s of agent budget, not 30 s per command
    assert "first" in rollout.messages[2].content and "(timed out)" in rollout.messages[4].content
    assert rollout.state["agent_timeouts"] == [0]
    assert rollout.reward == 0.25  # the verifier ran after the budget was spent


@pytest.mark.parametrize("backend", DOCKER_BACKENDS)
async def test_a_compose_task_runs_its_service_beside_the_agent_or_is_refused(backend, harbor_packages):
    import agentrl
    from agentrl.hub.interop.harbor_env import harbor_oracle_policy
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    package, _, _ = harbor_packages
    env = agentrl.load_environment(package, runtime=backend["runtime"])
    task = _rows(env)["compose"]
    [solved] = await env.run_group(harbor_oracle_policy(package), task, n=1, sampling=SamplingConfig())
    if backend["runtime"] == "runsc":  # this engine's gVisor has no container networking: one line says so
        assert solved.reward == 0.0 and "registers runsc with --network=none" in solved.error
        assert "\n" not in solved.error
        return
    [idle] = await env.run_group(ScriptedPolicy(["I did nothing."]), task, n=1, sampling=SamplingConfig())
    assert solved.error is None and solved.reward == 1.0, (solved.error, solved.state.get("verifier_output"))
    assert idle.error is None and idle.reward == 0.0
    assert solved.metrics["network_unavailable"] == 0.0  # it asked for no network and had none
    [public] = await env.run_group(harbor_oracle_policy(package), _rows(env)["compose-public"], n=1,
                                   sampling=SamplingConfig())
    assert public.reward == 1.0 and public.metrics["network_unavailable"] == 1.0  # asked for it, had no route out
    assert any("compose trial" in note and "no route out" in note for note in public.state["network_notes"])


async def test_a_compose_mcp_server_offers_its_tools_to_the_agent(harbor_packages):
    """`[[environment.mcp_servers]]` on a compose service: oracle 1, a do-nothing policy 0, and a policy that
    calls the server's `add_note` tool (offered beside bash, relayed from the agent's sandbox) 1."""
    import agentrl
    from agentrl.hub.interop.harbor_env import harbor_oracle_policy
    from agentrl.policies import ScriptedPolicy, tool_call
    from agentrl.sampling import SamplingConfig

    package, _, _ = harbor_packages
    env = agentrl.load_environment(package)
    task = _rows(env)["mcp-compose"]
    seen = []

    class Policy(ScriptedPolicy):
        async def chat(self, messages, *, tools=None, **kwargs):
            seen.append(sorted(tool["function"]["name"] for tool in tools or []))
            return await super().chat(messages, tools=tools, **kwargs)

    sampling = SamplingConfig()
    [solved] = await env.run_group(harbor_oracle_policy(package), task, n=1, sampling=sampling)
    [idle] = await env.run_group(ScriptedPolicy(["I did nothing."]), task, n=1, sampling=sampling)
    used = Policy([{"content": "", "tool_calls": [tool_call("add_note", text="42")]}, "done"])
    [agent] = await env.run_group(used, task, n=1, sampling=sampling)
    assert solved.error is None and solved.reward == 1.0, (solved.error, solved.state.get("verifier_output"))
    assert idle.error is None and idle.reward == 0.0
    assert agent.error is None and agent.reward == 1.0, (agent.error, agent.state.get("verifier_output"))
    assert seen[0] == ["add_note", "bash", "count_words", "fail", "list_notes"]
    assert agent.messages[-2].role == "tool" and agent.messages[-2].content.startswith("noted (")
    assert agent.state["mcp_calls"] == 1


async def test_an_entrypoint_that_writes_its_root_needs_the_writable_root_everywhere(harbor_packages):
    import agentrl
    from agentrl.hub.interop.harbor_env import harbor_oracle_policy
    from agentrl.sampling import SamplingConfig

    _, _, starts = harbor_packages
    results = {}
    for writable_root in ("verifier", "always"):
        env = agentrl.load_environment(starts, writable_root=writable_root)
        [task] = env.tasks("train")
        [results[writable_root]] = await env.run_group(harbor_oracle_policy(starts), task, n=1,
                                                       sampling=SamplingConfig())
    assert results["verifier"].error is not None and "\n" not in results["verifier"].error  # died at start
    assert "container stopped" in results["verifier"].error and "writable_root = 'always'" in results[
        "verifier"].error, results["verifier"].error
    assert results["always"].error is None and results["always"].reward == 1.0, results["always"].state


async def test_folders_outside_the_workdir_reach_the_verifier_when_carried(harbor_packages):
    import agentrl
    from agentrl.hub.interop.harbor_env import harbor_oracle_policy

    package, _, _ = harbor_packages
    results = {}
    for carry in ([], ["/root", "/srv/never-made"]):
        env = agentrl.load_environment(package, carry_paths=carry)
        [results[len(carry)]] = await env.run_group(harbor_oracle_policy(package), _rows(env)["home"], n=1,
                                                    sampling=SamplingConfig())
    assert results[0].error is None and results[0].reward == 0.0  # only the working directory travels
    assert results[2].error is None and results[2].reward == 1.0, results[2].state  # missing: skipped
