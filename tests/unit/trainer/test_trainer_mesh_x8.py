"""The 8-GPU scaling run's mesh shapes on 4 CPU ranks (gloo): EP spanning CP groups.

The x8 run (`bench/trainer_mfu_x8.py`) uses EP=8 over all ranks with CP 2 or 4, so one
expert-parallel group holds several CP groups and several data-parallel rows. The 2-rank
tests (`test_trainer_distributed.py`) cannot show that shape; here 4 ranks run EP=4 x CP=2
(dp=2), EP=4 x CP=4 (dp=1) and EP=2 x CP=2 (experts FSDP-sharded over 2), check the groups
`build_meshes` forms, and train 2 steps that must match one process (float32; loss, KL,
grad norm within 1e-5 relative as in the 2-rank tests; final weights within 2e-3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_helpers import assert_matches_single_process, launch_ranks, run_steps

HERE = Path(__file__).parent
LAYOUTS = ["4:2", "4:4", "2:2"]


@pytest.fixture(scope="module")
def four_rank_results(tiny_glm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh_x8") / "results.pt"
    launch_ranks(HERE / "mesh_x8_worker.py", 4, tiny_glm_dir, out, ",".join(LAYOUTS), timeout=300)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def single_process(tiny_glm_dir):
    return run_steps(tiny_glm_dir, steps=2)


EXPECTED_GROUPS = {  # per rank: EP group, experts' FSDP group, CP group
    "4:2": [([0, 1, 2, 3], [r], cp) for r, cp in zip(range(4), ([0, 1], [0, 1], [2, 3], [2, 3]))],
    "4:4": [([0, 1, 2, 3], [r], [0, 1, 2, 3]) for r in range(4)],
    "2:2": [(ep, fsdp, cp) for ep, fsdp, cp in zip(([0, 1], [0, 1], [2, 3], [2, 3]), ([0, 2], [1, 3], [0, 2], [1, 3]),
                                                   ([0, 1], [0, 1], [2, 3], [2, 3]))],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mesh_groups(layout, four_rank_results):
    ep, cp = (int(x) for x in layout.split(":"))
    result = four_rank_results[layout]
    assert f"world=4 dp={4 // cp} cp={cp} ep={ep} (experts fsdp={4 // ep})" in result["plan"]
    for rank, (got, (want_ep, want_fsdp, want_cp)) in enumerate(zip(result["ranks"], EXPECTED_GROUPS[layout])):
        assert (got["ep"], got["ep_fsdp"], got["cp"]) == (want_ep, want_fsdp, want_cp), (layout, rank)
        assert (got["dp_rank"], got["cp_rank"]) == (rank // cp, rank % cp), (layout, rank)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_four_rank_layout_matches_single_process(layout, four_rank_results, single_process):
    result = four_rank_results[layout]
    assert_matches_single_process(result, single_process, layout)
    assert any(not torch.equal(result["state"][k], v) for k, v in single_process["state"].items())
