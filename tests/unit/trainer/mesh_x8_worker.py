"""torchrun worker for the 4-rank CPU test of the 8-GPU scaling layouts (gloo).

Usage: torchrun --nproc_per_node 4 mesh_x8_worker.py MODEL_DIR OUT_FILE EP:CP[,EP:CP...]

For each layout it records every rank's process groups (EP, experts' FSDP, CP) as built by
`build_meshes`, and trains with `run_steps` (no checkpoint), saving rank 0's results.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import run_steps, save_rank_results


def _groups(model_dir: str, ep: int, cp: int) -> dict:
    from agentrl.trainer.models.args import MoEModelArgs
    from agentrl.trainer.parallel import build_meshes, plan_layout

    args = MoEModelArgs.from_hf_dir(model_dir)
    plan = plan_layout(args, world=dist.get_world_size(), row_tokens=32, ep=ep, cp=cp)
    meshes = build_meshes(plan, device_type="cpu")
    mine = {
        "ep": dist.get_process_group_ranks(meshes.ep.get_group()) if meshes.ep is not None else None,
        "ep_fsdp": dist.get_process_group_ranks(meshes.ep_fsdp.get_group()) if meshes.ep_fsdp is not None else None,
        "cp": dist.get_process_group_ranks(meshes.cp_group) if meshes.cp_group is not None else None,
        "dp_rank": meshes.dp_rank, "cp_rank": meshes.cp_rank,
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"plan": plan.describe(), "ranks": everyone}


def main() -> None:
    model_dir, out_file, layouts = sys.argv[1], sys.argv[2], sys.argv[3].split(",")

    def train(layout: str) -> dict:
        ep, cp = (int(x) for x in layout.split(":"))
        return {**_groups(model_dir, ep, cp), **run_steps(model_dir, steps=2, ep=ep, cp=cp)}

    save_rank_results(out_file, layouts, train)


if __name__ == "__main__":
    main()
