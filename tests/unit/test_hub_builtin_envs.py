"""The built-in environments push and pull through the local hub, load from the pulled folder, and run a rollout.

Round trip: push -> list -> pull (every hash verified) -> `agentrl.load_environment(pulled path)`
-> identical dataset rows (source environment, published parquet, pulled environment) -> one
scored rollout with a ScriptedPolicy (the real oracle-policy client) replying with the answer.
"""

from __future__ import annotations

import pytest

from agentrl.errors import NotFoundError
from agentrl.hub.entrypoint import import_package_attr
from agentrl.hub.loader import builtin_environments_dir
from agentrl.hub.local import LocalHub, installed_environment_dirs
from agentrl.hub.package import DATASET_DIR, verify_package
from agentrl.hub.publish import list_packages, pull_package, push_package


def _builtins() -> list:
    """Every built-in package; those with a sandbox need Docker for their rollout (integration)."""
    from agentrl.hub.manifest import load_manifest

    if not builtin_environments_dir().is_dir():
        return []
    params = []
    for folder in sorted(p for p in builtin_environments_dir().iterdir() if (p / "environment.toml").is_file()):
        sandboxed = load_manifest(folder).sandbox is not None
        params.append(pytest.param(folder.name, marks=[pytest.mark.integration] if sandboxed else []))
    return params


@pytest.mark.parametrize("folder_name", _builtins())
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
    if pulled_env.manifest.sandbox is not None:  # its images are built by the environment's own tooling
        from agentrl.hub.images import check_package_images

        missing = [c.image for c in check_package_images(pulled) if not c.present]
        if missing:
            pytest.skip(f"sandbox images not built here: {missing[:3]}")
    try:  # the package's own oracle when it has one, else replay the reference answer
        module = pulled_env.manifest.entrypoint.split(":")[0]
        policy = import_package_attr(pulled, f"{module}:oracle_policy", package_name=pulled_env.name)()
    except NotFoundError:
        policy = ScriptedPolicy([task.answer])
    [rollout] = await pulled_env.run_group(policy, task, n=1, sampling=SamplingConfig(max_tokens=8192))
    assert rollout.error is None, rollout.error
    assert rollout.reward > 0.99, rollout.metrics
