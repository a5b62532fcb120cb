"""The viewer's JSON API (starlette's TestClient against the real app) over run and eval folders."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette", reason="the view extra (starlette, uvicorn) is not installed")

from starlette.testclient import TestClient  # noqa: E402

from agentrl.errors import NotFoundError  # noqa: E402
from agentrl.viewer.app import create_app  # noqa: E402
from tests.viewer_folders import DIFF, HOSTILE, arithmetic_eval, arithmetic_run, trained_run  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("viewer")
    arithmetic_run(root / "run")
    arithmetic_eval(root / "eval-base", right_every=3)
    arithmetic_eval(root / "eval-tuned", right_every=1)
    (root / "not-a-run").mkdir()
    return root


@pytest.fixture(scope="module")
def client(folders):
    return TestClient(create_app([folders]), base_url="http://127.0.0.1")


def _ids(client) -> dict[str, str]:
    return {f["name"]: f["id"] for f in client.get("/api/folders").json()["folders"]}


def test_folders_are_found_under_a_parent(client):
    listed = {f["name"]: f for f in client.get("/api/folders").json()["folders"]}
    assert set(listed) == {"run", "eval-base", "eval-tuned"}
    assert listed["run"]["kind"] == "run" and listed["run"]["steps"] == 3 and listed["run"]["rollouts"] == 18
    assert listed["run"]["env"] == "arithmetic" and listed["run"]["max_steps"] == 3
    assert listed["eval-base"]["kind"] == "eval" and listed["eval-base"]["rollouts"] == 8
    assert listed["eval-tuned"]["reward"] == 1.0 and listed["eval-tuned"]["finished"]


def test_metrics_page_from_a_row_on(client):
    run = _ids(client)["run"]
    body = client.get(f"/api/folders/{run}/metrics").json()
    assert [row["step"] for row in body["rows"]] == [0, 1, 2] and body["next"] == 3
    assert {"reward", "reward_std", "mismatch_kl", "staleness", "tokens_per_s", "wait_s", "train_s",
            "dropped_stale"} <= set(body["rows"][0])
    later = client.get(f"/api/folders/{run}/metrics?since=2").json()
    assert [row["step"] for row in later["rows"]] == [2] and later["next"] == 3


def test_rollouts_filter_by_step_task_and_reward(client):
    run = _ids(client)["run"]
    everything = client.get(f"/api/folders/{run}/rollouts").json()
    assert everything["total"] == 18 and everything["steps"] == [0, 1, 2]
    rows = everything["rows"]
    assert {0.0, 1.0} <= {row["reward"] for row in rows}
    step1 = client.get(f"/api/folders/{run}/rollouts?step=1").json()["rows"]
    assert len(step1) == 6 and {row["step"] for row in step1} == {1}
    good = client.get(f"/api/folders/{run}/rollouts?min_reward=0.5").json()["rows"]
    assert good and all(row["reward"] >= 0.5 for row in good)
    bad = client.get(f"/api/folders/{run}/rollouts?max_reward=0.5").json()["rows"]
    assert len(good) + len(bad) == 18
    example = str(rows[0]["example_id"])
    by_task = client.get(f"/api/folders/{run}/rollouts", params={"task": example}).json()["rows"]
    assert by_task and all(example in str(row["example_id"]) or example in row["prompt"] for row in by_task)
    page = client.get(f"/api/folders/{run}/rollouts?offset=5&limit=4").json()
    assert [row["n"] for row in page["rows"]] == [5, 6, 7, 8] and page["matched"] == 18


def test_a_rollout_in_full_with_tool_calls_diff_and_tokens(client):
    run = _ids(client)["run"]
    body = client.get(f"/api/folders/{run}/rollouts/0").json()
    record = body["record"]
    assert record["state"]["diff"] == DIFF
    call = next(m for m in record["messages"] if m.get("tool_calls"))["tool_calls"][0]
    assert call["function"]["name"] == "calculator"
    assert any(HOSTILE in m["content"] for m in record["messages"] if m["role"] == "tool")
    assert set(record["metrics"]) >= {"correct_answer", "tool_calls"}
    tokens = body["tokens"]
    completion = [t for turn in record["turns"] for t in turn["completion"]["token_ids"]]
    assert [t["id"] for t in tokens if t["loss"]] == completion  # the trained tokens are the completions'
    assert all(t["logprob"] == 0.0 for t in tokens if t["loss"])  # the scripted policy is certain
    assert all(t["logprob"] is None for t in tokens if not t["loss"])
    assert body["decoded"] is False or all(t["text"] is not None for t in tokens)


def test_per_token_trainer_logprobs_and_mismatch_of_a_trained_run(tmp_path):
    pytest.importorskip("torch", reason="the train extra (torch) is not installed")
    path, _ = trained_run(tmp_path / "trained", steps=1, samples_per_step=2)
    client = TestClient(create_app([path]), base_url="http://127.0.0.1")
    run = client.get("/api/folders").json()["folders"][0]["id"]
    body = client.get(f"/api/folders/{run}/rollouts/0").json()
    recorded = body["record"]["trainer_logprobs"]
    trained = [t for t in body["tokens"] if t["loss"]]
    assert trained and all(t["trainer_logprob"] == recorded[i] for i, t in enumerate(body["tokens"]) if t["loss"])
    assert all(t["mismatch"] == pytest.approx(t["logprob"] - t["trainer_logprob"]) for t in trained)
    assert all(t["trainer_logprob"] is None and t["mismatch"] is None for t in body["tokens"] if not t["loss"])


def test_compare_two_evaluations_task_by_task(client):
    ids = _ids(client)
    body = client.get(f"/api/compare?a={ids['eval-base']}&b={ids['eval-tuned']}").json()
    assert len(body["tasks"]) == 4 and body["only_a"] == 0 and body["only_b"] == 0
    for task in body["tasks"]:
        assert len(task["a"]) == 2 and len(task["b"]) == 2 and task["b_reward"] == 1.0
        assert {row["task_key"] for row in task["a"] + task["b"]} == {task["task_key"]}
    assert sum(task["a_reward"] for task in body["tasks"]) < 4


def test_new_rollouts_and_runs_appear_while_running(folders, client):
    run = _ids(client)["run"]
    path = folders / "run" / "rollouts.jsonl"
    before = client.get(f"/api/folders/{run}/rollouts").json()["total"]
    first = path.read_text().splitlines()[0]
    with open(path, "a") as handle:  # a complete line, then a torn one (a run killed mid-write)
        handle.write(first + "\n" + first[: len(first) // 2])
    assert client.get(f"/api/folders/{run}/rollouts").json()["total"] == before + 1
    with open(path, "a") as handle:
        handle.write(first[len(first) // 2:] + "\n")
    assert client.get(f"/api/folders/{run}/rollouts").json()["total"] == before + 2
    later = folders / "eval-later"
    later.mkdir()
    (later / "results.jsonl").write_text(json.dumps(json.loads(first)) + "\n")
    assert "eval-later" in _ids(client)


def test_bad_requests_are_one_line_errors(client):
    run = _ids(client)["run"]
    answer = client.get(f"/api/folders/{run}/rollouts?min_reward=high")
    assert answer.status_code == 400
    assert answer.json()["error"] == "parameter min_reward='high' is not a number"
    answer = client.get(f"/api/folders/{run}/rollouts?limit=0")
    assert answer.status_code == 400 and "limit" in answer.json()["error"]
    answer = client.get(f"/api/folders/{run}/rollouts/999")
    assert answer.status_code == 404 and "no rollout 999" in answer.json()["error"]
    answer = client.get("/api/folders/77/metrics")
    assert answer.status_code == 404 and "no folder with id '77'" in answer.json()["error"]
    answer = client.get("/api/compare?a=0")
    assert answer.status_code == 400 and "parameters a and b" in answer.json()["error"]


def test_page_and_assets_are_served_with_a_strict_policy(client):
    page = client.get("/")
    assert page.status_code == 200 and "/static/viewer.js" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for asset in ("viewer.js", "charts.js", "viewer.css"):
        assert client.get(f"/static/{asset}").status_code == 200
    assert client.get("/static/../app.py").status_code == 404
    # a page on another origin that rebinds its DNS name to 127.0.0.1 is refused
    assert client.get("/api/folders", headers={"host": "attacker.example"}).status_code == 400


def test_folders_that_are_not_runs_are_refused_in_one_line(tmp_path):
    with pytest.raises(NotFoundError, match="no such folder"):
        create_app([tmp_path / "missing"])
    with pytest.raises(NotFoundError, match="no run or eval folder there"):
        create_app([tmp_path])


def test_agentrl_view_serves_on_loopback_and_refuses_bad_folders(folders, tmp_path):
    import subprocess
    import sys

    import httpx

    missing = subprocess.run([sys.executable, "-m", "agentrl.cli", "view", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such folder" in missing.stderr
    process = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "view", "--port", "0",
                                str(folders / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("agentrl view: http://127.0.0.1:"), line
        url = line.split()[2]
        listed = httpx.get(url + "api/folders", timeout=10).json()["folders"]
        assert [f["name"] for f in listed] == ["run"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_url_handed_out_takes_connections_before_the_server_runs(folders):
    """`agentrl view` prints its URL before uvicorn starts: the socket already listens, so a client
    that connects at once is queued, not refused (it was: the viewer test failed on a busy machine)."""
    import socket

    from agentrl.viewer.serve import serve

    class Handed(Exception):
        pass

    def ready(url: str) -> None:
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        with socket.create_connection((host, int(port)), timeout=5):
            raise Handed(url)

    with pytest.raises(Handed, match="http://127.0.0.1:"):
        serve([folders / "run"], port=0, on_ready=ready)
