"""`run.loggers`: step metrics into real TensorBoard event files and a real offline W&B run.

TensorBoard's own reader (`EventAccumulator`) loads the event files; the W&B run file is read
back with `tests/wandb_records.py` (LevelDB log records of wandb's own protobufs).
"""

from __future__ import annotations

import glob
import sys

import pytest

from agentrl.errors import ConfigError
from agentrl.rl.config import load_run_config
from agentrl.rl.loggers import make_loggers, scalars


def _rows() -> list[dict]:
    return [{"step": step, "reward": 0.1 * step, "reward_std": 0.05, "mismatch_kl": 1e-4 * (step + 1),
             "staleness": {"0": 3, "1": step}, "dropped_stale": step % 2, "tokens_per_s": 100.0 + step,
             "step_time_s": 2.0, "wait_s": 1.0, "train_s": 0.5, "bound": "inference" if step else "trainer",
             "first_error": "boom", "train/loss": float("nan") if step == 1 else 0.5, "time": 1.7e9 + step}
            for step in range(4)]


def test_scalars_flatten_and_keep_only_finite_numbers():
    values = scalars(_rows()[1])
    assert values["staleness/1"] == 1.0 and values["inference_bound"] == 1.0
    assert "first_error" not in values and "bound" not in values
    assert "train/loss" not in values  # NaN left out


def test_tensorboard_event_files_load_in_tensorboards_reader(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [logger] = make_loggers(["tensorboard"], run_dir=tmp_path, run_name="t")
    for row in _rows():
        logger.log(row, step=row["step"])
    logger.close()
    reader = EventAccumulator(str(tmp_path / "tensorboard"))
    reader.Reload()
    tags = set(reader.Tags()["scalars"])
    assert {"reward", "mismatch_kl", "staleness/0", "staleness/1", "tokens_per_s", "wait_s"} <= tags
    expected = [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(e.step, round(e.value, 6)) for e in reader.Scalars("reward")] == expected
    assert [e.step for e in reader.Scalars("train/loss")] == [0, 2, 3]  # the NaN step is left out
    assert reader.Scalars("reward")[2].wall_time == pytest.approx(1.7e9 + 2)


def test_wandb_offline_run_folder_holds_the_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from tests.wandb_records import history_rows

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    [logger] = make_loggers(["wandb"], run_dir=tmp_path, run_name="my-run", config={"lr": 3e-4})
    assert logger.mode == "offline"
    for row in _rows():
        logger.log(row, step=row["step"])
    logger.close()
    [run_file] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = history_rows(run_file)
    assert [row["_step"] for row in history] == [0, 1, 2, 3]
    assert [row["reward"] for row in history] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert history[3]["staleness/1"] == 3 and history[0]["inference_bound"] == 0


def _log(logger, steps, *, offset: float) -> None:
    for step in steps:
        logger.log({"step": step, "reward": offset + step, "time": 1.7e9 + offset + step}, step=step)
    logger.close()


def test_a_resumed_run_continues_the_tensorboard_curves_without_repeating_steps(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [first] = make_loggers(["tensorboard"], run_dir=tmp_path, run_name="t")
    _log(first, range(5), offset=0.0)  # interrupted after step 4; the checkpoint is at step 2
    [resumed] = make_loggers(["tensorboard"], run_dir=tmp_path, run_name="t", resume_step=2)
    _log(resumed, range(2, 6), offset=100.0)
    assert len(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))) == 2
    reader = EventAccumulator(str(tmp_path / "tensorboard"))
    reader.Reload()
    assert [(e.step, e.value) for e in reader.Scalars("reward")] == [
        (0, 0.0), (1, 1.0), (2, 102.0), (3, 103.0), (4, 104.0), (5, 105.0)]


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from tests.wandb_records import history_rows

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    [first] = make_loggers(["wandb"], run_dir=tmp_path, run_name="r")
    _log(first, range(5), offset=0.0)
    run_id = (tmp_path / "wandb" / "run_id").read_text().strip()
    assert run_id == first.run_id
    [other] = make_loggers(["wandb"], run_dir=tmp_path / "fresh", run_name="r")  # not resumed: a new run
    _log(other, range(1), offset=0.0)
    assert other.run_id != run_id
    [resumed] = make_loggers(["wandb"], run_dir=tmp_path, run_name="r", resume_step=2)
    assert resumed.run_id == run_id
    _log(resumed, range(2, 6), offset=100.0)
    files = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(path.endswith(f"run-{run_id}.wandb") for path in files)
    histories = sorted((history_rows(path) for path in files), key=lambda rows: rows[0]["_step"])
    assert [row["_step"] for row in histories[0]] == [0, 1, 2, 3, 4]
    assert [(row["_step"], row["reward"]) for row in histories[1]] == [(2, 102.0), (3, 103.0), (4, 104.0),
                                                                       (5, 105.0)]


def test_logger_names_are_checked():
    with pytest.raises(ConfigError, match="run.loggers"):
        load_run_config(overrides=['run.loggers=["tensorbored"]'])
    with pytest.raises(ConfigError, match="unknown logger 'x'"):
        make_loggers(["x"], run_dir=".", run_name="r")


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch, name):
    from agentrl.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, name, None)  # what `import name` sees where the extra is not installed
    with pytest.raises(MissingExtraError, match=rf"pip install 'agentrl\[{name}\]'"):
        make_loggers([name], run_dir=tmp_path, run_name="r")
