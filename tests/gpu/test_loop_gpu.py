"""The RL loop's GPU pieces against CUDA vLLM (0.24 on the lent H200; skipped without a GPU).

- Routed experts: CUDA vLLM's native `--enable-return-routed-experts` rows, for prompts and
  sampled completions, agree with the trainer's own router on the same weights and tokens
  (the share of (token, MoE layer) pairs whose expert sets match): at least 99% in float32,
  and reported (printed) in bfloat16, where near-ties flip on rounding. With
  `inference.routed_weights` the rows carry the gate weights too, equal to the trainer's.
- CUDA IPC weight updates: the trainer (in this process, on the server's GPU) trains two
  steps, `IpcWeightPublisher` hands the new weights to the server through vLLM's `ipc`
  engine (packed: a buffer per chunk), and the server's prompt logprobs then equal the
  trainer's own within bfloat16 tolerance, while they moved well beyond it from the starting
  weights; one step later an unpacked update (a handle per tensor) does the same; after a restart of
  the server (the starting weights again), `resend` puts them back through a new `ipc` engine.
- The weight check (`inference.weight_check`): every update above is checked equal to the trainer's
  tensors on every served parameter; then two planted corruptions, one tensor not sent and one sent in
  float16, each stop the update with one line naming the parameter, and the server keeps serving.
- FP8 serving (`inference.fp8`, vLLM's online `--quantization fp8`): after each IPC update vLLM quantizes
  the new weights again (its layerwise reload); the FP8 check passes on every quantized parameter, the
  served logprobs follow the trainer's within FP8 rounding, and an expert sent 1.5x too large is caught.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.timeout(900)]
torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))

TOKENS = [3, 20, 35, 41, 50, 62, 70, 88, 90, 101, 15, 27, 44, 9]
PROMPTS = [[3, 40 + i, 52, 61, 70 + i, 80, 33, 47 + i] for i in range(8)]


def _server(model_dir, *, dtype: str, transport: str | None = None, fp8: bool = False, routed_weights: bool = False):
    from agentrl.inference.deployment import InferenceConfig
    from agentrl.rl.inference_actor import replica_server

    deployment = InferenceConfig(device="gpu", gpu_memory_utilization=0.3, max_model_len=512, max_num_seqs=16,
                                  routed_experts=True, routed_weights=routed_weights, weight_transfer=transport,
                                  fp8=fp8, fp8_kv_cache=False)
    return replica_server(deployment, Path(model_dir), served_name="tiny-moe", dtype=dtype)


def _trainer(model_dir, *, dtype: str):
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer

    config = TrainerConfig(row_tokens=64, optimizer={"lr": 1e-2}, parallel={"param_dtype": dtype}, round_like_vllm_cpu=False)
    return Trainer(config, model_dir=model_dir, device="cuda:0")


def _trainer_logprobs(trainer, tokens):
    from agentrl.trainer.models.attention import build_segments

    ids = torch.tensor(tokens, device="cuda")
    positions = torch.arange(len(tokens), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=trainer.compute_dtype, enabled=trainer.compute_dtype != torch.float32):
        return trainer.model(ids, positions, build_segments(positions), targets_T=torch.roll(ids, -1))[:-1].float().tolist()


def _served_logprobs(url, tokens):
    import httpx

    body = {"token_ids": tokens, "sampling_params": {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}}
    response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    response.raise_for_status()
    entries = response.json()["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, tokens[1:], strict=True)]


def _trainer_routing(trainer, tokens, *, weights: bool = False):
    """The experts the trainer's own routers choose for `tokens`: (tokens, MoE layers, top_k); with `weights`,
    their gate weights too."""
    from agentrl.trainer.models.router import MoERouter

    chosen = []
    hooks = [module.register_forward_hook(lambda _m, _i, out: chosen.append((out[0].detach().float().cpu(),
                                                                              out[1].detach().cpu())))
             for module in trainer.model.modules() if isinstance(module, MoERouter)]
    try:
        _trainer_logprobs(trainer, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    ids = torch.stack([i for _, i in chosen], dim=1).numpy()
    return (ids, torch.stack([w for w, _ in chosen], dim=1).numpy()) if weights else ids


def _sampled_rows(url, prompt):
    """24 sampled tokens after `prompt`: the routed-experts rows the server returned, and prompt + completion."""
    import httpx

    from agentrl.routed import decode_routed_experts_array

    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 24, "temperature": 1.0, "seed": prompt[1]}}
    response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return decode_routed_experts_array(choice["routed_experts"]), prompt + choice["token_ids"]


def test_gate_weights_ride_with_the_routed_experts_and_equal_the_trainers(tmp_path):
    """`inference.routed_weights` on CUDA (`vllm_plugin.routed_weights_cuda`): float32 (tokens, layers, top_k, 2)
    rows, ids then the gate weights vLLM applied; in float32, where the expert sets agree (at least 99% of
    (token, layer) pairs), each expert's weight equals the trainer's within 2e-4. Not closer: vLLM's fused-MoE
    Triton kernels multiply float32 in TF32 (`tl.dot`'s default), so the hidden states reaching the later routers
    differ from the trainer's by about 1e-4 relative (measured on an H100 at 6281702: ids 1.0000 equal, weights
    within 4.2e-5 at most, 82 of 186 beyond 1e-5). The tokens' weights differ from one another by 1e-3 to 2e-2
    here (0.48-0.52), and unnormalised ones by far more, so a misaligned or wrong row still shows."""
    import numpy as np

    from agentrl.inference.routed_experts import routing_agreement
    from agentrl.models import ensure_model
    from agentrl.routed import routing_arrays

    model_dir = ensure_model("tiny-moe")
    trainer = _trainer(model_dir, dtype="float32")
    moe_layers = trainer.args.moe_layers
    agreements, compared = [], 0
    with _server(model_dir, dtype="float32", routed_weights=True) as server:
        for prompt in PROMPTS:
            rows, tokens = _sampled_rows(server.url, prompt)
            assert rows.shape == (len(tokens) - 1, trainer.args.num_hidden_layers, trainer.args.top_k, 2)
            assert rows.dtype == np.float32
            ids, weights = routing_arrays(rows)
            ours, our_weights = _trainer_routing(trainer, tokens[:-1], weights=True)
            served, served_weights = ids[:, moe_layers], weights[:, moe_layers]
            agreements.append(routing_agreement(served, ours))
            order, our_order = np.argsort(served, axis=-1), np.argsort(ours, axis=-1)
            same = (np.take_along_axis(served, order, -1) == np.take_along_axis(ours, our_order, -1)).all(-1)
            np.testing.assert_allclose(np.take_along_axis(served_weights, order, -1)[same],
                                       np.take_along_axis(our_weights, our_order, -1)[same], atol=2e-4, rtol=0)
            compared += int(same.sum())
    assert sum(agreements) / len(agreements) >= 0.99 and compared > 100, (agreements, compared)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_routed_experts_agree_with_the_trainers_router(dtype, tmp_path):
    from agentrl.inference.routed_experts import routing_agreement
    from agentrl.models import ensure_model

    model_dir = ensure_model("tiny-moe")
    trainer = _trainer(model_dir, dtype=dtype)
    moe_layers = trainer.args.moe_layers
    agreements = []
    with _server(model_dir, dtype=dtype) as server:
        for prompt in PROMPTS:
            rows, tokens = _sampled_rows(server.url, prompt)
            assert rows.shape == (len(tokens) - 1, trainer.args.num_hidden_layers, trainer.args.top_k)
            assert not rows[:, [i for i in range(rows.shape[1]) if i not in moe_layers]].any()  # dense layers: zeros
            ours = _trainer_routing(trainer, tokens[:-1])
            agreements.append(routing_agreement(rows[:, moe_layers], ours))
    agreement = sum(agreements) / len(agreements)
    print(f"routed experts: CUDA vLLM vs the trainer's router in {dtype}: {agreement:.4f} of (token, layer) sets agree")
    if dtype == "float32":
        assert agreement >= 0.99, agreements
    else:
        assert agreement >= 0.8, agreements


def _stepped_trainer(model_dir):
    """A bf16 trainer two RL steps (lr 1e-2) from the starting weights, and its HF-named tensors (views)."""
    from trainer_helpers import make_samples

    from agentrl.trainer.checkpoint import hf_state_views

    trainer = _trainer(model_dir, dtype="bfloat16")
    args = trainer.args
    samples = make_samples(vocab=args.vocab_size, moe_layers=len(args.moe_layers), num_experts=args.num_experts,
                           top_k=args.top_k)
    for _ in range(2):
        trainer.train_on_samples(samples)
    return trainer, hf_state_views(trainer)


def test_ipc_update_gives_the_trainers_logprobs(tmp_path):
    """Packed (one buffer per chunk, the default), then unpacked (a handle per tensor) after one more step."""
    from trainer_helpers import make_samples

    from agentrl.inference.direct_weights import IpcWeightPublisher
    from agentrl.models import ensure_model
    from agentrl.trainer.checkpoint import hf_state_views

    model_dir = ensure_model("tiny-moe")
    with _server(model_dir, dtype="bfloat16", transport="ipc") as server:
        before = _served_logprobs(server.url, TOKENS)
        trainer, state = _stepped_trainer(model_dir)
        ours = _trainer_logprobs(trainer, TOKENS)
        publisher = IpcWeightPublisher([server.url], chunk_bytes=1 << 20)  # several chunks even for tiny-moe
        started = time.monotonic()
        result = publisher.publish(state, 1)
        took = time.monotonic() - started
        after = _served_logprobs(server.url, TOKENS)
        args = trainer.args
        trainer.train_on_samples(make_samples(vocab=args.vocab_size, moe_layers=len(args.moe_layers),
                                              num_experts=args.num_experts, top_k=args.top_k, seed=1))
        ours_next = _trainer_logprobs(trainer, TOKENS)
        unpacked = IpcWeightPublisher([server.url], packed=False, chunk_bytes=1 << 20)
        unpacked.version = publisher.version
        unpacked_result = unpacked.publish(hf_state_views(trainer), 2)
        after_next = _served_logprobs(server.url, TOKENS)
        planted = _planted_corruptions(server.url, trainer, version=3)
        still = _served_logprobs(server.url, TOKENS)
    print(f"ipc update of tiny-moe: {took * 1000:.0f} ms (pause to resume {result.update_s * 1000:.0f} ms)")
    moved = max(abs(a - b) for a, b in zip(before, ours))
    error = max(abs(a - b) for a, b in zip(after, ours))
    moved_next = max(abs(a - b) for a, b in zip(ours_next, ours))
    error_next = max(abs(a - b) for a, b in zip(after_next, ours_next))
    print(f"packed: moved {moved:.3f}, served vs trainer {error:.4f}; unpacked: moved {moved_next:.3f}, "
          f"served vs trainer {error_next:.4f}")
    assert moved > 0.2, moved  # two steps at lr 1e-2 moved the logprobs far beyond bf16 rounding
    assert error < 0.05, (error, after, ours)  # bf16 on both sides, different kernels
    assert moved_next > 0.1, moved_next  # the third step moved them again ...
    assert error_next < 0.05, (error_next, after_next, ours_next)  # ... and the unpacked update carried that
    for checked in (result, unpacked_result):  # every served parameter equals the trainer's, bit for bit
        check = checked.checks[server.url]
        assert check.checked > 20 and check.max_error < 1.0 and not check.unserved, check
        assert checked.memory[server.url][0]["device"] == "cuda"
    print(f"weight checks: {result.checks[server.url].checked} parameters, max error "
          f"{max(r.checks[server.url].max_error for r in (result, unpacked_result)):.2e} of the tolerance")
    assert planted["not sent"] == "model.layers.1.post_attention_layernorm.weight", planted
    assert planted["float16"].startswith("model.layers.1.mlp.experts.") and planted["float16"].endswith(
        "w13_weight"), planted  # vLLM's fused gate/up experts (0.32 nests them under routed_experts)
    assert len(still) == len(TOKENS) - 1  # the server resumed and serves after each refused update


def _planted_corruptions(url, trainer, *, version):
    """One more trainer step (the norms move by more than a bf16 step), then two broken IPC publishers: one
    leaves a norm out, one sends an expert's bf16 bytes labelled float16; {kind: the parameter each check named}.
    (A bf16 tensor cast to float16 and back loses nothing, and the check rightly passed it on the H200.)"""
    import re

    from trainer_helpers import make_samples

    from agentrl.inference.direct_weights import IpcWeightPublisher
    from agentrl.inference.weight_check import WeightMismatchError
    from agentrl.trainer.checkpoint import hf_state_views

    skipped, halved = "model.layers.1.post_attention_layernorm.weight", "model.layers.1.mlp.experts.3.up_proj.weight"

    class NotSent(IpcWeightPublisher):
        async def _send_tensors(self, control, weights):
            await super()._send_tensors(control, {name: t for name, t in weights.items() if name != skipped})

    class HalfOne(IpcWeightPublisher):  # bf16 bytes labelled float16: the server reads other values
        def _wire_tensor(self, tensor):
            wire = super()._wire_tensor(tensor)
            return wire.view(torch.float16) if tensor.data_ptr() == self.victim.data_ptr() else wire

    args = trainer.args
    trainer.train_on_samples(make_samples(vocab=args.vocab_size, moe_layers=len(args.moe_layers),
                                          num_experts=args.num_experts, top_k=args.top_k, seed=2))
    named = {}
    for kind, publisher in (("not sent", NotSent([url])), ("float16", HalfOne([url]))):
        state = hf_state_views(trainer)
        publisher.victim = state[halved]
        publisher.version = version - 1
        with pytest.raises(WeightMismatchError) as info:
            publisher.publish(state, version)
        assert "\n" not in str(info.value)
        named[kind] = re.search(r"on \S+: (\S+) ", str(info.value)).group(1)
        version += 1
    return named


def test_a_restarted_server_gets_the_trainers_weights_back_through_ipc(tmp_path):
    """What a held server gets: after a restart (the starting weights again) `resend` sets up the restarted
    server's `ipc` engine anew and puts the published version back (`WeightPush.watch` drives this in a run)."""
    from agentrl.inference.direct_weights import IpcWeightPublisher
    from agentrl.models import ensure_model

    model_dir = ensure_model("tiny-moe")
    with _server(model_dir, dtype="bfloat16", transport="ipc") as server:
        before = _served_logprobs(server.url, TOKENS)
        trainer, state = _stepped_trainer(model_dir)
        ours = _trainer_logprobs(trainer, TOKENS)
        result, restarted, after = _restart_and_resend(server, IpcWeightPublisher([server.url]), state)
    print(f"ipc re-send to a restarted tiny-moe server: pause to resume {result.update_s * 1000:.0f} ms")
    assert result.version == 1
    assert max(abs(a - b) for a, b in zip(restarted, before)) < 0.05  # it came back with the starting weights
    assert max(abs(a - b) for a, b in zip(before, ours)) > 0.2
    assert max(abs(a - b) for a, b in zip(after, ours)) < 0.05, (after, ours)


