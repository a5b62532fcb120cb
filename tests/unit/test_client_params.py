"""The sampling parameters `TokenClient` sends to vLLM's generate endpoint."""

from __future__ import annotations

from agentrl.client import _vllm_sampling_params
from agentrl.sampling import SamplingConfig


def test_vllm_detokenizes_only_for_stop_strings():
    """The client decodes completions itself; vLLM's API server detokenizing every token too cost
    a quarter of its CPU on the CPU default. Stop strings need vLLM's text, so they keep it."""
    plain = _vllm_sampling_params(SamplingConfig(max_tokens=8), max_tokens=8)
    assert plain["detokenize"] is False and "stop" not in plain
    stopping = _vllm_sampling_params(SamplingConfig(max_tokens=8, stop=["</answer>"]), max_tokens=8)
    assert stopping["stop"] == ["</answer>"] and "detokenize" not in stopping
    assert plain["logprobs"] == 0 and plain["max_tokens"] == 8


def test_every_request_asks_for_all_choices_in_the_final_answer():
    """`output_kind` 2 is vLLM's RequestOutputKind.FINAL_ONLY (the same enum in 0.24's wheel: CUMULATIVE 0,
    DELTA 1, FINAL_ONLY 2): without it CUDA vLLM 0.24 answers an n-choice request with only the choices
    that finished last. vLLM's own request parser must read the value as FINAL_ONLY."""
    import pytest

    params = _vllm_sampling_params(SamplingConfig(max_tokens=8, seed=3), max_tokens=8)
    assert params["output_kind"] == 2
    pytest.importorskip("vllm", reason="vLLM (agentrl[cpu]) is not installed")
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.sampling_params import RequestOutputKind

    request = GenerateRequest.model_validate({"token_ids": [5, 6, 7], "sampling_params": {**params, "n": 4}})
    assert request.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY and request.sampling_params.n == 4
