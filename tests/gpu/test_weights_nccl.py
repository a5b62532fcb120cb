"""NCCL weight updates into CUDA vLLM on a second GPU (0.24 on the lent H200s; skipped without 2 GPUs).

The trainer (this process, GPU 0) trains two steps; `NcclWeightPublisher` broadcasts its tensors
as rank 0 of an NCCL group with the server's worker (GPU 1, vLLM's `nccl` weight-transfer engine).
After the update the server's prompt logprobs equal the trainer's own within bfloat16 tolerance,
while they moved well beyond it from the starting weights, and a request in flight during the
update completes. After a restart of the server (the starting weights again) `resend` forms a new
group on a fresh port and puts the weights back, this time unpacked (one broadcast per tensor).
The logprob helpers are test_loop_gpu's (the IPC twin of these tests).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu, pytest.mark.integration, pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs (trainer on GPU 0, vLLM on GPU 1)"),
]

SERVER_GPU = 1


def _server(model_dir):
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.rl.inference_actor import replica_server

    deployment = InferenceConfig(device="gpu", gpu_memory_utilization=0.5, max_model_len=4096, max_num_seqs=16,
                                  routed_experts=True, weight_transfer="nccl", fp8=False)
    server = replica_server(deployment, Path(model_dir), served_name="tiny-moe", dtype="bfloat16")
    server.env["CUDA_VISIBLE_DEVICES"] = str(SERVER_GPU)
    return server


def _publisher(url, **options):
    from agentrl.inference.direct_weights import NcclWeightPublisher
    from agentrl.inference.server import free_port
    from agentrl.rl.transport import _world_size

    return NcclWeightPublisher([url], master_address="127.0.0.1", master_port=free_port("127.0.0.1"),
                               workers_per_server=_world_size(url), **options)


def _long_request(url, out: dict) -> threading.Thread:
    import httpx

    body = {"token_ids": [3, 40, 52, 61], "sampling_params": {"max_tokens": 3000, "ignore_eos": True,
                                                              "temperature": 1.0, "seed": 5}}

    def run():
        response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=600)
        out["status"], out["tokens"] = response.status_code, len(response.json()["choices"][0]["token_ids"])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait_running(url, timeout_s=60.0):
    """Until the server reports a running request (`vllm:num_requests_running` in /metrics)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:num_requests_running") and float(line.split()[-1]) >= 1:
                return
        time.sleep(0.05)
    raise AssertionError("the long request never started running")


def _trained(server, model_dir):
    """The server's starting logprobs, the trainer's tensors after two steps, its own logprobs, a publisher."""
    from test_loop_gpu import TOKENS, _served_logprobs, _stepped_trainer, _trainer_logprobs

    before = _served_logprobs(server.url, TOKENS)
    trainer, state = _stepped_trainer(model_dir)
    return before, state, _trainer_logprobs(trainer, TOKENS), _publisher(server.url)


def test_nccl_update_gives_the_trainers_logprobs_and_requests_in_flight_complete():
    from test_loop_gpu import TOKENS, _served_logprobs

    from agentrl.models import ensure_model

    model_dir = ensure_model("tiny-moe")
    with _server(model_dir) as server:
        before, state, ours, publisher = _trained(server, model_dir)  # packed: vLLM's packed producer and consumer
        publisher.connect()
        answer: dict = {}
        request = _long_request(server.url, answer)
        _wait_running(server.url)
        result = publisher.publish(state, 1)
        assert request.is_alive(), "the request finished before the update; make it longer"
        request.join(timeout=300)
        after = _served_logprobs(server.url, TOKENS)
    print(f"nccl update of tiny-moe: pause to resume {result.update_s * 1000:.0f} ms")
    assert answer == {"status": 200, "tokens": 3000}
    moved = max(abs(a - b) for a, b in zip(before, ours))
    error = max(abs(a - b) for a, b in zip(after, ours))
    assert moved > 0.2, moved  # two steps at lr 1e-2 moved the logprobs far beyond bf16 rounding
    assert error < 0.05, (error, after, ours)  # bf16 on both sides, different kernels


def test_a_restarted_server_gets_the_trainers_weights_back_through_nccl():
    from test_loop_gpu import _restart_and_resend

    from agentrl.models import ensure_model

    def unpacked(publisher):  # the re-send (a new group, set up with this) covers the one-by-one broadcast
        publisher.packed = False

    model_dir = ensure_model("tiny-moe")
    with _server(model_dir) as server:
        before, state, ours, publisher = _trained(server, model_dir)  # the first publish connects
        result, restarted, after = _restart_and_resend(server, publisher, state, before_resend=unpacked)
    print(f"nccl re-send to a restarted tiny-moe server: pause to resume {result.update_s * 1000:.0f} ms")
    assert result.version == 1
    assert max(abs(a - b) for a, b in zip(restarted, before)) < 0.05  # it came back with the starting weights
    assert max(abs(a - b) for a, b in zip(before, ours)) > 0.2  # the trainer moved beyond bf16 rounding
    assert max(abs(a - b) for a, b in zip(after, ours)) < 0.05, (after, ours)
