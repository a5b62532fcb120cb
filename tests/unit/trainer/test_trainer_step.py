"""Trainer steps in one process: SFT learns, HF export loads in transformers, one-line errors."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_helpers import make_samples

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.models.attention import build_segments
from agentrl.trainer.packing import pack_samples
from agentrl.trainer.trainer import Trainer


def _trainer(model_dir, **overrides) -> Trainer:
    values = {"row_tokens": 64, "optimizer": {"lr": 1e-2}}
    values.update(overrides)
    return Trainer(TrainerConfig(**values), model_dir=model_dir, device="cpu")


def test_sft_steps_lower_the_nll(tiny_glm_dir):
    trainer = _trainer(tiny_glm_dir, loss={"mode": "sft"})
    batch = trainer.pack(make_samples(with_experts=False))
    nll = [trainer.step(batch)["nll"] for _ in range(4)]
    assert nll[-1] < nll[0] - 0.1, nll
    assert trainer.step_count == 4


def test_rl_step_metrics_and_export_loads_in_transformers(tiny_glm_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_glm_dir)
    metrics = trainer.train_on_samples(make_samples())
    for key in ("loss", "mismatch_kl", "masked_fraction", "grad_norm", "tokens", "loss_tokens", "importance_ratio"):
        assert key in metrics
    assert metrics["mismatch_kl"] > 0 and 0 <= metrics["masked_fraction"] <= 1
    out = trainer.export_hf(tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)
    with torch.no_grad():
        ours = trainer.model(ids, positions, build_segments(positions))
        theirs = exported(ids[None]).logits[0]
        original = AutoModelForCausalLM.from_pretrained(tiny_glm_dir).eval()(ids[None]).logits[0]
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    assert (theirs - original).abs().max() > 1e-3  # the export carries the trained weights


def test_step_errors_are_one_line(tiny_glm_dir, tmp_path):
    trainer = _trainer(tiny_glm_dir)
    with pytest.raises(AgentrlError, match="row has 32 tokens; this trainer packs rows of trainer.row_tokens=64"):
        trainer.step(pack_samples(make_samples(with_experts=False), row_tokens=32))
    empty = pack_samples(make_samples(with_experts=False), row_tokens=64)
    empty.rows = []
    with pytest.raises(AgentrlError, match="the batch has no rows"):
        trainer.step(empty)
    with pytest.raises(NotFoundError, match="not an agentrl checkpoint"):
        trainer.load_checkpoint(tmp_path)
    with pytest.raises(NotFoundError, match=r"no model folder .*missing \(.* has no missing\): pass an HF model"):
        Trainer(TrainerConfig(model=str(tmp_path / "missing")), device="cpu")


def test_checkpoint_restores_weights_optimizer_and_step(tiny_glm_dir, tmp_path):
    trainer = _trainer(tiny_glm_dir)
    samples = make_samples()
    trainer.train_on_samples(samples)
    trainer.save_checkpoint(tmp_path / "ckpt")
    after_save = trainer.train_on_samples(samples)
    assert not (tmp_path / "ckpt.tmp").exists()
    fresh = _trainer(tiny_glm_dir)
    assert fresh.load_checkpoint(tmp_path / "ckpt") == 1
    replay = fresh.train_on_samples(samples)
    assert replay["loss"] == pytest.approx(after_save["loss"], rel=1e-6)
    assert replay["grad_norm"] == pytest.approx(after_save["grad_norm"], rel=1e-6)
    for (name, a), (_, b) in zip(trainer.model.state_dict().items(), fresh.model.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_replayed_fraction_reports_router_replay(tiny_glm_dir):
    trainer = _trainer(tiny_glm_dir)
    with_experts = trainer.train_on_samples(make_samples())
    assert 0.3 < with_experts["replayed_fraction"] < 0.8  # half the samples carry experts
    without = trainer.train_on_samples(make_samples(with_experts=False))
    assert without["replayed_fraction"] == 0.0


def test_trainer_from_model_args_with_random_weights():
    from agentrl.trainer.models.args import MoEModelArgs

    args = MoEModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        rotary_dim=8, num_experts=4, top_k=2, num_shared_experts=1, dense_layers=[0])
    trainer = Trainer(TrainerConfig(row_tokens=64, loss={"mode": "sft"}, optimizer={"lr": 1e-2}),
                      model_args=args, device="cpu")
    assert trainer.model_dir is None
    samples = make_samples(vocab=64, moe_layers=1, num_experts=4, with_experts=False)
    first = trainer.train_on_samples(samples)["nll"]
    assert first == pytest.approx(torch.log(torch.tensor(64.0)).item(), rel=0.1)  # random init: ~uniform
    for _ in range(3):
        last = trainer.train_on_samples(samples)["nll"]
    assert last < first


def test_non_finite_gradient_skips_the_update(tiny_glm_dir):
    trainer = _trainer(tiny_glm_dir)
    embed = trainer.model.embed_tokens.weight
    with torch.no_grad():
        embed[:, 0] = float("nan")  # every token's hidden state, hence the gradient, becomes NaN
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    metrics = trainer.train_on_samples(make_samples(with_experts=False))
    assert metrics["skipped"] == 1.0 and trainer.step_count == 1
    assert not trainer.optimizer.state  # Adam moments never saw the NaN gradient
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach().nan_to_num(7.0), before[name].nan_to_num(7.0)), name


def test_bfloat16_compute_on_the_cpu(tiny_glm_dir):
    """param_dtype=bfloat16 runs the CPU trainer under bf16 autocast (vLLM's bf16 numerics), masters in fp32."""
    samples = make_samples()
    full = _trainer(tiny_glm_dir, optimizer={"lr": 0.0})
    half = _trainer(tiny_glm_dir, optimizer={"lr": 0.0}, parallel={"param_dtype": "bfloat16"})
    assert half._autocast and not full._autocast
    full_metrics = full.train_on_samples(samples)
    half_metrics = half.train_on_samples(samples)
    assert all(p.dtype == torch.float32 for p in half.model.parameters())
    # The same weights and samples: bf16 rounding moves the objective a little, not a lot.
    assert half_metrics["loss"] != full_metrics["loss"]
    assert half_metrics["loss"] == pytest.approx(full_metrics["loss"], rel=0.05, abs=1e-3)
    assert half_metrics["mismatch_kl"] == pytest.approx(full_metrics["mismatch_kl"], rel=0.2)


def test_padding_is_not_computed_and_changes_nothing(tiny_glm_dir):
    """Rows are cut at their padding: the same samples in rows of 64 or 512 tokens give the same step."""
    samples = make_samples()
    short, long = _trainer(tiny_glm_dir), _trainer(tiny_glm_dir, row_tokens=512)
    short_batch, long_batch = short.pack(samples), long.pack(samples)
    assert len(long_batch.rows) == 1 and long_batch.rows[0].num_tokens == 512  # mostly padding
    seen: list[int] = []
    hook = long.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].numel()))
    grads: dict[int, dict[str, torch.Tensor]] = {}
    for trainer in (short, long):  # the gradients the optimizer is handed
        trainer.optimizer.step = lambda t=trainer: grads.setdefault(id(t), {
            n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})
    short_metrics, long_metrics = short.step(short_batch), long.step(long_batch)
    hook.remove()
    assert seen == [sum(len(s.token_ids) - 1 for s in samples)]  # real tokens only, no padding tail
    assert long_metrics["loss"] == pytest.approx(short_metrics["loss"], rel=1e-5)
    assert long_metrics["mismatch_kl"] == pytest.approx(short_metrics["mismatch_kl"], rel=1e-5)
    assert long_metrics["grad_norm"] == pytest.approx(short_metrics["grad_norm"], rel=1e-5)
    short_grads, long_grads = grads[id(short)], grads[id(long)]
    assert short_grads.keys() == long_grads.keys() and short_grads
    for name, grad in short_grads.items():
        torch.testing.assert_close(long_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_filler_row_of_padding_still_runs_the_layers(tiny_glm_dir):
    """A rank's filler row (pure padding) keeps a few tokens, so collectives see every rank."""
    from agentrl.trainer.packing import PackedRow

    trainer = _trainer(tiny_glm_dir)
    batch = trainer.pack(make_samples(with_experts=False))
    batch.rows.append(PackedRow.padding(64, moe_layers=None, top_k=None))
    seen: list[int] = []
    hook = trainer.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].numel()))
    metrics = trainer.step(batch)
    hook.remove()
    assert len(seen) == len(batch.rows) and 0 < seen[-1] < 64
    assert metrics["loss_tokens"] == batch.loss_tokens


