"""A raw-text corpus found on this machine, for `agentrl pretrain`: files, deduplicated, split, shuffled.

No dataset can be downloaded on the machines agentrl runs on, but every one of them holds
hundreds of MB of real text: the source files of the installed Python packages and the
documentation under `/usr/share/doc`. `TextCorpusConfig` names folders (``"site-packages"``
stands for the running interpreter's package folders) and file suffixes; `load_corpus` reads
the matching files in sorted path order, drops exact duplicates (by content hash, so the
same file installed twice counts once), and splits them into documents for training and a
held-out set. A file goes to the held-out set by its content hash, not by its position, so
the split of a file does not change when other files come or go; the training documents are
then shuffled with the seed. `facts` says what was read (files, bytes, duplicates, the
corpus hash), so a run folder records which corpus it learned from.

Torch-free; tokenization is the caller's (the model's own tokenizer).
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from agentrl.config import BaseConfig
from agentrl.errors import AgentrlError

__all__ = ["Corpus", "TextCorpusConfig", "load_corpus"]

SITE_PACKAGES = "site-packages"
"""The root name that stands for the running interpreter's package folders (purelib and platlib)."""


class TextCorpusConfig(BaseConfig):
    """Which files on this machine make the corpus, and how much of them."""

    roots: list[str] = Field(default_factory=lambda: [SITE_PACKAGES], min_length=1)
    """Folders searched recursively; "site-packages" is the running Python's package folders."""
    suffixes: list[str] = Field(default_factory=lambda: [".py"], min_length=1)
    """File name endings that are read (e.g. ".py", ".md", ".txt")."""
    max_file_bytes: int = Field(default=200_000, gt=0)
    """Larger files are skipped (generated tables, vendored bundles)."""
    max_chars: int = Field(default=64_000_000, gt=0)
    """At most about this many characters are read, in sorted path order."""
    heldout_fraction: float = Field(default=0.02, gt=0, lt=1)
    """Share of the files (by content hash) held out for evaluation."""
    seed: int = 0
    """Seed of the training documents' order."""


@dataclass
class Corpus:
    """Training and held-out documents, and what was read."""

    train: list[str]
    """Training documents, shuffled with the seed."""
    heldout: list[str]
    """Held-out documents, in hash order."""
    facts: dict[str, object]
    """files, bytes, duplicates, skipped, roots, sha256 of the sorted content hashes."""


def _roots(config: TextCorpusConfig) -> list[Path]:
    roots: list[Path] = []
    for root in config.roots:
        if root == SITE_PACKAGES:
            found = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
            roots += sorted(Path(path) for path in found if Path(path).is_dir())
            continue
        path = Path(root).expanduser()
        if not path.is_dir():
            raise AgentrlError(f"corpus.roots: {root} is not a folder; name folders of text files or "
                               f"{SITE_PACKAGES!r}")
        roots.append(path)
    return roots


def _files(roots: list[Path], suffixes: tuple[str, ...]) -> list[Path]:
    found: set[Path] = set()
    for root in roots:
        for path in root.rglob("*"):
            if path.name.endswith(suffixes) and path.is_file() and not path.is_symlink():
                found.add(path)
    return sorted(found)


def _heldout(digest: str, fraction: float) -> bool:
    return int(digest[:8], 16) / 0xFFFFFFFF < fraction


def load_corpus(config: TextCorpusConfig) -> Corpus:
    """Read, deduplicate and split the corpus; a one-line error when it has nothing to train or hold out."""
    roots = _roots(config)
    seen: set[str] = set()
    train: list[tuple[str, str]] = []
    heldout: list[tuple[str, str]] = []
    total = duplicates = skipped = 0
    for path in _files(roots, tuple(config.suffixes)):
        if total >= config.max_chars:
            break
        try:
            if path.stat().st_size > config.max_file_bytes:
                skipped += 1
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        if not text.strip():
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            duplicates += 1
            continue
        seen.add(digest)
        total += len(text)
        (heldout if _heldout(digest, config.heldout_fraction) else train).append((digest, text))
    where = ", ".join(str(root) for root in roots)
    if not train or not heldout:
        raise AgentrlError(
            f"corpus: {len(train)} training and {len(heldout)} held-out files of {config.suffixes} under {where}; "
            "add corpus.roots or corpus.suffixes, or raise corpus.max_chars or corpus.heldout_fraction"
        )
    heldout.sort()
    rng = random.Random(config.seed)
    rng.shuffle(train)
    corpus_hash = hashlib.sha256("".join(sorted(seen)).encode()).hexdigest()
    facts: dict[str, object] = {
        "roots": [str(root) for root in roots], "suffixes": list(config.suffixes),
        "files": len(train) + len(heldout), "train_files": len(train), "heldout_files": len(heldout),
        "chars": total, "duplicates": duplicates, "skipped": skipped, "sha256": corpus_hash,
    }
    return Corpus(train=[text for _, text in train], heldout=[text for _, text in heldout], facts=facts)
