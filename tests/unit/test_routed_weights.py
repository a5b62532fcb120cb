"""Gate weights beside the routed expert ids: decoded, split, assembled across turns, pickled, packed."""

from __future__ import annotations

import base64
import io
import pickle

import numpy as np
import pytest

from agentrl.clients.token_client import decode_routed_experts
from agentrl.routed import RoutedExperts, routing_arrays, split_routed_experts
from agentrl.types import Completion, Message, Rollout, Task, Turn


def _encoded(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def _rows(tokens: int, layers: int = 3, top_k: int = 2, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 8, (tokens, layers, top_k)).astype(np.float32)
    weights = rng.random((tokens, layers, top_k)).astype(np.float32)
    return np.stack([ids, weights], axis=-1)


def test_ids_and_weights_are_decoded_apart_and_split_with_nan_for_the_unforwarded_token():
    rows = _rows(5)
    decoded = decode_routed_experts(_encoded(rows))
    assert decoded.array.dtype == np.int16 and decoded.array.tolist() == rows[..., 0].astype(int).tolist()
    assert np.array_equal(decoded.weights, rows[..., 1])
    ids, weights = routing_arrays(rows)
    prompt_w, completion_w = split_routed_experts(weights, prompt_len=3, completion_len=3)
    assert prompt_w.dtype == np.float32 and np.array_equal(prompt_w, rows[:3, ..., 1])
    assert np.isnan(completion_w[-1]).all() and np.array_equal(completion_w[:2], rows[3:, ..., 1])
    plain, none = routing_arrays(rows[..., 0].astype(np.uint8))
    assert none is None and plain.dtype == np.uint8


def test_weights_must_match_the_ids_shape_and_count_in_equality_and_pickling():
    ids = np.zeros((4, 3, 2), dtype=np.int16)
    with pytest.raises(ValueError, match="gate weights shaped"):
        RoutedExperts(ids, np.zeros((4, 3, 1), dtype=np.float32))
    weighted = RoutedExperts(ids, np.full((4, 3, 2), 0.5, dtype=np.float32))
    assert weighted != RoutedExperts(ids) and weighted == RoutedExperts(ids, weighted.weights.copy())
    again = pickle.loads(pickle.dumps(weighted))  # how samples reach the trainer (Ray)
    assert again == weighted and again.weights is not None
    assert weighted[1:3].weights.shape == (2, 3, 2)


def test_a_multi_turn_sample_keeps_weights_only_when_every_turn_has_them():
    def turn(prompt: list[int], completion: list[int], *, weighted: bool, seed: int) -> Turn:
        rows = _rows(len(prompt) + len(completion), seed=seed)
        ids, weights = routing_arrays(rows)
        p_ids, c_ids = split_routed_experts(ids[:-1], prompt_len=len(prompt), completion_len=len(completion))
        p_w, c_w = split_routed_experts(weights[:-1], prompt_len=len(prompt), completion_len=len(completion))
        return Turn(prompt_token_ids=prompt, prompt_routed_experts=RoutedExperts(p_ids, p_w if weighted else None),
                    completion=Completion(text="", token_ids=completion, logprobs=[0.0] * len(completion),
                                          routed_experts=RoutedExperts(c_ids, c_w if weighted else None)))

    task = Task(prompt=[Message(role="user", content="x")])
    first = turn([1, 2, 3], [4, 5], weighted=True, seed=1)
    second = turn([1, 2, 3, 4, 5, 6], [7, 8, 9], weighted=True, seed=2)
    sample = Rollout(task=task, turns=[first, second]).sample()
    weights = sample.routed_experts.weights
    assert weights.shape == (9, 3, 2)
    assert np.array_equal(weights[3], first.completion.routed_experts.weights[0])
    assert np.array_equal(weights[5], second.prompt_routed_experts.weights[5])  # the new prompt token
    assert np.isnan(weights[4]).all()  # the first turn's last token: never forwarded in that turn
    assert np.isnan(weights[8]).all()  # last sampled token
    unweighted = turn([1, 2, 3, 4, 5, 6], [7, 8, 9], weighted=False, seed=2)
    assert Rollout(task=task, turns=[first, unweighted]).sample().routed_experts.weights is None


def test_packed_rows_carry_the_weights_of_the_moe_layers():
    torch = pytest.importorskip("torch")
    from agentrl.trainer.packing import pack_samples
    from agentrl.types import TrainingSample

    rows = _rows(6, layers=3)
    ids, weights = routing_arrays(rows)
    weights[5] = np.nan
    ids[5] = -1
    sample = TrainingSample(token_ids=[1, 2, 3, 4, 5, 6], loss_mask=[False, False, True, True, True, True],
                            inference_logprobs=[0.0] * 6, policy_versions=[-1, -1, 0, 0, 0, 0],
                            routed_experts=RoutedExperts(ids, weights))
    plain = TrainingSample(token_ids=[1, 2, 3], loss_mask=[False, True, True], inference_logprobs=[0.0] * 3,
                           policy_versions=[-1, 0, 0], routed_experts=RoutedExperts(ids[:3]))
    # vLLM's layout: layer 0 is dense, the model's MoE layers are 1 and 2
    batch = pack_samples([sample, plain], row_tokens=6, moe_layers=2, top_k=2, moe_layer_indices=[1, 2],
                         num_layers=3)
    first, second = batch.rows
    assert first.routed_weights is not None and first.routed_weights.dtype == torch.float32
    assert torch.equal(first.routed_weights[:5], torch.from_numpy(weights[:5, 1:]))
    assert torch.isnan(first.routed_weights[5:]).all()
    assert second.routed_weights is None  # no sample of that row carried weights
