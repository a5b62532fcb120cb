"""`agentrl pretrain` as a user runs it: held-out NLL falls, experts specialise, and bad input is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import ROOT, finish, start_cli  # noqa: E402

SMALL = ["--set", "steps=60", "--set", "batch_rows=8", "--set", "trainer.row_tokens=256", "--set", "eval_every=20",
         "--set", f'corpus.roots=["{ROOT / "sdk"}"]', "--set", "corpus.heldout_fraction=0.1"]


def test_pretraining_lowers_heldout_nll_and_specialises_the_experts(tmp_path):
    output = tmp_path / "pretrained"
    code, said = finish(start_cli("pretrain", *SMALL, "--set", f"output={output}"), timeout=300)
    assert code == 0, said[-2000:]
    summary = json.loads((output / "pretrain.json").read_text())
    init_nll, final_nll = summary["change"]["heldout_nll"]
    assert final_nll < init_nll - 0.8, summary["change"]
    init_nmi, final_nmi = summary["change"]["class_nmi"]
    assert final_nmi > init_nmi + 0.1, summary["change"]  # experts see different kinds of characters
    assert [point["step"] for point in summary["curve"]] == [0, 20, 40, 60]
    assert summary["corpus"]["heldout_files"] > 0 and summary["corpus"]["train_passes"] == 1
    lines = (output / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 60 and "heldout_nll" in json.loads(lines[19])
    assert (output / "plots" / "heldout.png").stat().st_size > 0
    assert (output / "plots" / "specialisation.png").stat().st_size > 0
    assert json.loads((output / "model" / "config.json").read_text())["model_type"] == "glm4_moe"
    assert "held-out" in said and "class_nmi" in said

    # a second run into the same folder is refused before anything is touched
    before = (output / "pretrain.json").read_bytes()
    code, said = finish(start_cli("pretrain", *SMALL, "--set", f"output={output}"), timeout=120)
    assert code == 2 and "already holds files" in said and "Traceback" not in said, said
    assert (output / "pretrain.json").read_bytes() == before


def test_a_corpus_folder_that_is_missing_is_one_line(tmp_path):
    code, said = finish(start_cli("pretrain", "--set", f'corpus.roots=["{tmp_path / "nowhere"}"]',
                                  "--set", f"output={tmp_path / 'out'}"), timeout=120)
    assert code == 2 and "corpus.roots:" in said and "is not a folder" in said and "Traceback" not in said, said
    assert not (tmp_path / "out").exists()
