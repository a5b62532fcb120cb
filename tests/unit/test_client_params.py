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
