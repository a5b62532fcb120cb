"""The viewer's ASGI app (starlette): a JSON API over the folders, and the page that reads it.

    GET /                                  the page (static/index.html; viewer.js, viewer.css)
    GET /api/folders                       runs and evaluations (re-scanned: new runs appear)
    GET /api/folders/{id}                  one folder: description, eval summary, run config
    GET /api/folders/{id}/metrics?since=N  a run's step metrics from row N on (the page polls it)
    GET /api/folders/{id}/rollouts?step=&task=&min_reward=&max_reward=&offset=&limit=
                                           rollout summaries matching the filters
    GET /api/folders/{id}/rollouts/{n}     one rollout in full, with its per-token rows
    GET /api/compare?a=ID&b=ID             tasks both evaluations ran, with each side's rollouts

Everything a rollout holds came from a model or a sandbox, so the page treats it as
hostile: it is inserted as text, never as HTML, and the page is served with a
Content-Security-Policy that allows only the viewer's own script and style files. A
rollout's strings come back cut at `MAX_TEXT_CHARS`, with a marker (a 300 MB tool output
crashed the browser tab); the file keeps them whole.
Requests whose Host is not 127.0.0.1 or localhost are refused (DNS rebinding). Bad
parameters get a 400 with a one-line message naming the parameter; unknown folders and
rollouts a 404.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError, NotFoundError
from agentrl.viewer.folders import FolderSet
from agentrl.viewer.rollouts import token_rows
from agentrl.viewer.tokens import decoder_for

__all__ = ["create_app", "STATIC"]

STATIC = Path(__file__).parent / "static"
MAX_LIMIT = 5000
MAX_TEXT_CHARS = 200_000
ALLOWED_HOSTS = ("127.0.0.1", "localhost")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class BadParameter(AgentrlError):
    """A query parameter of the API that cannot be used."""


def _number(params: Any, name: str, kind: type, default: Any = None) -> Any:
    value = params.get(name)
    if value is None or value == "":
        return default
    try:
        return kind(value)
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise BadParameter(f"parameter {name}={value!r} is not {expected}") from None


def _cut(text: str, max_chars: int, source: str) -> str:
    return text[:max_chars] + f"\n[... {len(text) - max_chars:,} more characters cut by the viewer; {source} has them]"


def json_safe(value: Any, *, max_chars: int | None = None, source: str = "the file") -> Any:
    """`value` with every non-finite float as None (JSON has no NaN or Infinity), walked without recursion; with
    `max_chars`, every longer string cut there with a marker naming `source`."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str) and max_chars is not None and len(value) > max_chars:
        return _cut(value, max_chars, source)
    if not isinstance(value, (dict, list)):
        return value
    root = [value]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        holder, key = stack.pop()
        item = holder[key]
        if isinstance(item, float) and not math.isfinite(item):
            holder[key] = None
        elif isinstance(item, str) and max_chars is not None and len(item) > max_chars:
            holder[key] = _cut(item, max_chars, source)
        elif isinstance(item, dict):
            copy = dict(item)
            holder[key] = copy
            stack += [(copy, name) for name in copy]
        elif isinstance(item, list):
            copy = list(item)
            holder[key] = copy
            stack += [(copy, index) for index in range(len(copy))]
    return root[0]


def json_response(content: Any, status_code: int = 200, *, max_chars: int | None = None, source: str = "the file"):
    """A JSON answer whatever the files held: NaN / Infinity as null, text ASCII-escaped (a lone surrogate from a
    `\\ud800` escape, or a folder name that is not UTF-8, becomes a JSON escape instead of a 500); with
    `max_chars`, longer strings cut with a marker naming `source` (`json_safe`)."""
    from starlette.responses import Response

    body = json.dumps(json_safe(content, max_chars=max_chars, source=source), ensure_ascii=True, allow_nan=False,
                      separators=(",", ":"))
    return Response(body, status_code=status_code, media_type="application/json")


