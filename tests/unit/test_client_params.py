"""The sampling parameters `TokenClient` sends to vLLM's generate endpoint."""

from __future__ import annotations

from agentrl.clients.token_client import _vllm_sampling_params
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


def test_the_body_goes_out_as_json_and_a_body_that_is_not_json_is_one_line():
    """The request body is encoded (msgspec) into the JSON vLLM's parser reads, with its content type;
    an answer of 200 whose body is not JSON choices is an InferenceError naming the endpoint. A broken
    server stands in through httpx's MockTransport: real vLLM does not send such bodies on demand."""
    import asyncio
    import json

    import httpx
    import pytest

    from agentrl.clients.token_client import InferenceError, TokenClient

    seen: list[httpx.Request] = []

    class _Renderer:
        def decode(self, ids, *, skip_special_tokens=True):
            return "x" * len(ids)

    def run(answer) -> object:
        async def go():
            client = TokenClient("http://vllm", renderer=_Renderer())
            client._context_looked_up = True
            client.http = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(answer))
            async with client:
                return await client.generate([1, 2, 3], sampling=SamplingConfig(max_tokens=4, seed=5))
        return asyncio.run(go())

    def good(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"index": 0, "token_ids": [7, 8], "finish_reason": "stop",
                                                      "logprobs": {"content": [{"logprob": -0.5}] * 2}}]})

    completion, _ = run(good)
    assert completion.token_ids == [7, 8] and completion.logprobs == [-0.5, -0.5]
    assert seen[0].headers["content-type"] == "application/json"
    body = json.loads(seen[0].content)
    assert body["token_ids"] == [1, 2, 3] and body["sampling_params"]["seed"] == 5
    assert body["sampling_params"]["max_tokens"] == 4 and body["output_mode"] == "tokens"
    for broken in (b"<html>proxy error</html>", b'{"detail": "no choices"}'):
        with pytest.raises(InferenceError, match=r"generate answered 200 without a JSON body of choices"):
            run(lambda request, broken=broken: httpx.Response(200, content=broken))
