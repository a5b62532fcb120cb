"""cookbook/cpu-agent/figures.py: the training windows in its table are the ones its difference compares."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _figures():
    spec = importlib.util.spec_from_file_location("agent_figures", ROOT / "cookbook" / "cpu-agent" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _evaluation(folder: Path, solved: list[list[int]]) -> None:
    folder.mkdir()
    (folder / "results.jsonl").write_text("".join(
        json.dumps({"task_index": task, "reward": float(reward)}) + "\n"
        for task, rewards in enumerate(solved) for reward in rewards))


def test_a_short_run_shows_the_shrunk_windows_its_difference_compares(tmp_path):
    """A walk-through found a 10-step run's table showing the first and last 20 steps (the whole run, twice) beside
    a difference of 5-step windows; a failed step (NaN) also went into the cells but not into the difference."""
    solved = [0.0, 0.1, float("nan"), 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "metrics/solved": value}) + "\n"
                                               for step, value in enumerate(solved)))
    _evaluation(tmp_path / "eval", [[1, 1], [0, 1]])
    _evaluation(tmp_path / "eval-baseline", [[0, 1], [0, 0]])
    text = _figures().markdown(run, tmp_path / "eval", 20)
    assert "first 4 steps against the last 4" in text
    row = text.strip().splitlines()[-1]
    first, last, difference = (cell.strip() for cell in row.strip("|").split("|"))
    assert first.startswith("0.150 ") and last.startswith("0.750 ")  # (0, .1, .2, .3) and (.6, .7, .8, .9)
    assert difference.startswith("+0.600 ")
