"""Weight updates over vLLM's NCCL weight-transfer engine (CUDA vLLM + one GPU; skipped on the CPU).

Same contract as tests/integration/test_weights.py, through the GPU transport: after
`NcclWeightPublisher.publish` of known weights, vLLM's prompt logprobs equal transformers'
on the same weights (bf16-free: float32 both sides, tolerance 1e-3), and the version moves.
"""

from __future__ import annotations

import shutil

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.timeout(900)]

torch = pytest.importorskip("torch")
TOKENS = [3, 20, 35, 41, 50, 62, 70, 88]


def test_nccl_publish_matches_transformers(tmp_path):
    import httpx
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from agentrl.inference.server import VLLMServer, free_port
    from agentrl.inference.direct_weights import NcclWeightPublisher
    from agentrl.models import ensure_model

    model_dir = ensure_model("tiny-moe")
    base = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    new = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator) for name, tensor in base.items()}
    folder = tmp_path / "reference"
    shutil.copytree(model_dir, folder)
    save_file(new, str(folder / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(torch.tensor([TOKENS])).logits[0], -1)
    expected = [logprobs[i, TOKENS[i + 1]].item() for i in range(len(TOKENS) - 1)]

    server = VLLMServer(
        model_dir, dtype="float32", device="cuda", log_path=tmp_path / "vllm.log",
        extra_args=["--weight-transfer-config", '{"backend": "nccl"}', "--gpu-memory-utilization", "0.3"],
    )
    with server:
        publisher = NcclWeightPublisher([server.url], master_address="127.0.0.1", master_port=free_port(), workers_per_server=1)
        publisher.connect()
        result = publisher.publish({name: tensor.cuda() for name, tensor in new.items()}, version=1)
        assert result.version == 1
        body = {"token_ids": TOKENS, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
        entries = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()["prompt_logprobs"][1:]
        served = [entry[str(token)]["logprob"] for entry, token in zip(entries, TOKENS[1:])]
        assert max(abs(a - b) for a, b in zip(served, expected)) < 1e-3
        assert httpx.get(f"{server.url}/weight_info").json()["weight_version"] == "1"