def test_float16_compute_with_a_dynamic_loss_scale(tiny_glm_dir, tmp_path):
    """param_dtype=float16: fp16 autocast, fp32 masters, loss scaled up for backward and gradients scaled back."""
    samples = make_samples()
    full = _trainer(tiny_glm_dir, optimizer={"lr": 0.0})
    half = _trainer(tiny_glm_dir, optimizer={"lr": 0.0}, parallel={"param_dtype": "float16"})
    assert half.compute_dtype == torch.float16 and half._autocast and full.loss_scale is None
    full_metrics, half_metrics = full.train_on_samples(samples), half.train_on_samples(samples)
    assert all(p.dtype == torch.float32 for p in half.model.parameters())
    assert half_metrics["loss_scale"] == 2.0**16 and "loss_scale" not in full_metrics
    # fp16 keeps 10 mantissa bits: closer to float32 than bf16's 7, and the gradient is unscaled.
    assert half_metrics["loss"] != full_metrics["loss"]
    assert half_metrics["loss"] == pytest.approx(full_metrics["loss"], rel=5e-3, abs=1e-4)
    assert half_metrics["grad_norm"] == pytest.approx(full_metrics["grad_norm"], rel=2e-2)
    # An overflowing scale: the step is skipped, the scale halves, the weights do not move.
    half.loss_scale.value = 2.0**127
    before = [p.detach().clone() for p in half.model.parameters()]
    overflow = half.train_on_samples(samples)
    assert overflow["skipped"] == 1.0 and half.loss_scale.value == 2.0**126
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, half.model.parameters()))
    # The scale is part of the checkpoint.
    half.save_checkpoint(tmp_path / "ckpt")
    fresh = _trainer(tiny_glm_dir, optimizer={"lr": 0.0}, parallel={"param_dtype": "float16"})
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert fresh.loss_scale.value == 2.0**126


