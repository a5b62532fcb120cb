"""bench/gpu_check.py's verdicts on run folders made here (the H200's runs are judged the same way)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def _run(folder: Path, *, steps: int = 30, kl: float = 1.5e-4, push: float = 0.6, peaks=None, verified: bool = True,
         rewards=None, exit_code: int | None = 0, kl_all: float = 1.0e-3, stale: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(f"[orchestrator]\nmax_steps = {steps}\n")
    rewards = rewards or [0.80 + 0.002 * step for step in range(steps)]
    peaks = peaks or [90.0] * steps
    lines = []
    for step in range(steps):
        line = {"step": step, "reward": rewards[step], "mismatch_kl": kl_all, "weight_push_s": push,
                "train/mismatch_kl_on_policy": kl, "mem/trainer_peak_gib": peaks[step], "step_time_s": 3.0,
                "staleness": {"1": 8} if stale else {"0": 8}}
        if verified:
            line["weights/verified"] = 1.0
        lines.append(json.dumps(line))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "weight_updates.jsonl").write_text("\n".join(json.dumps(
        {"version": step + 1, "checks": {"http://x": {"max_error": 0.01}} if verified else {}})
        for step in range(steps)) + "\n")
    if exit_code is not None:
        (folder / "exit_code").write_text(f"{exit_code}\n")
    return folder


def _verdicts(run: Path) -> dict[str, bool]:
    baseline = gpu_check.summarise(gpu_check.BASELINE_RUN)
    sync = gpu_check.summarise(gpu_check.SYNC_BASELINE_RUN)
    reference = gpu_check.kl_reference([gpu_check.summarise(path) for path in gpu_check.PROFILES["h200"].kl_references])
    return {name: check["pass"] for name, check in gpu_check.checks(gpu_check.summarise(run), baseline, sync,
                                                                     reference=reference).items()}


def test_a_healthy_run_passes_every_check(tmp_path):
    assert all(_verdicts(_run(tmp_path / "ok")).values())


@pytest.mark.parametrize("kwargs, failed", [
    ({"exit_code": 1, "steps": 30}, "completed"),
    ({"rewards": [0.9 - 0.002 * step for step in range(30)]}, "reward_rising"),
    ({"kl": 5e-4}, "mismatch_kl"),  # the on-policy samples' KL
    ({"kl_all": 4.4e-3}, "mismatch_kl_all"),  # four times the H200 references' median (1.1e-3)
    ({"verified": False}, "weights_verified"),
    ({"push": 2.0}, "update_latency"),
    ({"peaks": [80.0 + step for step in range(30)]}, "trainer_peak_flat"),
])
def test_each_regression_fails_its_check_alone(tmp_path, kwargs, failed):
    verdicts = _verdicts(_run(tmp_path / "run", **kwargs))
    assert [name for name, passed in verdicts.items() if not passed] == [failed]


@pytest.mark.parametrize("line", ["===== 1 failed, 5 passed, 2 skipped in 250.12s =====",
                                  "1 failed, 11 deselected, 15 warnings in 76.03s (0:01:16)"])
def test_the_tests_summary_is_read_with_and_without_quiet(tmp_path, line):
    log = tmp_path / "tests.log"
    log.write_text(f"..F\nsome output\n{line}\n")
    summary = gpu_check.tests_summary(log)
    assert summary["counts"]["failed"] == 1 and summary["pass"] is False


def test_the_baselines_figures():
    sync = gpu_check.summarise(gpu_check.SYNC_BASELINE_RUN)
    run = gpu_check.summarise(gpu_check.BASELINE_RUN)
    assert sync["mismatch_kl_on_policy_median"] == pytest.approx(1.21e-4, rel=0.01)  # every group on-policy
    assert run["mismatch_kl_median"] == pytest.approx(2.31e-4, rel=0.01)
    assert run["stale_group_fraction"] == pytest.approx(171 / 240) and run["dropped_stale"] == 29
    # the 80g profile's: glm-air-32e's first full run, on an H100 at 0fce159
    small = gpu_check.summarise(gpu_check.PROFILES["80g"].baseline)
    assert small["steps"] == 30 and small["exit_code"] == 0 and small["verified_steps"] == 30
    assert small["mismatch_kl_on_policy_median"] == pytest.approx(7.84e-5, rel=0.01)
    assert small["weight_push_s_median"] == pytest.approx(0.311, rel=0.01)


def test_the_command_writes_the_json_and_exits_non_zero_on_a_failed_test(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("..F\n===== 1 failed, 5 passed, 2 skipped in 250.12s =====\n")
    results = tmp_path / "gpu_check.json"
    code = gpu_check.main([str(_run(tmp_path / "run-1")), "--tests-log", str(log), "--commit", "abc123",
                           "--results", str(results)])
    written = json.loads(results.read_text())
    assert code == 1 and written["commit"] == "abc123" and written["passed"] is False
    assert written["tests"]["counts"] == {"failed": 1, "passed": 5, "skipped": 2}
    assert [part["log"] for part in written["tests"]["logs"]] == [str(log)]
    assert all(check["pass"] for check in written["runs"][0]["checks"].values())


def test_the_tests_parts_are_judged_together_and_a_part_cut_off_fails(tmp_path):
    loop, rest = tmp_path / "tests-loop.log", tmp_path / "tests-rest.log"
    loop.write_text("......\n6 passed, 4 warnings in 402.10s (0:06:42)\n")
    rest.write_text("..s\n===== 2 passed, 1 skipped in 120.00s =====\n")
    verdict = gpu_check.tests_verdict([loop, rest])
    assert verdict["pass"] is True and verdict["counts"] == {"passed": 8, "warnings": 4, "skipped": 1}
    rest.write_text("..\n")  # killed at its limit: no summary line
    assert gpu_check.tests_verdict([loop, rest])["pass"] is False
    assert gpu_check.tests_verdict([])["pass"] is False


def test_the_80g_profile_is_judged_against_its_own_baseline_once_there_is_one(tmp_path, monkeypatch):
    run = _run(tmp_path / "run-1", kl=1.0e-3, push=2.0)  # far above the H200's baselines (1.2e-4, 0.57 s)
    results = tmp_path / "gpu_check.json"
    baseline = tmp_path / "baseline-80g"
    monkeypatch.setitem(gpu_check.PROFILES, "80g", gpu_check.Profile(baseline, baseline, [baseline]))
    # No baseline of the profile yet: the KL and latency checks are reported and not judged, the others are.
    assert gpu_check.main([str(run), "--profile", "80g", "--results", str(results)]) == 0
    written = json.loads(results.read_text())
    assert written["profile"] == "80g" and written["baseline"] is None and written["passed"] is True
    assert written["unjudged"] == ["mismatch_kl", "mismatch_kl_all", "update_latency"]
    assert written["runs"][0]["checks"]["mismatch_kl"] == {
        "value": 1.0e-3, "limit": None, "pass": None, "note": "no baseline for this profile yet"}
    assert written["runs"][0]["checks"]["completed"]["pass"] is True
    # With the profile's baseline committed, a run whose on-policy KL is over twice the baseline's fails.
    _run(baseline, kl=2.0e-4, push=1.5, kl_all=8.0e-4)
    assert gpu_check.main([str(run), "--profile", "80g", "--results", str(results)]) == 1
    written = json.loads(results.read_text())
    checks = written["runs"][0]["checks"]
    assert written["unjudged"] == [] and checks["mismatch_kl"]["pass"] is False
    assert checks["mismatch_kl"]["limit"] == pytest.approx(4.0e-4) and checks["update_latency"]["pass"] is True
    assert checks["mismatch_kl_all"]["pass"] is True and checks["mismatch_kl_all"]["limit"] == pytest.approx(1.6e-3)
    # The same run under the H200 profile is judged against the H200's baselines and fails there too.
    assert gpu_check.main([str(run), "--results", str(results)]) == 1
    assert json.loads(results.read_text())["profile"] == "h200"


@pytest.mark.parametrize(("total_mib", "override", "expected"), [
    ("143771", "", "h200  runs/gpu-1xh200/glm-air-5b-sft"),
    ("81559", "", "80g -80g runs/gpu-1xh200/glm-air-32e-sft"),
    ("81559", "h200", "h200  runs/gpu-1xh200/glm-air-5b-sft"),
])
def test_the_scripts_pick_the_recipe_that_fits_the_card(tmp_path, total_mib, override, expected):
    """scripts/gpu_profile.sh, sourced by gpu_check.sh and gpu_run.sh, run for real with nvidia-smi answering as
    an H200 or an H100 would; every recipe file it names exists."""
    import subprocess

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho {total_mib}\n")
    (fake / "nvidia-smi").chmod(0o755)
    log = tmp_path / "gpu.txt"
    env = {"PATH": f"{fake}:/usr/bin:/bin", "GPU_CHECK_PROFILE": override}
    script = f'profile_log={log} source scripts/gpu_profile.sh && echo "$profile $suffix $warm"'
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == expected
    assert log.read_text().startswith(f"profile: {expected.split()[0]} ")
    suffix = "-80g" if "-80g" in expected else ""
    for name in ("sft", "train", "agent-sft", "agent-train"):
        assert (ROOT / "cookbook" / "gpu-1xh200" / f"{name}{suffix}.toml").is_file()
    wrong = subprocess.run(["bash", "-c", "source scripts/gpu_profile.sh || echo refused $?"], cwd=ROOT,
                           env={**env, "GPU_CHECK_PROFILE": "h300"}, capture_output=True, text=True)
    assert "refused 2" in wrong.stdout and "must be h200 or 80g, not 'h300'" in wrong.stderr


def test_the_all_sample_kl_is_judged_only_against_references_as_stale_as_the_run(tmp_path):
    """Every group after step 0 one step stale: the seven healthy H200 check runs' all-sample KL, median 1.1e-3. A
    synchronous run's KL (no stale sample) says nothing against them: not judged, with the reason."""
    reference = gpu_check.kl_reference([gpu_check.summarise(path) for path in gpu_check.PROFILES["h200"].kl_references])
    assert len(reference["runs"]) == 7
    assert reference["mismatch_kl_median"] == pytest.approx(1.10e-3, rel=0.01)
    assert reference["stale_group_fraction"] == pytest.approx(0.967, abs=0.001)
    # the async baseline of 2026-12-01 (71% stale) cannot be a reference: its KL (2.3e-4) is of other samples
    first = gpu_check.summarise(gpu_check.BASELINE_RUN)
    assert abs(first["stale_group_fraction"] - reference["stale_group_fraction"]) > gpu_check.STALE_TOLERANCE
    sync = _run(tmp_path / "sync", stale=False, kl_all=5e-3)
    verdict = gpu_check.checks(gpu_check.summarise(sync), None, None, reference=reference)["mismatch_kl_all"]
    assert verdict["pass"] is None and verdict["note"].startswith("stale share 0.0 is not the references' 0.967")
