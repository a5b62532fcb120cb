"""bench/inference_features.py's pieces that run without a GPU: the multi-turn
workload (fixed by a seed, each session its own context), and the KV bytes per token the KV-bound cache is sized by."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import httpx
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


def test_a_dropped_connection_stops_the_bench_in_one_line_and_keeps_the_rows_measured(bench, tmp_path, monkeypatch):
    """On the H100 (2026-12-07) the pd-nixl variant died with a 60-line httpx.ReadError traceback after bf16 had been
    measured; the bench now names the variant and the servers' logs in one line, and bf16's row stays written."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128}))
    measured = {"logprobs": [[-1.0]], "routing": []}

    request = httpx.Request("POST", "http://127.0.0.1:1/inference/v1/generate")

    def bench_variant(name, model, *, args, vocab, work):
        if name == "pd-nixl":
            raise httpx.ReadError("", request=request)
        if name == "fp8":  # raise_for_status's message is two lines
            httpx.Response(500, request=request).raise_for_status()
        return {"variant": name, "workload": "throughput", "tokens_per_s": 10.0, "first_token_s": 0.1}, measured

    monkeypatch.setattr(bench, "bench_variant", bench_variant)
    monkeypatch.setattr(bench, "routing_agreement_of", lambda ours, theirs: 1.0)
    results = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["inference_features.py", "--model", str(tmp_path), "--variants", "bf16,pd-nixl",
                                      "--results", str(results), "--work", str(tmp_path / "work")])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    message = str(stopped.value)
    assert message.startswith("inference_features: pd-nixl: ReadError from http://127.0.0.1:1/inference/v1/generate")
    assert f"{tmp_path / 'work'}/pd-nixl*.log" in message and "\n" not in message
    assert [row["variant"] for row in json.loads(results.read_text())["rows"]] == ["bf16"]
    monkeypatch.setattr(sys, "argv", ["inference_features.py", "--model", str(tmp_path), "--variants", "bf16,fp8",
                                      "--results", str(results), "--work", str(tmp_path / "work")])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    assert "fp8: HTTPStatusError from http://127.0.0.1:1/inference/v1/generate: Server error '500 Internal Server" \
           in str(stopped.value) and "\n" not in str(stopped.value)


def test_without_a_model_the_bench_takes_the_warm_start_the_card_left_or_says_how_to_make_one(bench, tmp_path,
                                                                                             monkeypatch):
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    with pytest.raises(SystemExit) as stopped:
        bench.default_model()
    assert "scripts/gpu_run.sh sft" in str(stopped.value) and "glm-air-32e-sft" in str(stopped.value)
    h100 = tmp_path / "runs" / "gpu-1xh200" / "glm-air-32e-sft"
    h100.mkdir(parents=True)
    (h100 / "config.json").write_text("{}")
    assert bench.default_model() == str(h100)
    h200 = h100.with_name("glm-air-5b-sft")
    h200.mkdir()
    (h200 / "config.json").write_text("{}")
    assert bench.default_model() == str(h200)


def test_the_block_fp8_row_serves_a_padded_copy_and_refuses_what_padding_cannot_fix(bench, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    model.mkdir()
    config = {"hidden_size": 256, "intermediate_size": 200, "num_hidden_layers": 1, "num_attention_heads": 2,
              "head_dim": 128}
    (model / "config.json").write_text(json.dumps(config))
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.ones(200, 256),
               "model.layers.0.mlp.up_proj.weight": torch.ones(200, 256),
               "model.layers.0.mlp.down_proj.weight": torch.ones(256, 200),
               "model.embed_tokens.weight": torch.ones(8, 256)}, str(model / "model.safetensors"))
    served = bench.block_fp8_servable(model, work=tmp_path / "work")
    assert served != model and json.loads((served / "config.json").read_text())["intermediate_size"] == 256
    tensors = load_file(str(served / "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (256, 256)
    assert tensors["model.layers.0.mlp.gate_proj.weight"][200:].abs().sum() == 0
    assert "padded to a multiple of 128" in capsys.readouterr().out
    assert bench.block_fp8_servable(served, work=tmp_path / "work") == served  # already servable
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": 200}))
    with pytest.raises(SystemExit) as refused:
        bench.block_fp8_servable(model, work=tmp_path / "other")
    assert str(refused.value).startswith("inference_features: fp8-block: model's hidden_size = 200")
