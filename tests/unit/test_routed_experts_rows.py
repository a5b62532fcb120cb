"""The scheduler-side gathering of routed-expert rows in agentrl's vLLM plugin (no server)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from agentrl.inference.vllm_plugin.routed_experts import CpuRoutedExpertsSchedulerConnector
from agentrl.routed import split_routed_experts


def _rows(start: int, count: int) -> np.ndarray:
    """Rows whose value encodes their token position, shape (count, 2 layers, 2 experts)."""
    return np.stack([np.full((2, 2), position, dtype=np.uint8) for position in range(start, start + count)])


def _step(request_id: str, token_start: int, rows: np.ndarray):
    return {request_id: SimpleNamespace(token_start=token_start, rows=rows)}


def _request(request_id: str, num_tokens: int, *, finished: bool = False):
    """The parts of vLLM's `Request` the connector reads."""
    return SimpleNamespace(request_id=request_id, num_tokens=num_tokens, is_finished=lambda: finished)


def test_chunked_prefill_then_decode_emits_each_position_once():
    connector = CpuRoutedExpertsSchedulerConnector()
    connector.collect(_step("a", 0, _rows(0, 4)))  # first prefill chunk: no token sampled, nothing taken
    connector.collect(_step("a", 4, _rows(4, 3)))  # last chunk: prompt of 7, one token sampled
    first = connector.take_output(_request("a", 8))
    assert first[:, 0, 0].tolist() == list(range(7))
    connector.collect(_step("a", 7, _rows(7, 1)))  # decode step over the sampled token
    second = connector.take_output(_request("a", 9))
    assert second[:, 0, 0].tolist() == [7]
    assert connector.take_output(_request("a", 9)) is None  # nothing new


def test_recomputation_after_preemption_keeps_first_rows_and_gaps_are_errors():
    connector = CpuRoutedExpertsSchedulerConnector()
    connector.collect(_step("b", 0, _rows(0, 5)))
    connector.take_output(_request("b", 6))
    connector.collect(_step("b", 0, _rows(0, 6)))  # preempted, recomputed from scratch
    assert connector.take_output(_request("b", 7))[:, 0, 0].tolist() == [5]
    with pytest.raises(RuntimeError, match="a prefix-cache hit on a server whose scheduler keeps no prefix rows"):
        connector.collect(_step("c", 3, _rows(3, 2)))


def test_a_weight_update_in_flight_neither_repeats_nor_loses_rows():
    """vLLM's sequence when `pause` resets the prefix cache under running requests.

    Every running request is preempted (`request_finished` while it still runs), the
    connector is `reset`, and on resume each request is recomputed from token 0. The client
    must get each position's row once, the first one recorded (the routing its token was
    sampled with): a restart at 0 would hand rows 0.. up a second time, misaligning every
    later row for Router Replay.
    """
    connector = CpuRoutedExpertsSchedulerConnector()
    connector.collect(_step("f", 0, _rows(0, 6)))
    taken = [connector.take_output(_request("f", 7))]
    connector.request_finished(_request("f", 7))  # preempted by the cache reset
    connector.reset()
    recomputed = _rows(0, 7)
    recomputed[:6] += 100  # new weights may route the old tokens differently
    connector.collect(_step("f", 0, recomputed))  # recomputation covers the token sampled before
    taken.append(connector.take_output(_request("f", 8)))
    connector.collect(_step("f", 7, _rows(7, 1)))
    taken.append(connector.take_output(_request("f", 9)))
    assert np.concatenate(taken)[:, 0, 0].tolist() == list(range(8))


def test_finished_requests_are_forgotten():
    connector = CpuRoutedExpertsSchedulerConnector()
    connector.collect({**_step("d", 0, _rows(0, 2)), **_step("e", 0, _rows(0, 2))})
    connector.request_finished(_request("d", 3, finished=True))
    assert connector.take_output(_request("d", 3)) is None
    connector.reset()  # a cache reset keeps the other request's rows
    assert connector.take_output(_request("e", 3))[:, 0, 0].tolist() == [0, 1]
    assert connector.build_connector_meta(None, {}) is None


