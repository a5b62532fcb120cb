"""bench/inference_features.py's pieces that run without a GPU: the multi-turn
workload (fixed by a seed, each session its own context), and the KV bytes per token the KV-bound cache is sized by."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("inference_features")


def test_the_multi_turn_workload_is_fixed_and_each_session_has_its_own_context(bench):
    first = bench.multi_turn_sessions(sessions=4, context=100, turns=3, vocab=128)
    assert first == bench.multi_turn_sessions(sessions=4, context=100, turns=3, vocab=128)
    assert len({tuple(item["context"]) for item in first}) == 4
    assert all(len(item["context"]) == 100 and [len(o) for o in item["outputs"]] == [32, 32, 32] for item in first)
    assert all(3 <= token < 128 for item in first for token in item["context"])


def test_kv_bytes_per_token_of_a_checkpoint(bench, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_attention_heads": 96,
                                                      "num_key_value_heads": 8, "head_dim": 128,
                                                      "num_hidden_layers": 3}))
    assert bench.kv_bytes_per_token(tmp_path) == 2 * 8 * 128 * 2 * 3  # K and V, bf16, every layer
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4,
                                                      "num_hidden_layers": 2}))
    assert bench.kv_bytes_per_token(tmp_path) == 2 * 4 * 16 * 2 * 2


def test_the_multi_turn_length_fits_the_model_or_stops_in_one_line_before_any_server(bench, tmp_path):
    """The longest prompt and answer of the workload set the server's max_model_len; one past the model's rotary
    positions killed a CUDA engine with a device-side assert (6,000-token prompts on a 4,096-position model)."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    work = bench.multi_turn_sessions(sessions=1, context=3800, turns=4, vocab=64)[0]
    prompt = len(work["context"]) + sum(16 + len(output) for output in work["outputs"][:-1])
    assert bench.multi_turn_length(tmp_path, context=3800, turns=4, turn_tokens=16) == prompt + 16 == 3960
    # a short workload still fits the agreement measures' requests, sent to the same server afterwards
    assert bench.multi_turn_length(tmp_path, context=200, turns=2, turn_tokens=4) == 300 + 16
    with pytest.raises(SystemExit) as stopped:
        bench.multi_turn_length(tmp_path, context=6000, turns=4, turn_tokens=16)
    assert "6160 positions" in str(stopped.value) and "4096" in str(stopped.value)
    assert "\n" not in str(stopped.value)


def test_the_iteration_summary_counts_only_the_steps_after_the_warm_up(bench):
    """vLLM 0.24's `--enable-logging-iteration-details` line (`EngineCore.log_iteration_details`), as the server's
    log holds it; the steps logged before the workload (start-up, warm-up) are left out."""
    def line(index: int, context_requests: int, context_tokens: int, generation: int, ms: float) -> str:
        return (f"(EngineCore pid=7) INFO 12-07 00:40:01 [core.py:451] Iteration({index}): {context_requests} context "
                f"requests, {context_tokens} context tokens, {generation} generation requests, {generation} generation "
                f"tokens, iteration elapsed time: {ms:.2f} ms")

    log = "\n".join([line(0, 1, 300, 0, 90.0), "(APIServer pid=5) INFO other", line(1, 2, 4096, 3, 12.5),
                     line(2, 0, 0, 8, 1.25), line(3, 1, 48, 7, 2.0)])
    assert bench.iteration_summary(log, since=1) == {"iterations": 3, "iteration_ms_sum": 15.8,
                                                     "prefill_iterations": 2, "context_tokens": 4144}
    assert bench.iteration_summary(log, since=4)["iterations"] == 0


def test_a_copy_with_more_positions_links_every_other_file(bench, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "hidden_size": 8}))
    (model / "model.safetensors").write_bytes(b"weights")
    copy = bench.with_positions(model, 20000, work=tmp_path / "work")
    assert json.loads((copy / "config.json").read_text()) == {"max_position_embeddings": 20000, "hidden_size": 8}
    assert (copy / "model.safetensors").is_symlink() and (copy / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 4096  # the original kept
    assert bench.multi_turn_length(copy, context=16000, turns=4, turn_tokens=16) == 16160
    assert bench.with_positions(model, 20000, work=tmp_path / "work") == copy  # again: the same copy
