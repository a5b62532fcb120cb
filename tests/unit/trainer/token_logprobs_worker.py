"""torchrun worker: one step with per-token logprobs of every sample, each rank's part saved.

Usage: torchrun --nproc_per_node 2 token_logprobs_worker.py MODEL_DIR OUT_DIR LAYOUT[,LAYOUT...]
with LAYOUT fsdp (two data-parallel ranks: each trains other rows) or cp (cp=2: each rank
computes part of every row). Rank r writes OUT_DIR/rank<r>.pt: {layout: its token_logprobs}.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.trainer import Trainer

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from trainer_helpers import make_samples  # noqa: E402

LAYOUTS = {"fsdp": 1, "cp": 2}


def main() -> None:
    model_dir, out_dir, layouts = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        samples = make_samples(with_experts=False)
        parts = {}
        for layout in layouts:
            config = TrainerConfig(row_tokens=32, parallel={"cp": LAYOUTS[layout], "param_dtype": "float32"})
            trainer = Trainer(config, model_dir=model_dir, device="cpu")
            parts[layout] = trainer.train_on_samples(samples, logprobs_of=range(len(samples)))["token_logprobs"]
        torch.save(parts, f"{out_dir}/rank{dist.get_rank()}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