def test_lenient_split_pads_missing_rows_and_distrusts_extra_ones():
    prompt_rows, completion_rows = split_routed_experts(_rows(0, 5), prompt_len=4, completion_len=4, strict=False)
    assert prompt_rows[:, 0, 0].tolist() == [0, 1, 2, 3] and completion_rows[:, 0, 0].tolist() == [4, -1, -1, -1]
    # 8 rows for 4 + 4 tokens (7 expected): the alignment is unknown, nothing may be replayed
    prompt_rows, completion_rows = split_routed_experts(_rows(0, 8), prompt_len=4, completion_len=4, strict=False)
    assert (prompt_rows == -1).all() and (completion_rows == -1).all()


def _hashed(request_id: str, num_tokens: int, hashes: list[str]):
    request = _request(request_id, num_tokens)
    request.block_hashes = hashes
    return request


def test_a_prefix_cache_hit_gets_the_rows_of_the_request_that_computed_the_blocks():
    from agentrl.inference.vllm_plugin.routed_prefix import CachedBlockRows

    prefix = CachedBlockRows(block_size=4, max_blocks=16)
    connector = CpuRoutedExpertsSchedulerConnector(prefix=prefix)
    first = _hashed("a", 11, ["h0", "h1"])  # 10 prompt tokens: two full blocks
    connector.collect(_step("a", 0, _rows(0, 10)), {"a": first})
    assert len(prefix) == 2
    assert connector.take_output(first)[:, 0, 0].tolist() == list(range(10))
    # the same 8-token prefix, then its own 3 tokens: the scheduler computes from token 8 on
    second = _hashed("b", 12, ["h0", "h1"])
    connector.collect(_step("b", 8, _rows(8, 3).astype(np.uint8) + 100), {"b": second})
    rows = connector.take_output(second)
    assert rows[:, 0, 0].tolist() == list(range(8)) + [108, 109, 110]
    assert prefix.stitched == 2 and prefix.missed == 0
    # a block no longer held is unknown (-1): Router Replay routes those tokens live
    third = _hashed("c", 10, ["h0", "gone"])
    connector.collect(_step("c", 8, _rows(8, 1)), {"c": third})
    rows = connector.take_output(third)
    assert rows[:4, 0, 0].tolist() == [0, 1, 2, 3] and (rows[4:8] == -1).all() and prefix.missed == 1
    # a weight update resets the prefix cache: nothing is stitched from the old weights' blocks
    connector.reset()
    assert len(prefix) == 0
    connector.collect(_step("a", 10, _rows(10, 6)), {"a": _hashed("a", 17, ["h0", "h1", "h2", "h3"])})
    assert len(prefix) == 0  # rows recorded before the reset are not registered for later hits


def test_prefix_rows_keep_gate_weights():
    from agentrl.inference.vllm_plugin.routed_prefix import CachedBlockRows, unknown_rows

    prefix = CachedBlockRows(block_size=2, max_blocks=1)
    rows = np.stack([np.full((3, 2, 2), 5.0, dtype=np.float32), np.full((3, 2, 2), 0.5, dtype=np.float32)], axis=-1)
    assert prefix.register(["x"], rows, first_block=0) == 1
    prefix.register(["x", "y"], np.concatenate([rows, rows])[:4], first_block=1)
    assert len(prefix) == 1  # bounded: the least recently used block went
    hit = prefix.lookup(["x", "y"], 4, like=rows)
    assert np.isnan(hit[:2, ..., 1]).all() and (hit[:2, ..., 0] == -1).all()  # "x" was evicted
    assert (hit[2:, ..., 1] == 0.5).all()
    assert unknown_rows(2, rows.astype(np.uint8)).dtype == np.int16


def test_a_hit_on_blocks_computed_in_the_same_step_gets_their_rows():
    """Two requests of one prompt in one step: vLLM computes the blocks for the first and schedules the second
    as a hit on them. The worker's rows may list the hit first; its lookup must still find the first's rows."""
    from agentrl.inference.vllm_plugin.routed_prefix import CachedBlockRows

    prefix = CachedBlockRows(block_size=4, max_blocks=16)
    connector = CpuRoutedExpertsSchedulerConnector(prefix=prefix)
    first, second = _hashed("a", 11, ["h0", "h1"]), _hashed("b", 11, ["h0", "h1"])
    connector.collect({**_step("b", 8, _rows(8, 2)), **_step("a", 0, _rows(0, 10))}, {"a": first, "b": second})
    assert connector.take_output(second)[:, 0, 0].tolist() == list(range(10))
    assert prefix.stitched == 2 and prefix.missed == 0
