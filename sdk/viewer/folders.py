"""The folders `agentrl view` shows: training runs and evaluations, found under the paths it is given.

A run folder (`agentrl train`) holds `config.toml` from its start, then `metrics.jsonl` and
`rollouts.jsonl` (`agentrl.rl.rollout_log`) as it trains; an evaluation folder (`agentrl eval`) holds
`results.jsonl` and, once finished, `summary.json`. Each path given is such a folder or a
parent of some (e.g. `runs/`), looked at one level down, again at every listing so runs
started later appear. Folders get ids in the order they were found; requests name folders
by id only, never by path.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.errors import NotFoundError
from agentrl.rl.report import read_metrics
from agentrl.rl.rollout_log import ROLLOUTS_FILE
from agentrl.viewer.rollouts import RolloutIndex

__all__ = ["Folder", "FolderSet", "folder_kind"]


def _is_run_config(path: Path) -> bool:
    """A run's config.toml (the resolved RunConfig, written before step 0) has an [orchestrator] table."""
    try:
        return path.is_file() and "[orchestrator]" in path.read_text(errors="replace")
    except OSError:
        return False


def folder_kind(path: Path) -> Literal["run", "eval"] | None:
    """"run", "eval" or None for a folder that is neither."""
    if (path / "metrics.jsonl").exists() or (path / ROLLOUTS_FILE).exists() \
            or _is_run_config(path / "config.toml"):
        return "run" if (path / "config.toml").is_file() else None
    if (path / "results.jsonl").is_file() or (path / "summary.json").is_file():
        return "eval"
    return None


@dataclass
class Folder:
    """One run or evaluation folder."""

    id: str
    path: Path
    kind: Literal["run", "eval"]
    rollouts: RolloutIndex = field(init=False)

    def __post_init__(self) -> None:
        self.rollouts = RolloutIndex(self.path / (ROLLOUTS_FILE if self.kind == "run" else "results.jsonl"))

    def metrics(self, *, since: int = 0) -> list[dict[str, Any]]:
        """A run's step metrics from row `since` on ([] for an evaluation)."""
        if self.kind != "run":
            return []
        try:
            return read_metrics(self.path / "metrics.jsonl")[since:]
        except ValueError:  # not UTF-8: the lines that still parse, with the bad bytes replaced
            text = (self.path / "metrics.jsonl").read_bytes().decode("utf-8", errors="replace")
            rows = []
            for line in text.splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
            return rows[since:]

    def summary(self) -> dict[str, Any] | None:
        """An evaluation's summary.json (None while it runs, or for a run)."""
        path = self.path / "summary.json"
        if self.kind != "eval" or not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (ValueError, OSError):  # ValueError: not JSON, or not UTF-8
            return None

    def run_config(self) -> dict[str, Any]:
        """A run's config.toml as a dict ({} when unreadable or for an evaluation)."""
        if self.kind != "run":
            return {}
        try:
            return tomllib.loads((self.path / "config.toml").read_text())
        except (ValueError, OSError):  # ValueError: not TOML, or not UTF-8
            return {}

    def model(self) -> str | None:
        """The model whose tokenizer decodes the folder's tokens: run: starting weights; eval: its model."""
        if self.kind == "eval":
            summary = self.summary() or {}
            return summary.get("model")
        model = self.run_config().get("model", {})
        return model.get("init_checkpoint") or model.get("name")

    def describe(self) -> dict[str, Any]:
        """What the folder list shows."""
        info: dict[str, Any] = {"id": self.id, "name": self.path.name, "path": str(self.path),
                                "kind": self.kind, "rollouts": self.rollouts.count()}
        if self.kind == "run":
            rows = self.metrics()
            config = self.run_config()
            info.update(steps=len(rows), max_steps=config.get("orchestrator", {}).get("max_steps"),
                        env=config.get("env", {}).get("name"), model=config.get("model", {}).get("name"),
                        reward=rows[-1].get("reward") if rows else None,
                        finished=(self.path / "report.md").is_file())
        else:
            summary = self.summary() or {}
            info.update(env=summary.get("env"), model=summary.get("model"), reward=summary.get("mean_reward"),
                        finished=bool(summary))
        return info


class FolderSet:
    """The folders under the given paths, with stable ids."""

    def __init__(self, paths: list[str | Path]) -> None:
        if not paths:
            raise NotFoundError("agentrl view: no folder given; pass a run or eval folder, or one like runs/")
        self.roots = [Path(p) for p in paths]
        for root in self.roots:
            if not root.is_dir():
                raise NotFoundError(f"{root}: no such folder; pass a run folder (agentrl train -o), an eval "
                                    "folder (agentrl eval -o) or a folder holding them")
        self._by_path: dict[Path, Folder] = {}
        self.scan()
        if not self._by_path:
            names = ", ".join(str(root) for root in self.roots)
            raise NotFoundError(f"{names}: no run or eval folder there (a run has config.toml and "
                                "metrics.jsonl, an eval results.jsonl); pass the folder agentrl train or "
                                "agentrl eval wrote")

    def scan(self) -> list[Folder]:
        """Look for new folders; return every folder known, in the order found."""
        for root in self.roots:
            candidates = [root] if folder_kind(root) else sorted(p for p in root.iterdir() if p.is_dir())
            for path in candidates:
                kind = folder_kind(path)
                key = path.resolve()
                if kind is not None and key not in self._by_path:
                    self._by_path[key] = Folder(id=str(len(self._by_path)), path=path, kind=kind)
        return list(self._by_path.values())

    def get(self, folder_id: str) -> Folder:
        for folder in self._by_path.values():
            if folder.id == folder_id:
                return folder
        raise NotFoundError(f"no folder with id {folder_id!r}; GET /api/folders lists them")