def test_loss_scale_backs_off_and_grows():
    from agentrl.trainer.loss import LossScale

    scale = LossScale(initial=8.0, growth_interval=2, maximum=32.0)
    scale.update(finite=True)
    assert scale.value == 8.0
    scale.update(finite=True)
    assert scale.value == 16.0
    scale.update(finite=False)
    assert scale.value == 8.0 and scale.good_steps == 0
    for _ in range(10):
        scale.update(finite=True)
    assert scale.value == 32.0  # capped


def test_router_replay_diagnostics_measure_live_routing_on_the_same_samples(tiny_glm_dir):
    """`mismatch_kl_live_routing` is the KL a step without replay sees, computed beside the replayed step."""
    samples = make_samples()  # half carry (random) routed experts: replay moves their logprobs
    replayed = _trainer(tiny_glm_dir, router_replay_diagnostics=True).train_on_samples(samples)
    live = _trainer(tiny_glm_dir, router_replay=False).train_on_samples(samples)
    assert replayed["replayed_fraction"] > 0 and "mismatch_kl_live_routing" not in live
    assert replayed["mismatch_kl_live_routing"] == pytest.approx(live["mismatch_kl"], rel=1e-5)
    assert abs(replayed["mismatch_kl"] - live["mismatch_kl"]) > 1e-3
    # the peers' figures of the same samples, live routing's equal to a step without replay
    assert replayed["mismatch_large_fraction_live_routing"] == pytest.approx(live["mismatch_large_fraction"])
    assert replayed["mismatch_max_log_ratio_live_routing"] == pytest.approx(live["mismatch_max_log_ratio"], rel=1e-5)
    assert 0 < live["mismatch_large_fraction"] <= 1 and live["mismatch_max_log_ratio"] > math.log(2)
    plain = _trainer(tiny_glm_dir, router_replay_diagnostics=True).train_on_samples(make_samples(with_experts=False))
    assert plain["mismatch_kl_live_routing"] == pytest.approx(plain["mismatch_kl"], rel=1e-6)


