"""`agentrl train`'s input checked before any start-up (issue 39): one line naming the --set or the field, exit 2,
within seconds, no run folder made; `agentrl --version`; `agentrl config keys`.

On the main before: `--set trainer.optimizer.lr=-1` failed after 105 s in a 67-line torch traceback, and
`--set orchestator.max_steps=10` was reported as an unknown key of the recipe file."""

from __future__ import annotations

import time
from pathlib import Path

import pytest


def _train(capsys, tmp_path, *sets: str) -> tuple[int, str, float]:
    from agentrl.cli import main

    started = time.monotonic()
    code = main(["train", "-o", str(tmp_path / "run"), *[arg for value in sets for arg in ("--set", value)]])
    captured = capsys.readouterr()
    return code, (captured.err + captured.out).strip(), time.monotonic() - started


@pytest.mark.parametrize(("value", "said"), [
    ("trainer.optimizer.lr=-1", "--set trainer.optimizer.lr: trainer.optimizer.lr = -1: must be at least 0"),
    ("trainer.optimizer.lr=nan", "trainer.optimizer.lr = nan: must be a finite number"),
    ("trainer.optimizer.betas=[0.9,1.5]", "--set trainer.optimizer.betas: trainer.optimizer: betas=[0.9, 1.5]: "
                                          "each Adam beta must be in [0, 1)"),
    ("trainer.optimizer.eps=0", "trainer.optimizer.eps = 0: must be greater than 0"),
    ("inference.gpu_memory_utilization=1.5", "inference.gpu_memory_utilization = 1.5: must be at most 1"),
    ("inference.max_model_len=4", "inference.max_model_len = 4: must be at least 16"),
    ("orchestator.max_steps=10", "--set orchestator.max_steps: unknown key 'orchestator' (did you mean "
                                 "'orchestrator'?)"),
    ("orchestrator.rollouts_per_group=1", "every advantage is 0 and nothing is learned"),
    ("eval.every=2", None),  # valid (the last case checks the split): eval.split "test" is held out
])
def test_bad_values_are_one_line_before_start_up(capsys, tmp_path, value, said):
    if said is None:
        code, output, took = _train(capsys, tmp_path, value, "eval.split=train")
        said = "eval.split='train' is the split the run trains on"
    else:
        code, output, took = _train(capsys, tmp_path, value)
    assert took < 5, took
    assert code == 2 and said in output and "Traceback" not in output, output
    assert len([line for line in output.splitlines() if line.startswith("error")]) == 1, output
    assert not (tmp_path / "run").exists()


