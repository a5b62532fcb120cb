"""Package format: manifest errors name the field, content hash, staging, verification of published files."""

from __future__ import annotations

import json

import pytest

from agentrl.errors import AgentrlError, ConfigError
from agentrl.hub.package import (
    LOCK_NAME,
    HashMismatchError,
    content_hash,
    source_files,
    stage_package,
    validate_package,
    verify_package,
)
from agentrl.hub.refs import parse_ref, sort_versions
from tests.fakes.toy_package import write_toy_package


def test_manifest_with_wrong_field_is_rejected_naming_it(tmp_path):
    package = write_toy_package(tmp_path / "pkg", extra_manifest='colour = "blue"')
    with pytest.raises(ConfigError) as error:
        validate_package(package)
    assert "colour" in str(error.value) and "environment.toml" in str(error.value)
    assert "\n" not in str(error.value)


def test_manifest_with_bad_value_names_field_and_line(tmp_path):
    package = write_toy_package(tmp_path / "pkg", version="one")
    with pytest.raises(ConfigError, match=r"environment.toml:2: version = 'one': must be a semantic version"):
        validate_package(package)


def test_missing_entrypoint_module_is_reported(tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    (package / "toy_echo.py").unlink()
    with pytest.raises(ConfigError, match="entrypoint.*toy_echo.py not found"):
        validate_package(package)


def test_bad_row_is_reported_with_split_and_index(tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    with open(package / "data" / "train.jsonl", "a") as handle:
        handle.write(json.dumps({"prompt": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ConfigError, match="split 'train' row 3: not a valid task"):
        validate_package(package)


def test_content_hash_is_stable_and_sensitive(tmp_path):
    first = write_toy_package(tmp_path / "a")
    second = write_toy_package(tmp_path / "b")
    assert content_hash(first) == content_hash(second)
    (second / "__pycache__").mkdir()
    (second / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert content_hash(first) == content_hash(second), "caches must not change the hash"
    (second / "toy_echo.py").write_text((second / "toy_echo.py").read_text() + "# change\n")
    assert content_hash(first) != content_hash(second)


def test_runs_written_in_the_package_folder_are_not_packaged(tmp_path):
    """The scaffold's README has `agentrl eval --env . --oracle` run in the package folder: its run folder under
    runs/ went into the next push (6 files published as 10, the content hash changed)."""
    package = write_toy_package(tmp_path / "pkg")
    before = content_hash(package)
    (package / "runs" / "eval-toy-oracle").mkdir(parents=True)
    (package / "runs" / "eval-toy-oracle" / "results.jsonl").write_text("{}\n")
    assert content_hash(package) == before
    assert not any(name.startswith("runs/") for name in source_files(package))
    (package / "data" / "runs").mkdir(parents=True)  # only the top-level folder: a data folder named runs stays
    (package / "data" / "runs" / "x.txt").write_text("x")
    assert "data/runs/x.txt" in source_files(package)


def test_stage_writes_parquet_card_and_lock(tmp_path):
    import datasets

    package = write_toy_package(tmp_path / "pkg", rows=5)
    lock = stage_package(package, tmp_path / "out")
    out = tmp_path / "out"
    assert lock.splits == {"train": 5}
    rows = datasets.Dataset.from_parquet(str(out / "dataset" / "train.parquet")).to_list()
    source = [json.loads(line) for line in (package / "data" / "train.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == [r["answer"] for r in source]
    assert json.loads(rows[2]["info"]) == {"index": 2}
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "dataset/train.parquet" in card and "# Toy echo" in card
    recorded = json.loads((out / LOCK_NAME).read_text())
    assert set(recorded["files"]) == {"README.md", "environment.toml", "toy_echo.py", "data/train.jsonl",
                                      "dataset/train.parquet"}
    assert verify_package(out).content_hash == content_hash(package)


def test_verify_detects_corrupted_missing_and_extra_files(tmp_path):
    package = write_toy_package(tmp_path / "pkg")
    out = tmp_path / "out"
    stage_package(package, out)
    (out / "toy_echo.py").write_text("corrupted\n")
    with pytest.raises(HashMismatchError, match="toy_echo.py: sha256 .* does not match"):
        verify_package(out)
    stage_package(package, tmp_path / "out2")
    (tmp_path / "out2" / "data" / "train.jsonl").unlink()
    with pytest.raises(HashMismatchError, match="missing"):
        verify_package(tmp_path / "out2")
    stage_package(package, tmp_path / "out3")
    (tmp_path / "out3" / "smuggled.py").write_text("import os\n")
    with pytest.raises(HashMismatchError, match="smuggled.py: file not in the published package"):
        verify_package(tmp_path / "out3")


def test_refs_and_version_order():
    assert str(parse_ref("alice/swe@1.2.0")) == "alice/swe@1.2.0"
    assert parse_ref("swe", owner="bob").repo_id == "bob/swe"
    assert sort_versions(["0.10.0", "0.2.0", "1.0.0rc1", "1.0.0"]) == ["0.2.0", "0.10.0", "1.0.0rc1", "1.0.0"]
    for bad in ("a/b/c", "alice/swe@", "/x"):
        with pytest.raises(AgentrlError):
            parse_ref(bad)
