"""The built-in environments push and pull through the local hub, load from the pulled folder, and run a rollout.

Round trip: push -> list -> pull (every hash verified) -> `agentrl.load_environment(pulled path)`
-> identical dataset rows (source environment, published parquet, pulled environment) -> one
scored rollout with a ScriptedPolicy (the real oracle-policy client) replying with the answer.
"""

from __future__ import annotations

import pytest

from agentrl.hub.local import LocalHub, installed_environment_dirs
from agentrl.hub.package import DATASET_DIR, verify_package
from agentrl.hub.publish import list_packages, pull_package, push_package
from agentrl.loader import builtin_environments_dir

BUILTINS = sorted(p.name for p in builtin_environments_dir().iterdir() if (p / "environment.toml").is_file()) \
    if builtin_environments_dir().is_dir() else []


@pytest.mark.parametrize("folder_name", BUILTINS)
async def test_builtin_environment_roundtrip_through_local_hub(folder_name, tmp_path, monkeypatch):
    import datasets

    import agentrl
    from agentrl.policies import ScriptedPolicy
    from agentrl.sampling import SamplingConfig

    monkeypatch.setenv("AGENTRL_HUB", str(tmp_path / "hub"))
    hub = LocalHub()
    source = builtin_environments_dir() / folder_name
    result = push_package(source, hub=hub, owner="builtin")
    assert result.published
    assert not push_package(source, hub=hub, owner="builtin").published, "unchanged push must be a no-op"
    assert [row["ref"] for row in list_packages(hub)] == [result.ref.repo_id]

    pulled = pull_package(result.ref.repo_id, hub=hub)
    assert verify_package(pulled).content_hash == result.content_hash
    assert pulled in installed_environment_dirs()

    source_env = agentrl.load_environment(source)
    pulled_env = agentrl.load_environment(pulled)
    for split_file in sorted((pulled / DATASET_DIR).glob("*.parquet")):
        split = split_file.stem
        published_rows = datasets.Dataset.from_parquet(str(split_file)).to_list()
        assert published_rows == source_env.get_dataset(split).to_list()
        assert pulled_env.get_dataset(split).to_list() == published_rows

    task = pulled_env.tasks("test", n=1, seed=3)[0]
    policy = ScriptedPolicy([task.answer])
    [rollout] = await pulled_env.run_group(policy, task, n=1, sampling=SamplingConfig())
    assert rollout.error is None, rollout.error
    assert rollout.reward > 0.99, rollout.metrics
