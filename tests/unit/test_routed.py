"""Routed experts as one int16 array: validation, JSON shape, equality, pickling, `Rollout.sample()`, TokenClient."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from agentrl.clients.token_client import TokenClient
from agentrl.routed import RoutedExperts
from agentrl.sampling import SamplingConfig
from agentrl.types import Completion, Rollout, Task, TrainingSample, Turn

# 4 tokens, 2 layers, top-2; token 1 unknown (old empty-list rows), token 2 unknown as `[]`,
# token 3 knows only its first layer
RAGGED = [[[1, 2], [3, 4]], [[], []], [], [[5, 6], []]]
DENSE = np.array([[[1, 2], [3, 4]], [[-1, -1], [-1, -1]], [[-1, -1], [-1, -1]], [[5, 6], [-1, -1]]])


def test_validates_the_old_ragged_form_with_minus_one_for_unknown():
    experts = RoutedExperts.validate(RAGGED)
    assert experts.array.dtype == np.int16 and experts.shape == (4, 2, 2)
    assert experts.array.tolist() == DENSE.tolist()
    assert experts.known().tolist() == [True, False, False, False]
    completion = Completion(token_ids=[7, 8, 9, 10], routed_experts=RAGGED)
    assert isinstance(completion.routed_experts, RoutedExperts) and len(completion.routed_experts) == 4


def test_validates_arrays_and_regular_lists():
    vllm_rows = np.arange(12, dtype=np.uint8).reshape(2, 3, 2)  # vLLM sends uint8/uint16
    experts = RoutedExperts.validate(vllm_rows)
    assert experts.array.dtype == np.int16 and experts.array.tolist() == vllm_rows.tolist()
    assert RoutedExperts.validate(vllm_rows.tolist()) == experts
    assert RoutedExperts.validate(experts) is experts
    assert RoutedExperts.validate([]).shape == (0, 0, 0)
    assert RoutedExperts.validate([[[], []]]).shape == (1, 2, 0)
    for bad, message in ((np.zeros((2, 3)), "expected \\(tokens, layers, top_k\\)"),
                         (np.array([[[-2, 1]]]), "ids must lie in -1"),
                         (np.array([[[40000, 1]]], dtype=np.int32), "ids must lie in -1"),
                         ([[[1.5, 2.0]]], "integer expert ids"),
                         ("1,2", "expected an array or nested lists"),
                         ([[1, 2], [3]], "nested lists")):
        with pytest.raises(ValidationError, match=message):
            TrainingSample(token_ids=[1], loss_mask=[True], inference_logprobs=[0.0], policy_versions=[0],
                           routed_experts=bad)


def test_json_round_trip_keeps_the_nested_list_shape():
    turn = Turn(prompt_token_ids=[1, 2], prompt_routed_experts=[[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
                completion=Completion(token_ids=[3, 4, 5, 6], routed_experts=DENSE))
    data = turn.model_dump(mode="json")
    # unknown tokens come out as the empty-list rows results.jsonl always had
    assert data["completion"]["routed_experts"] == [[[1, 2], [3, 4]], [[], []], [[], []], [[5, 6], [-1, -1]]]
    assert data["prompt_routed_experts"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert turn.model_dump()["completion"]["routed_experts"] == data["completion"]["routed_experts"]
    back = Turn.model_validate(json.loads(json.dumps(data)))
    assert back == turn and back.completion.routed_experts.array.tolist() == DENSE.tolist()
    assert Completion().model_dump(mode="json")["routed_experts"] is None
    schema = Completion.model_json_schema()["properties"]["routed_experts"]
    assert schema["anyOf"][0]["items"]["items"]["items"] == {"type": "integer"}


def test_equality_is_by_value():
    a = Completion(token_ids=[1, 2], routed_experts=np.array([[[1, 2]], [[3, 4]]]))
    assert a == Completion(token_ids=[1, 2], routed_experts=[[[1, 2]], [[3, 4]]])
    assert a != Completion(token_ids=[1, 2], routed_experts=[[[1, 2]], [[3, 5]]])
    assert a != Completion(token_ids=[1, 2], routed_experts=[[[1, 2], [3, 4]]])  # same values, other shape
    assert a != Completion(token_ids=[1, 2])
    assert a.routed_experts == [[[1, 2]], [[3, 4]]] and a.routed_experts != "other"


def test_pickles_small_and_equal():
    experts = RoutedExperts(np.random.default_rng(0).integers(0, 8, size=(130, 4, 2)))
    sample = TrainingSample(token_ids=list(range(130)), loss_mask=[True] * 130, inference_logprobs=[0.0] * 130,
                            policy_versions=[0] * 130, routed_experts=experts)
    back = pickle.loads(pickle.dumps(sample))
    assert back == sample and back.routed_experts.array.dtype == np.int16
    assert len(pickle.dumps(experts)) < len(pickle.dumps(experts.tolist())) / 2


def test_rollout_sample_lays_out_experts_with_unknown_prompt_rows():
    first = Turn(prompt_token_ids=[1, 2], completion=Completion(
        token_ids=[3, 4], logprobs=[-0.1, -0.2], routed_experts=[[[1, 2]], [[]]]))  # no prompt experts
    second = Turn(prompt_token_ids=[1, 2, 3, 4, 5], prompt_routed_experts=[[[7, 7]]] * 4 + [[[6, 5]]],
                  completion=Completion(token_ids=[6], logprobs=[-0.3], routed_experts=[[[0, 3]]]))
    sample = Rollout(task=Task(prompt=[]), turns=[first, second]).sample()
    assert sample.token_ids == [1, 2, 3, 4, 5, 6]
    # tokens 0-1: first prompt unknown; 2-3: first completion (its last row unknown); 4: the second
    # prompt's new token from its prompt experts (earlier rows are not overwritten); 5: second completion
    assert sample.routed_experts.array[:, 0].tolist() == [[-1, -1], [-1, -1], [1, 2], [-1, -1], [6, 5], [0, 3]]
    assert sample.routed_experts.array.dtype == np.int16
    short = second.model_copy(update={"prompt_routed_experts": RoutedExperts.validate([[[7, 7]]] * 3)})
    assert Rollout(task=Task(prompt=[]), turns=[first, short]).sample().routed_experts.array[4, 0].tolist() == [-1, -1]
    no_experts = second.model_copy(update={"completion": second.completion.model_copy(update={"routed_experts": None})})
    assert Rollout(task=Task(prompt=[]), turns=[first, no_experts]).sample().routed_experts is None
    misaligned = first.model_copy(update={"completion": first.completion.model_copy(
        update={"routed_experts": RoutedExperts.validate([[[1, 2]]])})})
    with pytest.raises(ValueError, match="1 routed expert rows for 2 completion tokens"):
        Rollout(task=Task(prompt=[]), turns=[misaligned]).sample()


class _Renderer:
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


def _generate(rows: np.ndarray | None, *, prompt: list[int], completion: list[int]):
    buffer = io.BytesIO()
    if rows is not None:
        np.save(buffer, rows)

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{
            "token_ids": completion, "logprobs": {"content": [{"logprob": -1.0}] * len(completion)},
            "routed_experts": base64.b64encode(buffer.getvalue()).decode() if rows is not None else None,
        }]})

    async def run():
        client = TokenClient("http://vllm", renderer=_Renderer())
        client._context_looked_up = True
        client.http = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(answer))
        async with client:
            return await client.generate(prompt, sampling=SamplingConfig(max_tokens=8))

    return asyncio.run(run())


def test_token_client_splits_vllm_rows_and_marks_the_last_token_unknown():
    rows = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)  # 3 prompt + 3 completion - 1
    completion, prompt_experts = _generate(rows, prompt=[1, 2, 3], completion=[4, 5, 6])
    assert prompt_experts.array.tolist() == rows[:3].tolist()
    assert completion.routed_experts.array.tolist() == rows[3:].tolist() + [[[-1, -1], [-1, -1]]]
    assert completion.routed_experts.array.dtype == np.int16
    # fewer rows than forwarded tokens: the missing ones are unknown, nothing shifts
    completion, prompt_experts = _generate(rows[:2], prompt=[1, 2, 3], completion=[4, 5, 6])
    assert prompt_experts.known().tolist() == [True, True, False] and not completion.routed_experts.known().any()
    completion, prompt_experts = _generate(None, prompt=[1], completion=[2])
    assert completion.routed_experts is None and prompt_experts is None
