"""A verifiers package in its worker process (`agentrl.hub.interop.verifiers_proxy`), driven from agentrl's environment.

The worker runs on `.venv-verifiers/0.4.0` (scripts/install.sh, extra dev: a venv over agentrl's packages,
made as `agentrl env install` makes a package's venv), so no pip runs here. Checked: rollouts and groups
come back with this process's own turn objects (routed experts kept), the environment pickles into
another worker, a package's own prints do not disturb the start, a load failure and a worker that dies
mid-rollout are one-line errors, and `close()` ends the process.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
from pathlib import Path

import pytest

from agentrl.errors import AgentrlError
from agentrl.hub.interop.verifiers import find_verifiers_project, installed_verifiers
from agentrl.policies import ScriptedPolicy
from agentrl.routed import RoutedExperts
from agentrl.sampling import SamplingConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-verifiers" / "0.4.0"
FIXTURES = ROOT / "tests" / "fixtures" / "verifiers"

if not (VENV / "bin" / "python").exists():
    pytest.skip(f"{VENV} missing: scripts/install.sh makes it (extra dev)", allow_module_level=True)
if installed_verifiers() is not None:
    pytest.skip("verifiers is installed here: packages load in this process", allow_module_level=True)


def _start(folder: Path, **kwargs):
    from agentrl.hub.interop.verifiers_proxy import VerifiersWorkerEnv

    return VerifiersWorkerEnv.start(find_verifiers_project(folder), VENV, kwargs)


class RecordingPolicy(ScriptedPolicy):
    """ScriptedPolicy whose turns carry routed experts; it keeps every turn it returned."""

    def __init__(self, replies):
        super().__init__(replies)
        self.returned = []

    async def chat(self, messages, **kwargs):
        message, turn = await super().chat(messages, **kwargs)
        turn.completion.routed_experts = RoutedExperts.validate([[[1, 2]]] * len(turn.completion.token_ids))
        self.returned.append(turn)
        return message, turn


@pytest.fixture(scope="module")
def reverse_env():
    env = _start(FIXTURES / "v1_reverse", num_tasks=3)
    yield env
    env.close()


def test_groups_come_back_with_this_processes_turns(reverse_env):
    assert reverse_env.splits == ["test", "train"] and len(reverse_env.get_dataset("test")) == 3
    task = reverse_env.tasks("test")[0]
    assert task.prompt[-1].content == "Reverse this word: stressed"
    policy = RecordingPolicy(["desserts"])
    group = asyncio.run(reverse_env.run_group(policy, task, n=2, sampling=SamplingConfig()))
    assert [rollout.reward for rollout in group] == [1.5, 1.5]
    assert {id(rollout.turns[0]) for rollout in group} == {id(turn) for turn in policy.returned}
    assert group[0].sample().routed_experts is not None
    single = asyncio.run(reverse_env.rollout(ScriptedPolicy(["nope"]), task, sampling=SamplingConfig()))
    [scored] = asyncio.run(reverse_env.score([single]))
    assert scored is single and scored.metrics["exact"] == 0.0 and scored.reward == pytest.approx(
        0.5 * scored.metrics["similarity"])


def test_pickled_env_starts_its_own_worker(reverse_env):
    copy = pickle.loads(pickle.dumps(reverse_env))
    try:
        assert copy.worker.process.pid != reverse_env.worker.process.pid
        assert len(copy.get_dataset("train")) == 3  # the keyword arguments went along
    finally:
        copy.close()
    assert copy.worker.process.poll() is not None


def test_load_failure_is_one_line_and_prints_do_not_disturb(tmp_path):
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "pyproject.toml").write_text('[project]\nname = "vf-noisy"\ndependencies = ["verifiers>=0.4"]\n')
    (folder / "vf_noisy.py").write_text('print("hello from the package")\nimport verifiers.v1 as vf\n'
                                        'raise RuntimeError("the package broke")\n')
    with pytest.raises(AgentrlError, match=r"vf_noisy.py: import failed: RuntimeError: the package broke") as caught:
        _start(folder)
    assert "\n" not in str(caught.value)


def test_worker_death_mid_rollout_is_one_line(tmp_path):
    env = _start(FIXTURES / "v1_reverse", num_tasks=1)
    task = env.tasks("test")[0]

    class Killer(ScriptedPolicy):
        async def chat(self, messages, **kwargs):
            os.kill(env.worker.process.pid, signal.SIGKILL)
            await asyncio.to_thread(env.worker.process.wait)
            return await super().chat(messages, **kwargs)

    try:
        with pytest.raises(AgentrlError, match=r"vf-v1-reverse.*its worker exited \(-9\)"):
            asyncio.run(env.run_group(Killer(["x"]), task, n=1, sampling=SamplingConfig()))
    finally:
        env.close()
