"""Kernel-format weight updates on CUDA vLLM (`inference.weight_format = "kernel"`; issue 41 item 3; skipped without
a GPU): the trainer's tensors packed into the served layout (q/k/v and gate/up fused, each layer's experts stacked:
`inference/kernel_format.py`) and sent through the ipc engine with `is_checkpoint_format=false`, which vLLM copies
straight into its parameters. After two training steps the served prompt logprobs must equal the trainer's within
bf16 tolerance (they moved well beyond it), and the weight check must pass on every parameter. A wrong order
inside a fused tensor (gate and up swapped) keeps every sum the check compares but not the logprobs, so the
logprobs are the test of the layout. `scripts/gpu_run.sh features` runs it (outside the one-GPU check's tests).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_feature, pytest.mark.integration, pytest.mark.timeout(600)]
torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))


def test_a_kernel_format_update_gives_the_trainers_logprobs():
    from test_loop_gpu import TOKENS, _served_logprobs, _server, _stepped_trainer, _trainer_logprobs

    from agentrl.inference.direct_weights import IpcWeightPublisher
    from agentrl.models import ensure_model

    model_dir = ensure_model("tiny-moe")
    with _server(model_dir, dtype="bfloat16", transport="ipc") as server:
        before = _served_logprobs(server.url, TOKENS)
        trainer, state = _stepped_trainer(model_dir)
        ours = _trainer_logprobs(trainer, TOKENS)
        publisher = IpcWeightPublisher([server.url], chunk_bytes=1 << 20, kernel_format=True)
        started = time.monotonic()
        result = publisher.publish(state, 1)
        took = time.monotonic() - started
        after = _served_logprobs(server.url, TOKENS)
        sent = len(next(iter(publisher._layouts.values())))
    moved = max(abs(a - b) for a, b in zip(before, ours))
    error = max(abs(a - b) for a, b in zip(after, ours))
    check = result.checks[server.url]
    print(f"kernel-format ipc update of tiny-moe: {sent} tensors instead of {len(state)}, {took * 1000:.0f} ms; "
          f"moved {moved:.3f}, served vs trainer {error:.4f}; weight check {check.checked} parameters, max error "
          f"{check.max_error:.2e} of the tolerance")
    assert sent < len(state)
    assert moved > 0.2, moved
    assert error < 0.05, (error, after, ours)
    assert check.checked > 20 and check.max_error < 1.0 and not check.unserved, check
