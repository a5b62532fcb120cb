"""MLA (tiny DeepSeek-V3) on several CPU ranks (gloo, 2 ranks via torchrun): FSDP2, EP=2, CP=2, EP=2+CP=2.

The same check as `test_trainer_distributed` for the GLM model: 3 training steps on the
same packed batches as one process, metrics within 1e-5 relative and final weights within
2e-3 (`trainer_helpers.assert_matches_single_process`). Under CP the ranks all-gather the
compressed latent kv (`models.mla`), so CP=2 exercises that gather and its backward. Each
run also resumes from a DCP checkpoint saved before its last step and repeats that step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import assert_matches_single_process, launch_ranks, run_steps

HERE = Path(__file__).parent
LAYOUTS = ["fsdp", "ep", "cp", "epcp"]


@pytest.fixture(scope="module")
def distributed_results(tiny_deepseek_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-mla")
    launch_ranks(HERE / "dist_worker.py", 2, tiny_deepseek_dir, out / "results.pt", out / "ckpt", ",".join(LAYOUTS),
                 timeout=600)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def single_process(tiny_deepseek_dir, tmp_path_factory):
    return run_steps(tiny_deepseek_dir, checkpoint_dir=tmp_path_factory.mktemp("single-mla") / "ckpt")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_layout_matches_single_process(layout, distributed_results, single_process):
    result = distributed_results[layout]
    assert f"cp={2 if 'cp' in layout else 1} ep={2 if 'ep' in layout else 1}" in result["plan"]
    assert_matches_single_process(result, single_process, layout)
    last, resumed = result["metrics"][-1], result["resumed"]  # DCP checkpoint before the last step, resumed
    for key in ("loss", "mismatch_kl", "grad_norm"):
        assert resumed[key] == pytest.approx(last[key], rel=1e-6, abs=1e-7), (layout, key)



def test_training_moved_the_latent_attention_weights(tiny_deepseek_dir, single_process):
    from agentrl.trainer.models.args import MoEModelArgs
    from agentrl.trainer.models.build import build_model
    from agentrl.trainer.models.state_dict import load_hf_weights

    initial = build_model(MoEModelArgs.from_hf_dir(tiny_deepseek_dir))
    load_hf_weights(initial, tiny_deepseek_dir)
    trained = single_process["state"]
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        key = f"layers.1.self_attn.{name}.weight"
        assert not torch.equal(trained[key], initial.state_dict()[key]), key