def create_app(paths: list[str | Path]):
    """The viewer app for these run / eval folders (or their parents)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.requests import Request
    from starlette.responses import FileResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    folders = FolderSet(paths)

    async def index(request: Request):
        return FileResponse(STATIC / "index.html")

    async def list_folders(request: Request):
        return json_response({"folders": [folder.describe() for folder in folders.scan()]})

    async def folder_info(request: Request):
        folder = folders.get(request.path_params["folder"])
        return json_response({**folder.describe(), "summary": folder.summary(), "config": folder.run_config()})

    async def metrics(request: Request):
        folder = folders.get(request.path_params["folder"])
        since = _number(request.query_params, "since", int, 0)
        if since < 0:
            raise BadParameter(f"parameter since={since} must be >= 0")
        rows = folder.metrics(since=since)
        return json_response({"since": since, "rows": rows, "next": since + len(rows)})

    async def rollouts(request: Request):
        folder = folders.get(request.path_params["folder"])
        params = request.query_params
        offset = _number(params, "offset", int, 0)
        limit = _number(params, "limit", int, 1000)
        if offset < 0 or not 1 <= limit <= MAX_LIMIT:
            raise BadParameter(f"parameters offset={offset} and limit={limit}: "
                               f"offset >= 0, 1 <= limit <= {MAX_LIMIT}")
        matched = folder.rollouts.filter(step=_number(params, "step", int), task=params.get("task") or None,
                                         min_reward=_number(params, "min_reward", float),
                                         max_reward=_number(params, "max_reward", float))
        steps = sorted({s["step"] for s in folder.rollouts.summaries() if s["step"] is not None})
        return json_response({"total": folder.rollouts.count(), "matched": len(matched), "offset": offset,
                             "rows": matched[offset: offset + limit], "steps": steps})

    async def rollout(request: Request):
        folder = folders.get(request.path_params["folder"])
        n = _number(request.path_params, "n", int)
        record = folder.rollouts.record(n)
        decode = decoder_for(folder.model())
        return json_response({"n": n, "folder": folder.id, "record": record,
                             "tokens": token_rows(record, decode=decode), "decoded": decode is not None},
                             max_chars=MAX_TEXT_CHARS, source=folder.rollouts.path.name)

    async def compare(request: Request):
        params = request.query_params
        if not params.get("a") or not params.get("b"):
            raise BadParameter("parameters a and b (two folder ids from /api/folders) are both needed")
        sides = [folders.get(params["a"]), folders.get(params["b"])]
        grouped: list[dict[str, list[dict[str, Any]]]] = [{}, {}]
        for side, folder in enumerate(sides):
            for summary in folder.rollouts.summaries():
                grouped[side].setdefault(summary["task_key"], []).append(summary)
        tasks = []
        for key, left in grouped[0].items():
            right = grouped[1].get(key)
            if right is None:
                continue
            tasks.append({"task_key": key, "prompt": left[0]["prompt"], "a": left, "b": right,
                          "a_reward": _mean(left), "b_reward": _mean(right)})
        return json_response({"a": sides[0].describe(), "b": sides[1].describe(), "tasks": tasks,
                             "only_a": len(grouped[0]) - len(tasks),
                             "only_b": len(set(grouped[1]) - set(grouped[0]))})

    async def not_found(request: Request, error: Exception):
        return json_response({"error": str(error)}, status_code=404)

    async def bad_request(request: Request, error: Exception):
        return json_response({"error": str(error)}, status_code=400)

    class SecurityHeaders(BaseHTTPMiddleware):
        async def dispatch(self, request, call_next):
            response = await call_next(request)
            response.headers["Content-Security-Policy"] = CSP
            response.headers["X-Content-Type-Options"] = "nosniff"
            response.headers["Referrer-Policy"] = "no-referrer"
            if request.url.path.startswith("/api/"):
                response.headers["Cache-Control"] = "no-store"
            return response

    routes = [
        Route("/", index),
        Route("/api/folders", list_folders),
        Route("/api/folders/{folder}", folder_info),
        Route("/api/folders/{folder}/metrics", metrics),
        Route("/api/folders/{folder}/rollouts", rollouts),
        Route("/api/folders/{folder}/rollouts/{n}", rollout),
        Route("/api/compare", compare),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    # Only requests addressed to this machine's loopback names: a page elsewhere cannot reach the API
    # through a DNS name rebound to 127.0.0.1.
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=list(ALLOWED_HOSTS)),
                  Middleware(SecurityHeaders)]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={NotFoundError: not_found, BadParameter: bad_request})
    app.state.folders = folders
    return app


def _mean(summaries: list[dict[str, Any]]) -> float | None:
    rewards = [s["reward"] for s in summaries if isinstance(s["reward"], (int, float))]
    return sum(rewards) / len(rewards) if rewards else None
