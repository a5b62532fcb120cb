"""Helpers for the trainer tests: tiny GLM-4.5 / Qwen3-MoE / NemotronH HF folders built with transformers."""

from __future__ import annotations

import torch


def tiny_glm_config(**overrides):
    from transformers import Glm4MoeConfig

    values = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "partial_rotary_factor": 0.5,
        "attention_bias": True, "use_qk_norm": False, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "tie_word_embeddings": False,
    }
    values.update(overrides)
    return Glm4MoeConfig(**values)


def tiny_nemotron_config(**overrides):
    """A tiny random Nemotron-3 (NemotronH): Mamba-2, MoE, attention, MLP, Mamba, MoE; 8 experts top-2.

    Mamba chunks of 8 tokens, so packed rows of 32 tokens cross chunk and document boundaries.
    """
    from transformers import NemotronHConfig

    values = {
        "vocab_size": 128, "hidden_size": 64, "hybrid_override_pattern": "ME*-ME", "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "mamba_num_heads": 8, "mamba_head_dim": 16,
        "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "moe_latent_size": None, "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "tie_word_embeddings": False,
    }
    values.update(overrides)
    return NemotronHConfig(**values)


def perturbed_mamba_mixer(model_dir):
    """A Mamba-2 mixer of the tiny Nemotron in ``model_dir`` with seeded parameters moved off their init values."""
    from agentrl.trainer.models.args import MoEModelArgs
    from agentrl.trainer.models.mamba2 import Mamba2Mixer

    args = MoEModelArgs.from_hf_dir(model_dir)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(args)
    with torch.no_grad():
        for param in mixer.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return args, mixer


def make_hf_folder(path, config, *, seed: int = 0, max_shard_size: str | None = None):
    """Create a HF model folder with random weights (correction bias random too, so it matters)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.copy_(torch.randn_like(buffer) * 0.1)
        for param in model.parameters():  # larger weights so routing and logits are not flat
            param.mul_(3.0) if param.dim() > 1 else None
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def make_samples(*, count: int = 6, vocab: int = 128, moe_layers: int = 2, num_experts: int = 8, top_k: int = 2,
                 seed: int = 0, with_experts: bool = True):
    """Deterministic training samples of varied lengths, half of them with routed experts (R3)."""
    from agentrl.types import TrainingSample

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        length = 6 + (index * 5) % 19
        tokens = torch.randint(0, vocab, (length,), generator=generator).tolist()
        prompt = 2 + index % 3
        mask = [j >= prompt for j in range(length)]
        logprobs = (-torch.rand(length, generator=generator) * 3 - 2).tolist()
        experts = None
        if with_experts and index % 2 == 0:
            experts = [[torch.randperm(num_experts, generator=generator)[:top_k].tolist() for _ in range(moe_layers)]
                       for _ in range(length)]
        samples.append(TrainingSample(
            token_ids=tokens, loss_mask=mask, inference_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs, mask)],
            policy_versions=[1 if m else -1 for m in mask], advantage=float(index % 3) - 1.0, routed_experts=experts,
        ))
    return samples


def run_steps(model_dir, *, steps: int = 3, ep=1, cp=1, row_tokens: int = 32, checkpoint_dir=None, samples=None,
              device: str = "cpu", param_dtype: str = "float32"):
    """Train ``steps`` steps; returns per-step metrics and the final full state dict (collective)."""
    from agentrl.trainer.checkpoint import full_state_dict
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import Trainer

    config = TrainerConfig(row_tokens=row_tokens, optimizer={"lr": 1e-2, "max_grad_norm": 1.0},
                           parallel={"ep": ep, "cp": cp, "activation_checkpointing": True,
                                     "param_dtype": param_dtype})
    trainer = Trainer(config, model_dir=model_dir, device=device)
    samples = samples or make_samples()
    batches = [samples[i % 2::2] if i % 2 else samples for i in range(steps)]
    metrics = []
    resumed = None
    for index, batch in enumerate(batches):
        if checkpoint_dir is not None and index == steps - 1:
            trainer.save_checkpoint(checkpoint_dir)
        metrics.append(trainer.train_on_samples(batch))
    if checkpoint_dir is not None:
        trainer.load_checkpoint(checkpoint_dir)
        resumed = trainer.train_on_samples(batches[-1])
    return {"metrics": metrics, "resumed": resumed, "state": full_state_dict(trainer), "plan": trainer.plan.describe()}


def launch_ranks(worker, nproc: int, *args: str, timeout: int) -> None:
    """Run the torchrun `worker` script on `nproc` CPU ranks (gloo, 127.0.0.1); fail with its stderr."""
    import os
    import subprocess
    import sys

    from agentrl.inference.server import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(worker), *map(str, args)]
    proc = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def save_rank_results(out_file, layouts, train) -> None:
    """The body of a torchrun worker: a gloo group, `train(layout)` for each layout, rank 0 saves them."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = {layout: train(layout) for layout in layouts}
        if dist.get_rank() == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


def assert_matches_single_process(result, single, label) -> None:
    """A multi-rank run's per-step metrics (1e-5 relative) and final weights (2e-3) equal one process's."""
    import pytest

    for step, (got, want) in enumerate(zip(result["metrics"], single["metrics"], strict=True)):
        for key in ("loss", "mismatch_kl", "mismatch_large_fraction", "mismatch_max_log_ratio", "masked_fraction",
                    "loss_tokens", "tokens"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (label, step, key)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (label, step)
    assert set(result["state"]) == set(single["state"])
    for key, tensor in single["state"].items():
        torch.testing.assert_close(result["state"][key], tensor, atol=2e-3, rtol=0, msg=f"{label} {key}")


def tiny_deepseek_config(**overrides):
    """A tiny DeepSeek-V3 (MLA, YaRN with mscale, group-limited routing) with the tiny GLM's MoE shapes."""
    from transformers import DeepseekV3Config

    values = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "max_position_embeddings": 256, "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "rope_interleave": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    }
    values.update(overrides)
    return DeepseekV3Config(**values)


def lora_steps(model_dir, *, cp: int = 1, steps: int = 3) -> dict:
    """Steps of a LoRA trainer (attention, experts, shared experts; R3 samples): losses and full adapter tensors."""
    from agentrl.trainer.checkpoint import full_state_dict
    from agentrl.trainer.config import LoraConfig, TrainerConfig
    from agentrl.trainer.trainer import Trainer

    # Adam eps 1e-6, not 1e-8: an adapter element whose gradient is at float32 noise level (B's elements right after
    # their zero start) would take a step near lr in a direction the ranks' summation order decides (3.5e-4 apart
    # between CP=2 and one process on the 2-core machine, 2026-12-04), which no tolerance of the layouts' own
    # rounding covers. lr 1e-2, not 5e-2: at 5e-2 CP=2's rounding grew to 2.5e-4 in an adapter element after three
    # steps (over the test's 2e-4; it failed in the suite, 2026-12-05); at 1e-2 it is 7.6e-6.
    config = TrainerConfig(optimizer={"lr": 1e-2, "eps": 1e-6}, row_tokens=64, parallel={"cp": cp},
                           lora=LoraConfig(rank=4, alpha=8))
    # One thread, as each rank of `save_rank_results` runs, whatever thread count earlier tests left in the process:
    # the reference and the ranks sum in the same order.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(config, model_dir=model_dir)
        batch = trainer.pack(make_samples())
        losses = [trainer.step(batch)["loss"] for _ in range(steps)]
        adapters = full_state_dict(trainer, adapters_only=True)
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "adapters": adapters, "layout": trainer.plan.describe()}