def test_the_gate_in_the_other_precision_is_a_fourth_arm_on_the_same_samples(tiny_glm_dir):
    """Under bf16, `router_float32` picks the gate's precision; every step reports live routing with the gate in the
    other one on the same samples, equal to what a trainer set the other way computes as its own live routing."""
    bf16 = {"parallel": {"param_dtype": "bfloat16"}, "router_replay_diagnostics": True}
    samples = make_samples()
    float32_gate = _trainer(tiny_glm_dir, **bf16).train_on_samples(samples)
    reduced_gate = _trainer(tiny_glm_dir, router_float32=False, **bf16).train_on_samples(samples)
    assert float32_gate["mismatch_kl_live_routing_reduced_gate"] == pytest.approx(
        reduced_gate["mismatch_kl_live_routing"], rel=1e-5)
    assert reduced_gate["mismatch_kl_live_routing_float32_gate"] == pytest.approx(
        float32_gate["mismatch_kl_live_routing"], rel=1e-5)
    assert float32_gate["live_routing_reduced_gate_agreement"] == pytest.approx(
        reduced_gate["live_routing_agreement"])
    assert float32_gate["mismatch_kl_live_routing"] != reduced_gate["mismatch_kl_live_routing"]
    assert float32_gate["mismatch_kl"] != reduced_gate["mismatch_kl"]  # the trained step's gate differs too
    plain = _trainer(tiny_glm_dir, router_replay_diagnostics=True, router_float32=False).train_on_samples(samples)
    assert not [key for key in plain if key.endswith(("_gate", "_gate_agreement"))]  # float32: no fourth arm


def _own_routing(trainer, tokens: list[int]) -> list:
    """The experts the trainer's routers choose for `tokens`, per token and MoE layer (as inference reports them)."""
    from agentrl.trainer.models.attention import build_segments

    blocks = trainer.model.moe_blocks()
    for block in blocks:
        block.record_routing = True
    ids, positions = torch.tensor(tokens), torch.arange(len(tokens))
    with torch.no_grad():
        trainer.model(ids, positions, build_segments(positions), targets_T=torch.roll(ids, -1))
    routing = torch.stack([block.last_expert_ids for block in blocks], dim=1).tolist()
    for block in blocks:
        block.record_routing = False
    return routing


def test_router_replay_diagnostics_report_how_often_live_routing_agrees(tiny_glm_dir):
    """`live_routing_agreement`: of the expert sets the samples carry, the share the trainer's routers choose too."""
    random_sets = _trainer(tiny_glm_dir, router_replay_diagnostics=True).train_on_samples(make_samples())
    trainer = _trainer(tiny_glm_dir, router_replay_diagnostics=True)
    own = [type(sample).model_validate({**sample.model_dump(), "routed_experts": _own_routing(trainer, sample.token_ids)})
           for sample in make_samples(with_experts=False)]
    agreeing = trainer.train_on_samples(own)
    assert agreeing["replayed_fraction"] == 1.0
    assert agreeing["live_routing_agreement"] >= 0.99, agreeing
    assert random_sets["live_routing_agreement"] < 0.3, random_sets  # 2 of 8 experts at random: 1 in 28 agree
    plain = _trainer(tiny_glm_dir, router_replay_diagnostics=True).train_on_samples(make_samples(with_experts=False))
    assert "live_routing_agreement" not in plain


def test_on_policy_mismatch_kl_counts_only_samples_wholly_from_the_current_weights(tiny_glm_dir):
    """A sample generated by the weights the step starts from is on-policy; one that spanned an update (older
    tokens first) or came from older weights is not, however many of its tokens carry the current version."""
    from agentrl.types import TrainingSample

    trainer = _trainer(tiny_glm_dir)
    samples = make_samples(with_experts=False)
    versions = []
    for index, sample in enumerate(samples):
        tail = sum(sample.loss_mask) // 2
        produced = [0] * len(sample.token_ids) if index % 2 == 0 else [
            -1 if not mask else (0 if i < len(sample.token_ids) - tail else 1)
            for i, mask in enumerate(sample.loss_mask)]
        versions.append(produced)
    # step_count 0: samples of version 0 are on-policy, the spanning ones (0 then 1) count as version 0 too
    first = trainer.train_on_samples([TrainingSample(**{**s.model_dump(), "policy_versions": v})
                                      for s, v in zip(samples, versions)])
    assert first["on_policy_fraction"] == pytest.approx(1.0)
    assert first["mismatch_kl_on_policy"] == pytest.approx(first["mismatch_kl"], rel=1e-6)
    # step_count 1: only a sample made wholly by version 1 is on-policy; the spanning ones start at version 0
    second = trainer.train_on_samples([TrainingSample(**{**s.model_dump(), "policy_versions": v})
                                       for s, v in zip(samples, versions)])
    assert second["on_policy_fraction"] == 0.0 and "mismatch_kl_on_policy" not in second
    wholly_new = [TrainingSample(**{**s.model_dump(), "policy_versions": [2] * len(s.token_ids)}) for s in samples]
    third = trainer.train_on_samples(wholly_new)
    assert third["on_policy_fraction"] == pytest.approx(1.0)


