"""vLLM generation time per RL step for a deployment, from the decode rate measured on the H200.

One decode step of an engine (one token for each running sequence) takes

    t(b) = overhead + max((weights + b x context x KV bytes) / GPU / HBM, 2 x active x b / GPU / rate)

(all experts are read at the batch sizes of RL: 1 - (1 - k/E)^b ~ 1). The batch ``b`` is the
smaller of the rollouts in flight per engine and what the KV cache holds at the samples'
length. ``overhead`` (scheduler, sampler, HTTP) is fitted to `MEASURED_DECODE`, the one decode
throughput measured on the lent H200; every other model/context/batch is an extrapolation of
that point through this formula and is printed as such. Prefill runs at `prefill_mfu` of the
dense GEMM rate over the tokens the policy does not decode, added to decode time (chunked prefill
shares the engines' steps; counting both in full is the pessimistic end).

What it does not know: whether the overhead is per step (as assumed) or grows with the batch (then
small batches decode faster than predicted); FP8 decode kernels (the measurement was bf16); tuned
MoE configs (the measured server had none for the H200); wide-EP all-to-all in decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrl.trainer.models.args import MoEModelArgs

__all__ = [
    "DecodeMeasurement",
    "EngineShape",
    "MEASURED_DECODE",
    "decode_step_s",
    "decode_overhead_s",
    "predict_generation",
]


@dataclass(frozen=True)
class DecodeMeasurement:
    """One measured vLLM decode throughput."""

    model: str
    hf_config: dict
    gpus: int
    batch: int
    context: int
    tokens_per_s: float
    weight_bytes: float
    source: str


# GLM-4.5-Air widths in 3 layers (1 dense + 2 MoE, 128 experts top-8) with GLM's vocabulary: 5.2B parameters.
_AIR_3_LAYERS = {
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 3,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "tie_word_embeddings": False,
}

MEASURED_DECODE = [
    DecodeMeasurement(
        model="GLM-4.5-Air widths, 3 layers (5.2B), bf16",
        hf_config=_AIR_3_LAYERS,
        gpus=1,
        batch=256,
        context=328,
        tokens_per_s=8300.0,
        weight_bytes=5.2e9 * 2,
        source="measured: CUDA vLLM 0.24 on one H200, 256 concurrent requests x 256 completion tokens, "
        "200-token "
        "prompts, gpu_memory_utilization 0.5 (docs/DESIGN.md)",
    ),
]


@dataclass(frozen=True)
class EngineShape:
    """One vLLM engine (replica or wide-EP instance) of a deployment."""

    engines: int
    gpus_per_engine: int
    fp8: bool

    @property
    def gpus(self) -> int:
        return self.engines * self.gpus_per_engine


def _kv_bytes_per_token(args, *, fp8: bool) -> float:
    """KV-cache bytes per token over all layers: MLA's latent + RoPE key, or K and V of the KV heads."""
    per_layer = (
        (args.kv_lora_rank + args.rotary_dim)
        if args.is_mla
        else 2 * args.num_key_value_heads * args.head_dim
    )
    return per_layer * args.num_hidden_layers * (1 if fp8 else 2)


def _roofline_s(
    args, *, weight_bytes: float, gpus: int, batch: float, context: float, fp8: bool, inputs
) -> float:
    """Weight + KV reads or the GEMMs of one decode step, whichever is longer, per GPU."""
    reads = (weight_bytes + batch * context * _kv_bytes_per_token(args, fp8=fp8)) / gpus
    flops = 2.0 * args.param_counts()["active"] * batch / gpus
    return max(reads / (inputs.hbm_gbs * 1e9), flops / (inputs.dense_gemm_tflops * 1e12))


def decode_overhead_s(inputs, measurement: DecodeMeasurement = MEASURED_DECODE[0]) -> float:
    """Per-step overhead: the measured step time minus its roofline (or `inputs.decode_overhead_s`)."""
    if inputs.decode_overhead_s is not None:
        return inputs.decode_overhead_s
    args = MoEModelArgs.from_hf_config(measurement.hf_config)
    step = measurement.batch / (measurement.tokens_per_s / measurement.gpus) / measurement.gpus
    roof = _roofline_s(
        args,
        weight_bytes=measurement.weight_bytes,
        gpus=measurement.gpus,
        batch=measurement.batch,
        context=measurement.context,
        fp8=False,
        inputs=inputs,
    )
    return max(0.0, step - roof)


def decode_step_s(args, engine: EngineShape, *, batch: float, context: float, inputs) -> float:
    """Seconds of one decode step of one engine at this batch and mean context."""
    weight_bytes = args.param_counts()["total"] * (1 if engine.fp8 else 2)
    return decode_overhead_s(inputs) + _roofline_s(
        args,
        weight_bytes=weight_bytes,
        gpus=engine.gpus_per_engine,
        batch=batch,
        context=context,
        fp8=engine.fp8,
        inputs=inputs,
    )


def predict_generation(
    args, engine: EngineShape, inputs, *, samples: int, mean_sample_tokens: float, concurrency: int
) -> dict[str, float]:
    """Generation seconds per step (decode + prefill) and the counts they come from."""
    weight_bytes = args.param_counts()["total"] * (1 if engine.fp8 else 2)
    free = (
        engine.gpus_per_engine * inputs.gpu_memory_gib * 1024**3 * inputs.kv_cache_utilization - weight_bytes
    )
    kv_seqs = max(0.0, free / (mean_sample_tokens * _kv_bytes_per_token(args, fp8=engine.fp8)))
    batch = min(concurrency / engine.engines, kv_seqs)
    if batch < 1:
        return {
            "generation_s": float("inf"),
            "decode_s": float("inf"),
            "prefill_s": 0.0,
            "batch_per_engine": batch,
            "kv_sequences_per_engine": kv_seqs,
            "decode_tokens_per_s_per_gpu": 0.0,
        }
    step = decode_step_s(args, engine, batch=batch, context=mean_sample_tokens / 2, inputs=inputs)
    per_gpu = batch / step / engine.gpus_per_engine
    decode_tokens = samples * mean_sample_tokens * inputs.completion_fraction
    decode_s = decode_tokens / (per_gpu * engine.gpus)
    prefill_tokens = samples * mean_sample_tokens - decode_tokens
    flops = (
        2.0 * args.param_counts()["active"]
        + 2.0 * len(args.attention_layers) * args.num_attention_heads * (args.head_dim + args.value_head_dim)
        * mean_sample_tokens / 2
    )
    prefill_s = prefill_tokens * flops / (engine.gpus * inputs.prefill_mfu * inputs.dense_gemm_tflops * 1e12)
    return {
        "generation_s": decode_s + prefill_s,
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "batch_per_engine": batch,
        "kv_sequences_per_engine": kv_seqs,
        "decode_step_s": step,
        "decode_tokens_per_s_per_gpu": per_gpu,
        "decode_tokens": decode_tokens,
        "rollout_decode_s": mean_sample_tokens * inputs.completion_fraction * step,
    }
