"""The scheduler-side gathering of routed-expert rows in agentrl's vLLM plugin (no server)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from agentrl.inference.vllm_plugin.routed_experts import CpuRoutedExpertsSchedulerConnector


def _rows(start: int, count: int) -> np.ndarray:
    """Rows whose value encodes their token position, shape (count, 2 layers, 2 experts)."""
    return np.stack([np.full((2, 2), position, dtype=np.uint8) for position in range(start, start + count)])


def _step(request_id: str, token_start: int, rows: np.ndarray):
    return {request_id: SimpleNamespace(token_start=token_start, rows=rows)}


def _request(request_id: str, num_tokens: int):
    return SimpleNamespace(request_id=request_id, num_tokens=num_tokens)


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
    with pytest.raises(RuntimeError, match="prefix caching must be off"):
        connector.collect(_step("c", 3, _rows(3, 2)))


def test_finished_and_reset_requests_are_forgotten():
    connector = CpuRoutedExpertsSchedulerConnector()
    connector.collect({**_step("d", 0, _rows(0, 2)), **_step("e", 0, _rows(0, 2))})
    connector.request_finished(_request("d", 3))
    assert connector.take_output(_request("d", 3)) is None
    connector.reset()
    assert connector.take_output(_request("e", 3)) is None
    assert connector.build_connector_meta(None, {}) is None