def _live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage Python can reach (parameters, Adam moments, anything kept)."""
    import gc

    gc.collect()
    storages = {}
    for item in gc.get_objects():
        if isinstance(item, torch.Tensor) and not item.is_meta:
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_repeated_steps_and_pushes_do_not_grow_what_the_trainer_keeps(tiny_glm_dir):
    """The H200 loop's trainer side on the CPU: R3 steps with the live-routing diagnostics and per-token logprobs,
    each followed by what a push does in the trainer's process (the HF views, the weight check's digest, the
    packed IPC buffer filled). After the first step (which makes the Adam moments) nothing may accumulate."""
    from agentrl.inference.ipc_buffer import PackedIpcBuffer
    from agentrl.trainer.checkpoint import hf_state_views
    from agentrl.weight_digest import tensor_digests

    trainer = _trainer(tiny_glm_dir, router_replay=True, router_replay_diagnostics=True,
                       parallel={"param_dtype": "bfloat16"})
    buffer = PackedIpcBuffer(device="cpu")
    samples = make_samples()
    kept = []
    for _ in range(5):
        trainer.train_on_samples(samples, logprobs_of=[0, 2])
        state = hf_state_views(trainer)
        tensor_digests(state, wire=lambda t: torch.bfloat16 if t.dim() > 1 else torch.float32,
                       served=("bfloat16", "float32"))
        for _chunk in buffer.fill(((name, t.to(torch.bfloat16)) for name, t in state.items()), size=1 << 16):
            pass
        del state
        kept.append(_live_tensor_bytes())
    assert kept[1:] == [kept[1]] * 4, kept  # flat from the second step on
    assert buffer.allocations == 1


def _with_gate_weights(samples, *, seed: int = 3):
    """The samples that carry routed experts, each given random gate weights beside its ids."""
    import numpy as np

    from agentrl.routed import RoutedExperts

    rng = np.random.default_rng(seed)
    out = []
    for sample in samples:
        if sample.routed_experts is None:
            continue
        ids = sample.routed_experts.array
        weights = rng.random(ids.shape).astype(np.float32)
        out.append(sample.model_copy(update={"routed_experts": RoutedExperts(ids, weights)}))
    return out


def test_the_three_router_replay_arms_are_measured_on_the_same_samples(tiny_glm_dir):
    """Live routing, replayed ids, replayed ids + gate weights: whichever arm trains, all three are reported."""
    samples = _with_gate_weights(make_samples())
    ids_arm = _trainer(tiny_glm_dir, router_replay_diagnostics=True).train_on_samples(samples)
    weights_arm = _trainer(tiny_glm_dir, router_replay_diagnostics=True,
                           router_replay_weights=True).train_on_samples(samples)
    assert ids_arm["replayed_weights_fraction"] == 0.0 and weights_arm["replayed_weights_fraction"] == 1.0
    for metrics in (ids_arm, weights_arm):
        assert {"mismatch_kl_live_routing", "mismatch_kl_replay_ids", "mismatch_kl_replay_ids_weights",
                "mismatch_large_fraction_replay_ids_weights", "mismatch_max_log_ratio_replay_ids"} <= set(metrics)
    assert ids_arm["mismatch_kl_replay_ids"] == pytest.approx(ids_arm["mismatch_kl"], rel=1e-6)
    assert weights_arm["mismatch_kl_replay_ids_weights"] == pytest.approx(weights_arm["mismatch_kl"], rel=1e-6)
    # the arm a step does not train on is the one the other step trains on
    assert ids_arm["mismatch_kl_replay_ids_weights"] == pytest.approx(weights_arm["mismatch_kl"], rel=1e-5)
    assert weights_arm["mismatch_kl_replay_ids"] == pytest.approx(ids_arm["mismatch_kl"], rel=1e-5)
    assert abs(weights_arm["mismatch_kl"] - ids_arm["mismatch_kl"]) > 1e-3  # random weights move the logprobs
    without = _trainer(tiny_glm_dir, router_replay_diagnostics=True).train_on_samples(make_samples())
    assert "mismatch_kl_replay_ids_weights" not in without  # no sample carried gate weights