def _restart_and_resend(server, publisher, state, *, before_resend=None):
    """Publish `state` as version 1, restart the server (as its supervisor does: same port, the starting
    checkpoint), `resend`; the result and the served logprobs after the restart and after the re-send."""
    publisher.publish(state, 1)
    server.stop()
    server.start()
    restarted = _served_logprobs(server.url, TOKENS)
    if before_resend is not None:
        before_resend(publisher)
    result = publisher.resend(state, [server.url])
    return result, restarted, _served_logprobs(server.url, TOKENS)


def test_fp8_serving_requantizes_after_every_ipc_update(tmp_path):
    from trainer_helpers import make_samples

    from agentrl.inference.direct_weights import IpcWeightPublisher
    from agentrl.inference.weight_check import WeightMismatchError
    from agentrl.models import ensure_model
    from agentrl.trainer.checkpoint import hf_state_views

    model_dir = ensure_model("tiny-moe")
    victim = "model.layers.2.mlp.experts.5.up_proj.weight"

    class Enlarged(IpcWeightPublisher):  # one expert arrives 1.5x too large; the digest is of the true tensor
        def _wire_tensor(self, tensor):
            wire = super()._wire_tensor(tensor)
            return wire * 1.5 if tensor.data_ptr() == self.victim.data_ptr() else wire

    with _server(model_dir, dtype="bfloat16", transport="ipc", fp8=True) as server:
        before = _served_logprobs(server.url, TOKENS)
        trainer, state = _stepped_trainer(model_dir)
        ours = _trainer_logprobs(trainer, TOKENS)
        publisher = IpcWeightPublisher([server.url])
        first = publisher.publish(state, 1)
        after = _served_logprobs(server.url, TOKENS)
        args = trainer.args
        trainer.train_on_samples(make_samples(vocab=args.vocab_size, moe_layers=len(args.moe_layers),
                                              num_experts=args.num_experts, top_k=args.top_k, seed=1))
        ours_next = _trainer_logprobs(trainer, TOKENS)
        second = publisher.publish(hf_state_views(trainer), 2)
        after_next = _served_logprobs(server.url, TOKENS)
        enlarged = Enlarged([server.url])
        enlarged.version = publisher.version
        state_next = hf_state_views(trainer)
        enlarged.victim = state_next[victim]
        with pytest.raises(WeightMismatchError) as refused:
            enlarged.publish(state_next, 3)
        still = _served_logprobs(server.url, TOKENS)
    moved = max(abs(a - b) for a, b in zip(before, ours))
    error = max(abs(a - b) for a, b in zip(after, ours))
    error_next = max(abs(a - b) for a, b in zip(after_next, ours_next))
    checks = [result.checks[server.url] for result in (first, second)]
    print(f"fp8 serving: moved {moved:.3f}, served (FP8) vs trainer (bf16) {error:.4f} then {error_next:.4f}; "
          f"FP8 parameters checked {checks[0].fp8_checked} of {checks[0].checked}, largest-value error "
          f"{max(c.fp8_largest_error for c in checks):.2e}, max error {max(c.max_error for c in checks):.3f} "
          f"of the tolerance; refused: {refused.value}")
    for check in checks:
        assert check.fp8_checked >= 6 and check.max_error < 1.0 and not check.unserved, check
    assert moved > 0.2, moved
    assert error < moved / 2 and error_next < moved / 2, (error, error_next, moved)  # FP8 rounding, not the old weights
    assert "(FP8) is not the trainer's weights" in str(refused.value) and "w13_weight" in str(refused.value)
    assert len(still) == len(TOKENS) - 1
