"""Token ids -> text for the per-token view, with the model's own tokenizer (`tokenizer.json`).

The folder says which model made its tokens (a run's starting weights, an eval's model); its
`tokenizer.json` is loaded once with the `tokenizers` library (no transformers, no torch)
and each id decoded on its own, special tokens included. Where no tokenizer can be found
(a model not on this machine) the view shows the ids.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

__all__ = ["decoder_for", "model_folder"]


def model_folder(model: str) -> Path | None:
    """The local folder of `model` (a folder, a `cookbook/...` path, a preset, a cached repo id) or None."""
    from agentrl.errors import AgentrlError
    from agentrl.project_files import resolve_project_path

    path = resolve_project_path(model)
    if (path / "tokenizer.json").is_file():
        return path
    try:
        from agentrl.models import resolve_model

        spec = resolve_model(model)
        folder = spec.path or spec.local_path()
    except (AgentrlError, OSError, ValueError):
        return None
    return Path(folder) if (Path(folder) / "tokenizer.json").is_file() else None


@lru_cache(maxsize=8)
def decoder_for(model: str | None) -> Callable[[int], str] | None:
    """`id -> text` with `model`'s tokenizer, or None where it is not available here."""
    if not model:
        return None
    folder = model_folder(model)
    if folder is None:
        return None
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - a tokenizer it cannot read: show ids
        return None

    @lru_cache(maxsize=65536)
    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return decode
