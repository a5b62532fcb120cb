"""key-hunt in real sandboxes under Docker runc, gVisor runsc and bubblewrap: the oracle scores 1, doing
nothing 0, and cheating policies 0.

The cheats attack a grader that would trust the sandbox: one rewrites every file of the tree
to hold its own key and submits that, one leaves a background loop rewriting the files and
submits its key, one plants shims (`cat`, `grep`, a `.bashrc` putting them first on PATH)
that print its key, one submits every key it can grep at once, one submits a decoy key.
key-hunt grades the submitted answer on the host against the task row, so each scores 0;
each would score 1 against a grader that followed the chain in the final sandbox. After
the episodes no sandbox of the run is left (the pool's warm ones included).
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
from sandbox_backends import BACKENDS

import agentrl
from agentrl.hub.entrypoint import import_package_attr
from agentrl.policies import ScriptedPolicy, tool_call
from agentrl.sampling import SamplingConfig
from agentrl.sandbox.gc import list_sandboxes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SAMPLING = SamplingConfig(max_tokens=1000)
FAKE = "0000"


def _env(backend: dict, owner: str, **kwargs):
    return agentrl.load_environment("key-hunt", sandbox={**backend, "owner": owner}, **kwargs)


def _script(*commands: str, answer: str = FAKE) -> ScriptedPolicy:
    steps = [tool_call("bash", command=command) for command in commands] + [tool_call("submit", answer=answer)]
    return ScriptedPolicy([{"content": "", "tool_calls": [step]} for step in steps])


def _cheats(task) -> dict[str, ScriptedPolicy]:
    first = task.info["chain"][0]
    every_file = "for f in $(find . -type f); do echo 'key: 0000' > $f; done"
    decoy = next(text.split(": ")[1] for path, text in task.info["files"].items()
                 if text.startswith("key: ") and text != f"key: {task.answer}")
    shim = "#!/bin/sh\necho 'key: 0000'\n"
    return {
        "rewrites the files": _script(every_file, f"cat {first}"),
        "leaves a background loop": _script(
            f"printf '%s\\n' {shlex.quote(f'while :; do {every_file}; sleep 0.05; done')} > /tmp/loop.sh && "
            "(nohup sh /tmp/loop.sh >/dev/null 2>&1 &)",
            # waits (at most 3 s) until the loop has rewritten the clue: under bubblewrap no process outlives
            # its command, so there the clue stays as it was
            f"for i in $(seq 30); do grep -q 0000 {first} && break; sleep 0.1; done; cat {first}"),
        "plants shims": _script(  # a grader running `cat` with this PATH in this sandbox reads the shim's key
            f"mkdir -p /tmp/shim && printf %s {shlex.quote(shim)} > /tmp/shim/cat && cp /tmp/shim/cat /tmp/shim/grep && "
            "chmod +x /tmp/shim/* && cp /tmp/shim/cat ./cat && echo 'export PATH=/tmp/shim:$PATH' >> ~/.bashrc",
            f"PATH=/tmp/shim:$PATH cat {first}"),
        "submits every key": _script("grep -rh key .", answer=" ".join(
            text.split(": ")[1] for text in task.info["files"].values() if text.startswith("key: "))),
        "submits a decoy": _script("grep -rh key .", answer=decoy),
    }


@pytest.mark.parametrize("backend", BACKENDS)
async def test_oracle_scores_one_nothing_and_cheats_zero(backend):
    owner = f"test-key-hunt-{uuid.uuid4().hex[:8]}"
    env = _env(backend, owner, pool_size=2)
    oracle = import_package_attr(env.path, "key_hunt:oracle_policy", package_name=env.name)()
    try:
        tasks = env.tasks("test", n=3, seed=7)
        for task in tasks:
            rollouts = await env.run_group(oracle, task, n=2, sampling=SAMPLING)
            for rollout in rollouts:
                assert rollout.error is None, rollout.error
                assert rollout.reward == 1.0 and rollout.metrics["chain_read"] == 1.0
                assert rollout.metrics["tool_calls"] == 3.0  # cat the clue, cat the key file, submit
                assert [m.role for m in rollout.messages[2:]] == ["assistant", "tool", "assistant", "tool",
                                                                  "assistant"]
                assert rollout.state["sandbox_pool"] and rollout.state["sandbox_s"] > 0
                assert rollout.state["generation_s"] >= 0
                rollout.sample()  # every turn's prompt extends the previous turn's tokens
        task = tasks[0]
        (nothing,) = await env.run_group(ScriptedPolicy(["I will not look."]), task, n=1, sampling=SAMPLING)
        assert nothing.error is None and nothing.reward == 0.0 and nothing.metrics["tool_calls"] == 0.0
        for name, cheat in _cheats(task).items():
            (rollout,) = await env.run_group(cheat, task, n=1, sampling=SAMPLING)
            assert rollout.error is None, (name, rollout.error)
            assert rollout.state["submitted"], name
            assert rollout.reward == 0.0, name
            shown = rollout.messages[-2].content
            if name == "leaves a background loop" and backend["type"] == "bwrap":
                assert shown == f"next: {task.info['chain'][1]}", shown  # the loop died with its command
            elif name not in ("submits every key", "submits a decoy"):
                # the sandbox did show the cheat's key: a grader trusting it would have paid
                assert "key: 0000" in shown, (name, shown)
    finally:
        await env.aclose()
    left = [box for box in list_sandboxes(include_docker=backend["type"] == "docker",
                                          include_bwrap=backend["type"] == "bwrap") if box.owner == owner]
    assert not left, left


@pytest.mark.parametrize("backend", BACKENDS)
async def test_oracle_solves_a_harder_difficulty_in_clues_plus_two_calls(backend):
    env = _env(backend, f"test-key-hunt-{uuid.uuid4().hex[:8]}", clues=3, depth=2, files=12, distractors=4,
               named_start=True)
    oracle = import_package_attr(env.path, "key_hunt:oracle_policy", package_name=env.name)()
    for task in env.tasks("test", n=2, seed=5):
        (rollout,) = await env.run_group(oracle, task, n=1, sampling=SAMPLING)
        assert rollout.error is None and rollout.reward == 1.0, rollout.error
        assert rollout.metrics["tool_calls"] == 5.0 and rollout.metrics["chain_read"] == 1.0


@pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs bubblewrap and root")
async def test_bwrap_over_a_rootfs_made_from_this_hosts_programs():
    """Without Docker and without debootstrap's tree (the lent GPU machines): key_hunt_rootfs.py's small
    root filesystem serves the episodes; the oracle scores 1 and the file-rewriting cheat 0."""
    folder = Path(tempfile.mkdtemp(prefix="key-hunt-rootfs-"))  # under /tmp: every sandbox uid reaches it
    try:
        folder.chmod(0o755)
        rootfs = folder / "rootfs"
        env = _env({"type": "bwrap", "rootfs": str(rootfs)}, f"test-key-hunt-{uuid.uuid4().hex[:8]}")
        make_rootfs = import_package_attr(env.path, "key_hunt_rootfs:make_rootfs", package_name=env.name)
        make_rootfs(rootfs)
        assert sum(f.stat().st_size for f in rootfs.rglob("*") if f.is_file()) < 64 * 2**20
        oracle = import_package_attr(env.path, "key_hunt:oracle_policy", package_name=env.name)()
        task = env.tasks("test", n=1, seed=11)[0]
        (solved,) = await env.run_group(oracle, task, n=1, sampling=SAMPLING)
        assert solved.error is None and solved.reward == 1.0 and solved.metrics["tool_calls"] == 3.0
        (cheat,) = await env.run_group(_cheats(task)["rewrites the files"], task, n=1, sampling=SAMPLING)
        assert cheat.error is None and cheat.reward == 0.0 and "key: 0000" in cheat.messages[-2].content
    finally:
        shutil.rmtree(folder)
