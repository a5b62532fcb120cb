"""bwrap sandboxes get host uids no other sandbox folder holds (`bwrap_workspace.claim_host_uid`)."""

from __future__ import annotations

import json
import os

import pytest

from agentrl.sandbox import bwrap_workspace
from agentrl.sandbox.bwrap_workspace import LABELS_FILE, claim_host_uid, workspace_root


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_SANDBOX_CACHE", str(tmp_path))
    workspace_root().mkdir(parents=True)
    return workspace_root()


def test_a_drawn_uid_another_sandbox_holds_is_drawn_again(root, monkeypatch):
    first, second = root / "a", root / "b"
    first.mkdir(), second.mkdir()
    draws = iter([b"\x00\x00\x00\x07", b"\x00\x00\x00\x07", b"\x00\x00\x00\x09"])  # b's first draw is a's uid
    monkeypatch.setattr(bwrap_workspace.os, "urandom", lambda n: next(draws))
    uid_a = claim_host_uid(first, {"owner": "a"}, base=200_000, span=100)
    uid_b = claim_host_uid(second, {"owner": "b"}, base=200_000, span=100)
    assert (uid_a, uid_b) == (200_007, 200_009)
    assert json.loads((second / LABELS_FILE).read_text()) == {"owner": "b", "host_uid": "200009"}


def test_no_free_uid_is_one_line(root, monkeypatch):
    for name in ("a", "b"):
        (root / name).mkdir()
    claim_host_uid(root / "a", {}, base=300_000, span=1)
    with pytest.raises(Exception, match=r"no free host uid for a bwrap sandbox: 1 of 1 are held"):
        claim_host_uid(root / "b", {}, base=300_000, span=1)
    assert os.listdir(root / "b") == []
