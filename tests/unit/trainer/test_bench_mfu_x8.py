"""`bench/trainer_mfu_x8.py` on the CPU: the planned 8-GPU layouts, layer choice, dry run, errors, summary.

The GPU part cannot run here; everything it decides before touching a GPU is checked:
the deep model's layer count is the largest whose planner estimate fits every 8-GPU
configuration, the layouts are EP=8 with CP 1/4/2, the estimates are the trainer's own
planner figures, the default run's estimated time fits one device call, bad options are
one-line errors, and the scaling efficiencies are computed as documented.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

import trainer_mfu_x8 as x8
from trainer_mfu import LOGPROB_CHUNK_TOKENS, air_args

from agentrl.trainer.parallel import GIB, plan_layout


def _estimate_gib(layers: int, *, world: int, seq: int, cp: int) -> float:
    plan = plan_layout(air_args(layers), world=world, row_tokens=seq, ep="auto", cp=cp,
                       gpu_memory_bytes=1e18, logprob_chunk_tokens=LOGPROB_CHUNK_TOKENS)
    return plan.estimated_bytes / GIB


def test_default_plan_is_ep8_with_the_most_layers_that_fit():
    runs = x8.plan_runs()
    assert sorted(runs) == [1, 2, 8]
    deep = [c for c in runs[8] if c.role.startswith("deep")]
    assert [(c.seq, c.cp, c.gpus // c.cp) for c in deep] == [(32768, 1, 8), (131072, 4, 2), (131072, 2, 4)]
    assert all(c.ep == 8 for c in runs[8])
    layers = deep[0].layers
    assert all(c.layers == layers for c in deep) and layers > x8.BASELINE_LAYERS
    budget = 139.0 * 0.93
    shapes = [(32768, 1), (131072, 4), (131072, 2)]
    assert max(_estimate_gib(layers, world=8, seq=s, cp=cp) for s, cp in shapes) <= budget
    assert max(_estimate_gib(layers + 1, world=8, seq=s, cp=cp) for s, cp in shapes) > budget
    for config in deep:  # the bench reports the trainer planner's own figure
        assert config.estimate_gib == pytest.approx(_estimate_gib(layers, world=8, seq=config.seq, cp=config.cp))
    # baselines: the 2-layer model on 1 and 2 GPUs (EP=2) and on 8 GPUs, 32k tokens per GPU
    assert [(c.gpus, c.layers, c.seq, c.ep) for c in (runs[1][0], runs[2][0], runs[8][0])] == \
        [(1, 2, 32768, 1), (2, 2, 32768, 2), (8, 2, 32768, 8)]


def test_baseline_estimates_match_the_measured_runs_planner():
    measured = json.loads((ROOT / "bench" / "results" / "trainer_mfu.json").read_text())["estimate_memory_gib"]
    runs = x8.plan_runs()
    assert runs[1][0].estimate_gib == pytest.approx(measured["1gpu_32768"], rel=1e-6)
    assert runs[2][0].estimate_gib == pytest.approx(measured["2gpu_32768"], rel=1e-6)


def test_default_run_fits_one_device_call():
    runs = x8.plan_runs()
    limit = x8.parse_args([]).time_limit_s
    assert x8.estimated_wall_s(runs) <= limit
    # the bench ends by limit + kill grace, inside the script's `timeout 575` (installs take the rest of 600 s)
    script = (ROOT / "scripts" / "trainer_gpu_run.sh").read_text()
    assert 'timeout "${BENCH_TIMEOUT:-575}" python3 bench/trainer_mfu_x8.py' in script
    assert limit + x8.KILL_GRACE_S + 10 <= 575


def test_layer_count_follows_the_memory_budget():
    small = x8.plan_runs(gpu_memory_gib=120.0)
    big = x8.plan_runs()
    assert small[8][-1].layers < big[8][-1].layers
    four = x8.plan_runs(world=4, long_cps=(2,))
    assert [(c.ep, c.cp) for c in four[4]] == [(4, 1), (4, 1), (4, 2)]


def test_dry_run_prints_the_plan_and_writes_nothing():
    before = x8.RESULTS.stat().st_mtime if x8.RESULTS.exists() else None
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "trainer_mfu_x8.py"), "--dry-run"], check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    layers = x8.plan_runs()[8][-1].layers
    assert "trainer scaling run plan" in proc.stdout and "deep long" in proc.stdout
    table = [[cell.strip() for cell in line.split("│")[1:-1]] for line in proc.stdout.splitlines() if "│" in line]
    long_rows = [cells[:7] for cells in table if cells[1] == "deep long"]
    assert long_rows == [["8", "deep long", str(layers), "131072", "8", "4", "2"],
                         ["8", "deep long", str(layers), "131072", "8", "2", "4"]]
    assert "estimated wall time" in proc.stdout
    assert (x8.RESULTS.stat().st_mtime if x8.RESULTS.exists() else None) == before


@pytest.mark.parametrize(("argv", "message"), [
    (["--layers", "40"], "8gpu_32768_L40 (deep, --layers 40) needs ~"),
    (["--gpu-memory-gib", "100"], "1gpu_32768_L2 (baseline, --layers"),
    (["--layers", "0"], "--layers 0: need at least one MoE layer"),
    (["--world", "6"], "--world 6: need a GPU count of at least 4 that divides 128"),
    (["--long-cp", "3"], "--long-cp 3: must be at least 2 and divide --world (8)"),
    (["--memory-fraction", "1.5"], "--memory-fraction 1.5: must be between 0.1 and 1.0"),
    (["--steps", "0"], "need at least 1 timed step"),
    (["--gpu-memory-gib", "10"], "--layers auto: not even one layer fits"),
])
def test_bad_options_are_one_line_errors(argv, message, capsys):
    assert x8.main(argv + ["--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_layers_must_be_a_number_or_auto(capsys):
    with pytest.raises(SystemExit) as exc:
        x8.parse_args(["--layers", "many"])
    assert exc.value.code == 2
    assert "--layers 'many': give a number of MoE layers or 'auto'" in capsys.readouterr().err


def test_without_gpus_the_real_run_refuses_in_one_line(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the GPUs")
    assert x8.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert "CUDA GPUs; this run needs 8 (--world), or use --dry-run" in err and "\n" not in err


def test_summary_scaling_efficiency_by_hand():
    def row(gpus, layers, tokens_per_s, mfu, role, seq=32768, cp=1):
        return {"key": f"{gpus}_{layers}_{seq}_{cp}", "role": role, "gpus": gpus, "layers": layers, "seq": seq,
                "cp": cp, "ep": gpus,
                "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_memory_gib": 1.0, "estimate_gib": 1.0,
                "matmul_tflops": 700.0}
    rows = [row(1, 2, 1000.0, 0.40, "baseline"), row(2, 2, 1900.0, 0.38, "baseline"),
            row(8, 2, 7200.0, 0.30, "weak scaling"), row(8, 15, 900.0, 0.34, "deep"),
            row(8, 15, 300.0, 0.30, "deep long", seq=131072, cp=2),
            {"key": "8_15_131072_4", "role": "deep long", "gpus": 8, "layers": 15, "seq": 131072, "cp": 4, "ep": 8,
             "error": "skipped"}]
    summary = x8.summarize(rows, layers=15, world=8, command="x")
    eff = summary["scaling_efficiency"]
    assert eff["weak_vs_1gpu"] == pytest.approx((7200 / 8) / 1000)
    assert eff["weak_vs_2gpu"] == pytest.approx((7200 / 8) / (1900 / 2))
    assert eff["deep_mfu_vs_1gpu"] == pytest.approx(0.34 / 0.40)
    assert eff["deep_mfu_vs_2gpu"] == pytest.approx(0.34 / 0.38)
    assert "8_15_131072_4" not in summary["tokens_per_s"] and len(summary["runs"]) == 6
    empty = x8.summarize([], layers=15, world=8, command="x")["scaling_efficiency"]
    assert set(empty.values()) == {None}


@pytest.mark.slow  # six torchrun launches: a minute and more
def test_cpu_smoke_runs_every_launch_and_summarizes(tmp_path):
    """The real launches (1 process, torchrun 2 and 4 gloo ranks), workers and summary, on a tiny model."""
    results = tmp_path / "smoke.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "trainer_mfu_x8.py"), "--cpu-smoke", "--world", "4",
                           "--results", str(results)], check=False, capture_output=True, text=True, timeout=400,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(results.read_text())
    rows = summary["runs"]
    assert [r.get("error") for r in rows] == [None] * 6, rows
    assert [(r["gpus"], r["role"], r["seq"], r["cp"]) for r in rows] == [
        (1, "baseline", 64, 1), (2, "baseline", 64, 1), (4, "weak scaling", 64, 1), (4, "deep", 64, 1),
        (4, "deep long", 256, 4), (4, "deep long", 256, 2)]
    for r in rows:  # each row trained with the layout it names
        assert f"world={r['gpus']} dp={r['gpus'] // r['cp']} cp={r['cp']} ep={r['gpus']} " in r["plan"]
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["loss"] == r["loss"]
    one, two, weak, deep = rows[:4]
    eff = summary["scaling_efficiency"]
    assert eff["weak_vs_1gpu"] == pytest.approx(weak["tokens_per_s"] / 4 / one["tokens_per_s"])
    assert eff["weak_vs_2gpu"] == pytest.approx((weak["tokens_per_s"] / 4) / (two["tokens_per_s"] / 2))
    assert eff["deep_mfu_vs_1gpu"] == pytest.approx(deep["mfu"] / one["mfu"])
    assert summary["layers"] == x8.SMOKE_LAYERS and summary["device"] == "cpu (--cpu-smoke)"
    assert not list(tmp_path.glob(".smoke_*"))  # per-launch files cleaned up
    assert "scaling efficiency weak_vs_1gpu:" in proc.stdout
