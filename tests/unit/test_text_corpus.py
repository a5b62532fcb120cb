"""The pretraining corpus: files found, duplicates dropped, held-out split by content, one-line errors."""

from __future__ import annotations

import pytest

from agentrl.errors import AgentrlError
from agentrl.text_corpus import TextCorpusConfig, load_corpus


def _tree(root, count: int = 60):
    for index in range(count):
        folder = root / f"pkg{index % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"m{index}.py").write_text(f"def f{index}():\n    return {index}\n")
    return root


def test_duplicates_count_once_and_the_split_follows_content(tmp_path):
    root = _tree(tmp_path / "a")
    (root / "copy.py").write_text((root / "pkg0" / "m0.py").read_text())  # the same file twice
    (root / "notes.txt").write_text("not a python file")
    corpus = load_corpus(TextCorpusConfig(roots=[str(root)], heldout_fraction=0.2))
    assert corpus.facts["duplicates"] == 1
    assert corpus.facts["files"] == 60
    assert len(corpus.train) + len(corpus.heldout) == 60
    assert not set(corpus.train) & set(corpus.heldout)
    # adding unrelated files moves no file between the splits
    (root / "pkg9").mkdir()
    for index in range(100, 140):
        (root / "pkg9" / f"x{index}.py").write_text(f"X = {index}\n")
    grown = load_corpus(TextCorpusConfig(roots=[str(root)], heldout_fraction=0.2))
    assert set(corpus.heldout) <= set(grown.heldout)
    assert set(corpus.train) <= set(grown.train)


def test_seed_orders_training_files_and_sizes_are_bounded(tmp_path):
    root = _tree(tmp_path / "a")
    (root / "big.py").write_text("x = 1\n" * 100)
    (root / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    one = load_corpus(TextCorpusConfig(roots=[str(root)], heldout_fraction=0.2, seed=1, max_file_bytes=200))
    two = load_corpus(TextCorpusConfig(roots=[str(root)], heldout_fraction=0.2, seed=2, max_file_bytes=200))
    assert one.train != two.train and sorted(one.train) == sorted(two.train)
    assert one.facts["skipped"] == 2 and one.facts["sha256"] == two.facts["sha256"]
    capped = load_corpus(TextCorpusConfig(roots=[str(root)], heldout_fraction=0.5, max_chars=300, max_file_bytes=200))
    assert capped.facts["chars"] < 300 + 40 and capped.facts["files"] < 20


def test_one_line_errors(tmp_path):
    with pytest.raises(AgentrlError, match=r"corpus.roots: .*missing is not a folder"):
        load_corpus(TextCorpusConfig(roots=[str(tmp_path / "missing")]))
    (tmp_path / "one.py").write_text("x = 1\n")
    with pytest.raises(AgentrlError, match="held-out files .*raise corpus.max_chars or corpus.heldout_fraction"):
        load_corpus(TextCorpusConfig(roots=[str(tmp_path)], heldout_fraction=0.01))


def test_site_packages_stands_for_the_interpreters_packages():
    corpus = load_corpus(TextCorpusConfig(max_chars=2_000_000, heldout_fraction=0.1))
    assert any("site-packages" in root or "dist-packages" in root for root in corpus.facts["roots"])
    assert corpus.facts["chars"] >= 2_000_000
