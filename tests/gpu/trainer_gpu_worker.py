"""torchrun worker for the trainer's GPU tests (NCCL): runs layouts, rank 0 saves metrics.

Usage: torchrun --nproc_per_node N trainer_gpu_worker.py MODEL_DIR OUT_FILE CKPT_DIR DTYPE LAYOUT[,LAYOUT...]
LAYOUT: single (ep=1, cp=1), ep (ep=2), cp (cp=2), epcp (ep=2, cp=2).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit" / "trainer"))
from trainer_helpers import run_steps  # noqa: E402

LAYOUTS = {"single": (1, 1), "ep": (2, 1), "cp": (1, 2), "epcp": (2, 2)}


def main() -> None:
    model_dir, out_file, ckpt_dir, dtype, layouts = sys.argv[1:6]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if world > 1:
        dist.init_process_group("nccl")
    results = {}
    try:
        for name in layouts.split(","):
            ep, cp = LAYOUTS[name]
            result = run_steps(model_dir, ep=ep, cp=cp, row_tokens=64, checkpoint_dir=f"{ckpt_dir}/{name}-{dtype}",
                               device=f"cuda:{local_rank}", param_dtype=dtype)
            results[name] = {"metrics": result["metrics"], "resumed": result["resumed"], "plan": result["plan"]}
        if world == 1 or dist.get_rank() == 0:
            torch.save(results, out_file)
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