def test_version_and_config_keys(capsys):
    import agentrl
    from agentrl import __version__
    from agentrl.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"agentrl {__version__} ({Path(agentrl.__file__).resolve().parent})"
    assert main(["config", "keys", "trainer.optimizer"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("trainer.optimizer.lr  (float, default 1e-06)  Learning rate") and len(lines) == 5
    assert main(["config", "keys", "nope"]) == 2
    assert "no config key starts with 'nope'" in capsys.readouterr().err


def test_unknown_environments_and_models_suggest_the_close_name(capsys):
    from agentrl.cli import main

    assert main(["train", "--env", "reverse-txt", "--dry-run"]) == 2
    assert "unknown environment 'reverse-txt'; did you mean 'reverse-text'" in capsys.readouterr().err
    assert main(["train", "--model", "tiny-mo", "--dry-run"]) == 2
    assert "unknown model 'tiny-mo' (did you mean 'tiny-moe'?)" in capsys.readouterr().err


def test_an_unknown_model_is_the_only_line_a_real_run_prints(capsys, tmp_path):
    """Not a "watch it: agentrl view runs/..." line naming a folder that is never made, nor a progress bar."""
    from agentrl.cli import main

    assert main(["train", "--model", "tiny-mo", "--set", f"run.output_dir={tmp_path}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("error: unknown model 'tiny-mo'") and not list(tmp_path.iterdir())


def test_what_a_real_run_refuses_dry_run_refuses_too(capsys, tmp_path):
    """A newcomer's walk-through (2026-12-07): `--dry-run` passed an argument the environment does not take, an output
    folder holding a run, and (eval) an unknown environment or model, all of which the real run refuses."""
    from agentrl.cli import main

    assert main(["train", "--env", "key-hunt", "--set", "env.args={pool_sise=4}", "--dry-run"]) == 2
    assert "bad arguments to key_hunt:load_environment: got an unexpected keyword argument 'pool_sise'" in \
        capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    for extra in (["--dry-run"], []):  # a real run: the one line comes before the start-up's output
        assert main(["train", "-o", str(tmp_path / "run"), *extra]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == (f"error: {tmp_path / 'run'}: a run already exists there; "
                                                       f"resume it (--resume {tmp_path / 'run'}) or choose another "
                                                       "run folder\n")
    assert main(["eval", "--env", "reverse-txt", "--model", "tiny-moe", "--dry-run"]) == 2
    assert "unknown environment 'reverse-txt'" in capsys.readouterr().err
    assert main(["eval", "--env", "reverse-text", "--model", "tiny-mo", "--dry-run"]) == 2
    assert "unknown model 'tiny-mo'" in capsys.readouterr().err
    assert main(["eval", "--env", "reverse-text", "--model", "tiny-moe", "--dry-run"]) == 0


def test_printed_steps_reads_back_the_step_lines():
    from agentrl.cli.train import _step_line, printed_steps

    lines = [_step_line({"step": step, "reward": 0.5, "mismatch_kl": 1e-3, "r3/replayed_fraction": 1.0,
                         "staleness": {0: 4, 1: 4}, "step_time_s": 2.0, "bound": "trainer"},
                        total=120, eta_s=65.0 if step < 119 else None) for step in (8, 9, 119)]
    noise = ["  held-out after step 9: avg@4 0.824 [0.748-0.893] pass@1 0.42 (16 tasks)", "resuming from step 8",
             "  train ━━━━ 9/120 0:00:56 reward 0.757"]
    assert printed_steps("\n".join([noise[1], lines[0], lines[1], noise[0], noise[2], lines[2]])) == [8, 9, 119]
    assert printed_steps("\n".join(noise)) == []


def test_a_failed_step_says_it_was_not_trained_instead_of_a_nan_kl():
    """A step with no sample to train on has no mismatch KL: its line says why it was not trained (a `kl nan`
    read as a diverged run to a new user), within 80 columns, and still reads back as a step."""
    from agentrl.cli.train import _step_line, printed_steps

    base = {"step": 2, "reward": 0.0, "mismatch_kl": float("nan"), "staleness": {0: 8}, "step_time_s": 3.5,
            "bound": "inference"}
    failed = _step_line({**base, "samples": 0.0, "rollout_errors": 8.0}, total=40, eta_s=120.0)
    unusable = _step_line({**base, "samples": 0.0, "rollout_errors": 0.0}, total=40, eta_s=None)
    ungraded = _step_line({**base, "samples": 0.0, "rollout_errors": 0.0, "grader_errors": 8.0}, total=40, eta_s=None)
    assert "not trained (8 got no grade)" in ungraded and len(ungraded) <= 80
    trained = _step_line({**base, "samples": 8.0, "mismatch_kl": 2e-4}, total=40, eta_s=None)
    assert "nan" not in failed + unusable, (failed, unusable)
    assert "not trained (8 rollouts failed)" in failed and "not trained (no usable rollout)" in unusable
    assert "kl 2.0e-04" in trained and "not trained" not in trained
    assert max(len(failed), len(unusable)) <= 80 and printed_steps("\n".join([failed, unusable])) == [2, 2]


def test_steps_whose_groups_all_got_one_reward_are_said_once():
    """Advantages of 0 in every group for 5 steps in a row: one note that nothing is learned (a newcomer trained a
    random model to reward 0.0 for a whole run with no word); a step with signal starts the count again."""
    from agentrl.cli.train import NO_SIGNAL_STEPS, _no_signal_line

    state = [0, False]
    flat = {"groups": 4.0, "groups_without_signal": 4.0, "samples": 32.0, "reward": 0.0}
    lines = [_no_signal_line(flat, state) for _ in range(NO_SIGNAL_STEPS - 1)]
    lines.append(_no_signal_line({**flat, "groups_without_signal": 3.0}, state))  # one group learned something
    lines += [_no_signal_line(flat, state) for _ in range(2 * NO_SIGNAL_STEPS)]
    said = [i for i, line in enumerate(lines) if line]
    assert said == [2 * NO_SIGNAL_STEPS - 1], said
    assert lines[said[0]] == ("  note: no learning signal for 5 steps (each group: one reward for all, now 0.00); "
                              "see agentrl sft for a warm start") and len(lines[said[0]]) <= 120


@pytest.mark.parametrize("rewards", [
    [0.86, 0.87] * 6 + [0.90, 0.86] * 6,  # a rise inside the noise: the verdict is said too
    [12.5, -3.25] * 10 + [-10.125, 14.5] * 10,  # rewards of several digits, signs mixed
])
def test_the_run_summary_stays_within_120_columns(rewards):
    """CI pipes the run's output: each summary line fits 120 columns whatever the run's rewards were
    (a run whose interval included 0 once printed 141)."""
    from agentrl.cli.train import _summary_lines

    history = [{"step": step, "reward": reward} for step, reward in enumerate(rewards)]
    history[-1].update({"eval/step": len(rewards) - 1, "eval/mean_reward": -10.125, "eval/mean_reward_low": -12.5,
                        "eval/mean_reward_high": 14.5})
    history[4].update({"eval/step": 4, "eval/mean_reward": 0.5, "eval/mean_reward_low": 0.25,
                       "eval/mean_reward_high": 0.75})
    lines = _summary_lines(history)
    assert len(lines) == 2 and lines[0].startswith("reward, "), lines
    assert all(len(line) <= 120 for line in lines), [len(line) for line in lines]
