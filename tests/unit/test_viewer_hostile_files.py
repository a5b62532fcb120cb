"""The viewer answers whatever its folders hold: a NaN reward, a lone surrogate, bytes that are not UTF-8, a huge string.

On main, one NaN reward or one `\\ud800` escape in a results file gave HTTP 500 for that folder's
rollouts, and a folder whose name or files were not UTF-8 blanked the whole page (`/api/folders` 500).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("starlette", reason="the view extra (starlette, uvicorn) is not installed")

from starlette.testclient import TestClient  # noqa: E402

from agentrl.viewer.app import create_app  # noqa: E402

RECORD = {"task_index": 0, "rollout_index": 0, "task": {"prompt": [{"role": "user", "content": "hi"}]},
          "messages": [{"role": "assistant", "content": "x"}], "turns": [], "metrics": {}}


@pytest.fixture
def client(tmp_path):
    nan = tmp_path / "eval-nan"
    nan.mkdir()
    lines = [json.dumps({**RECORD, "reward": float("nan"), "metrics": {"m": float("inf")}}),  # NaN, Infinity
             json.dumps({**RECORD, "reward": 1.0, "messages": [{"role": "assistant", "content": "\ud800 lone"}]})]
    (nan / "results.jsonl").write_text("\n".join(lines) + "\n")
    (nan / "summary.json").write_text('{"env": "e", "model": "m", "mean_reward": NaN}')
    bad = tmp_path / os.fsdecode(b"eval-\xff\xfe-not-utf8")
    bad.mkdir()
    (bad / "results.jsonl").write_bytes(json.dumps(RECORD).encode() + b"\n" + b'{"reward": "\xff\xfe"}\n')
    (bad / "summary.json").write_bytes(b'{"env": "\xff"}')
    run = tmp_path / "run-bad-config"
    run.mkdir()
    (run / "config.toml").write_bytes(b'[env]\nname = "\xff"\n')
    (run / "metrics.jsonl").write_bytes(b'{"step": 0, "reward": 0.5}\n{"step": 1, "note": "\xff"}\n')
    with TestClient(create_app([tmp_path]), base_url="http://127.0.0.1") as test_client:
        yield test_client


def test_folders_list_survives_names_and_files_that_are_not_utf8(client):
    answer = client.get("/api/folders")
    assert answer.status_code == 200, answer.text
    names = {folder["name"] for folder in answer.json()["folders"]}
    assert names == {"eval-\udcff\udcfe-not-utf8", "eval-nan", "run-bad-config"}
    for folder in answer.json()["folders"]:
        assert client.get(f"/api/folders/{folder['id']}").status_code == 200


def test_nan_and_lone_surrogates_come_back_as_json(client):
    ids = {folder["name"]: folder["id"] for folder in client.get("/api/folders").json()["folders"]}
    listed = client.get(f"/api/folders/{ids['eval-nan']}/rollouts")
    assert listed.status_code == 200, listed.text
    assert [row["reward"] for row in listed.json()["rows"]] == [None, 1.0]
    first = client.get(f"/api/folders/{ids['eval-nan']}/rollouts/0")
    assert first.status_code == 200 and first.json()["record"]["metrics"] == {"m": None}
    second = client.get(f"/api/folders/{ids['eval-nan']}/rollouts/1")
    assert second.status_code == 200 and second.json()["record"]["messages"][0]["content"] == "\ud800 lone"
    run = client.get(f"/api/folders/{ids['run-bad-config']}/metrics")
    assert run.status_code == 200 and run.json()["rows"][0] == {"step": 0, "reward": 0.5}


def test_a_huge_tool_output_is_cut_for_the_page(tmp_path):
    """A 300 MB tool output in one eval record crashed the browser tab that opened the rollout (50 MB took 13 s
    to show): the rollout's strings come back cut at `MAX_TEXT_CHARS` with a marker; the file keeps them whole."""
    from agentrl.viewer.app import MAX_TEXT_CHARS

    folder = tmp_path / "eval-huge"
    folder.mkdir()
    output = "x" * (5 * MAX_TEXT_CHARS)
    record = {**RECORD, "messages": [{"role": "tool", "content": output, "tool_call_id": "c"}],
              "state": {"log": [output]}}
    (folder / "results.jsonl").write_text(json.dumps(record) + "\n")
    client = TestClient(create_app([folder]), base_url="http://127.0.0.1")
    answer = client.get("/api/folders/0/rollouts/0")
    assert answer.status_code == 200 and len(answer.content) < 3 * MAX_TEXT_CHARS
    shown = answer.json()["record"]
    for text in (shown["messages"][0]["content"], shown["state"]["log"][0]):
        assert text.startswith(output[:MAX_TEXT_CHARS]) and len(text) < MAX_TEXT_CHARS + 200
        assert f"{4 * MAX_TEXT_CHARS:,} more characters" in text and "results.jsonl" in text
    assert client.get("/api/folders/0/rollouts").json()["rows"][0]["n"] == 0
