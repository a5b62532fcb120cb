"""Nemotron-3 (NemotronH) on 2 gloo ranks: FSDP2, EP=2, CP=2 and EP=2+CP=2 equal one process.

The same check as `test_trainer_distributed` for GLM (3 steps on the same packed batches:
losses, mismatch KL and grad norms within 1e-5 relative, final weights within 2e-3, and a
DCP resume that repeats the last step), on the tiny hybrid model: under CP the attention layer
gathers K/V while both Mamba-2 layers trade the sequence split for a head split (all-to-all),
scan whole documents and trade back; under EP the non-gated experts travel by all-to-all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer_helpers import assert_matches_single_process, launch_ranks, run_steps

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def distributed_results(tiny_nemotron_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-nemotron")
    launch_ranks(HERE / "dist_worker.py", 2, tiny_nemotron_dir, out / "results.pt", out / "ckpt", "fsdp,ep,cp,epcp",
                 timeout=600)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def single_process(tiny_nemotron_dir, tmp_path_factory):
    return run_steps(tiny_nemotron_dir, checkpoint_dir=tmp_path_factory.mktemp("single-nemotron") / "ckpt")


@pytest.mark.parametrize("layout", ["fsdp", "ep", "cp", "epcp"])
def test_nemotron_layout_matches_single_process(layout, distributed_results, single_process):
    result = distributed_results[layout]
    assert_matches_single_process(result, single_process, layout)
    assert any(not torch.equal(result["state"][k], v) for k, v in single_process["state"].items())
    assert "mixer.A_log" in " ".join(result["state"])  # the Mamba parameters were trained and gathered too


@pytest.mark.parametrize("layout", ["fsdp", "ep", "cp", "epcp"])
def test_nemotron_resume_from_dcp_checkpoint_repeats_the_step(layout, distributed_results):
    result = distributed_results[layout]
    last, resumed = result["metrics"][-1], result["resumed"]
    for key in ("loss", "mismatch_kl", "grad_norm"):
        assert resumed[key] == pytest.approx(last[key], rel=1e-6, abs=1e-7), (layout, key)
