"""torchrun worker for the trainer's multi-process CPU tests (gloo): runs several layouts, saves results.

Usage: torchrun --nproc_per_node 2 dist_worker.py MODEL_DIR OUT_FILE CKPT_DIR LAYOUT[,LAYOUT...]
with LAYOUT one of fsdp (ep=1, cp=1), ep (ep=2), cp (cp=2), epcp (ep=2, cp=2).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import run_steps, save_rank_results  # noqa: E402

LAYOUTS = {"fsdp": (1, 1), "ep": (2, 1), "cp": (1, 2), "epcp": (2, 2)}


def main() -> None:
    model_dir, out_file, ckpt_dir, layouts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")

    def train(name: str) -> dict:
        ep, cp = LAYOUTS[name]
        return run_steps(model_dir, ep=ep, cp=cp, checkpoint_dir=f"{ckpt_dir}/{name}")

    save_rank_results(out_file, layouts, train)


if __name__ == "__main__":
    main()
