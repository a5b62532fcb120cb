"""agentrl.viewer: `agentrl view`, a local web page of runs, evaluations and rollouts.

- `folders.py`: run and eval folders found under the given paths (ids, metrics, summaries);
- `rollouts.py`: `rollouts.jsonl` / `results.jsonl` indexed as they grow, filters, per-token rows;
- `tokens.py`: token ids -> text with the folder's model tokenizer;
- `app.py`: the starlette app (JSON API + the page in `static/`, no CDN);
- `serve.py`: uvicorn on 127.0.0.1, in the foreground or a background thread.

Light at import (starlette and uvicorn load when the app is made: extra `view`).
"""

__all__ = ["ViewerServer", "create_app", "serve", "view_command"]


def __getattr__(name: str):
    if name == "create_app":
        from agentrl.viewer.app import create_app

        return create_app
    if name in ("ViewerServer", "serve", "view_command"):
        from agentrl.viewer import serve as module

        return getattr(module, name)
    raise AttributeError(name)
