"""torchrun worker for the LoRA test on 2 CPU ranks (gloo): FSDP, then FSDP + CP; losses and adapter tensors saved.

Usage: torchrun --nproc_per_node 2 lora_worker.py MODEL_DIR OUT_FILE
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import lora_steps, save_rank_results  # noqa: E402


def main() -> None:
    model_dir, out_file = sys.argv[1], sys.argv[2]
    save_rank_results(out_file, ["fsdp", "cp"], lambda layout: lora_steps(model_dir, cp=2 if layout == "cp" else 1))


if __name__ == "__main__":
    main()
