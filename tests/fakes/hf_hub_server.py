"""A small Hugging Face Hub-compatible server on 127.0.0.1, for testing the HF backend without the Hub.

FAKE: the real Hub (huggingface.co) cannot be reached from this machine. This server
implements only the HTTP routes the pinned `huggingface_hub` (1.33) calls for the
operations agentrl uses, with the request and response shapes read from
`huggingface_hub/hf_api.py`, `_commit_api.py`, `file_download.py` and `utils/_http.py`:

    POST /api/repos/create                               create_repo (409 when it exists)
    POST /api/validate-yaml                              README.md card metadata check (create_commit)
    POST /api/{type}s/{ns}/{name}/preupload/{rev}        upload modes: always "regular" (no LFS/Xet here)
    POST /api/{type}s/{ns}/{name}/commit/{rev}           ndjson commit: header, file (base64), deletedFile,
                                                         deletedFolder
    POST /api/{type}s/{ns}/{name}/tag/{rev}              create_tag (409 when the tag exists)
    GET  /api/{type}s/{ns}/{name}/refs                   list_repo_refs (branches, tags)
    GET  /api/{type}s/{ns}/{name}[/revision/{rev}]       repo_info / dataset_info (sha, siblings, cardData)
    GET  /api/{type}s/{ns}/{name}/tree/{rev}[/{path}]    list_repo_tree (recursive), used by snapshot_download
    GET  /api/datasets?search=&author=&filter=           list_datasets
    GET  /api/whoami-v2                                  whoami
    GET  /api/agent-harnesses                            the client's agent-detection registry (user agent)
    HEAD|GET /{type}s/{ns}/{name}/resolve/{rev}/{path}   hf_hub_download (X-Repo-Commit, ETag = git blob id)

Errors use the Hub's `X-Error-Code` header (RepoNotFound, RevisionNotFound, EntryNotFound),
which `hf_raise_for_status` maps to the library's exceptions. Writes need a known token
(`Authorization: Bearer ...`); private repos are invisible without one (404 RepoNotFound,
as the Hub answers). Every request that matches no route is recorded in `unhandled` and
answered 404, so a test can assert the library called nothing this fake does not implement.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import yaml

GITATTRIBUTES = b"*.parquet filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid and ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_type: str
    repo_id: str
    private: bool
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))

    def resolve(self, revision: str) -> str | None:
        revision = unquote(revision)
        if revision in self.branches:
            return self.branches[revision]
        if revision in self.tags:
            return self.tags[revision]
        return revision if revision in self.commits else None

    def add_commit(self, files: dict[str, bytes], parent: str | None, branch: str = "main") -> str:
        material = json.dumps({"parent": parent, "files": {p: git_blob_id(b) for p, b in sorted(files.items())},
                               "n": len(self.commits)}).encode()
        sha = hashlib.sha1(material).hexdigest()
        self.commits[sha] = dict(files)
        self.branches[branch] = sha
        return sha

    def card_data(self, sha: str) -> dict:
        readme = self.commits[sha].get("README.md", b"").decode(errors="replace")
        if readme.startswith("---\n"):
            end = readme.find("\n---", 4)
            if end != -1:
                try:
                    return yaml.safe_load(readme[4:end]) or {}
                except yaml.YAMLError:
                    return {}
        return {}


class FakeHubServer:
    """The server: `start()` runs it in a thread; `.endpoint` is its URL; `stop()` shuts it down."""

    def __init__(self, *, tokens: dict[str, str] | None = None) -> None:
        self.tokens = dict(tokens or {"hf_fake_token_alice": "alice"})
        """Valid tokens -> user name."""
        self.repos: dict[tuple[str, str], FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request."""
        self.unhandled: list[tuple[str, str]] = []
        """Requests that matched no route."""
        self.lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hf-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None

    def __enter__(self) -> FakeHubServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # test helpers ------------------------------------------------------------------------
    def corrupt_file(self, repo_id: str, path: str, *, repo_type: str = "dataset", revision: str = "main") -> None:
        """Flip bytes of a stored file in place (as storage corruption would), keeping its commit."""
        with self.lock:
            repo = self.repos[(repo_type, repo_id)]
            files = repo.commits[repo.resolve(revision)]
            data = bytearray(files[path])
            data[len(data) // 2] ^= 0xFF
            files[path] = bytes(data)


_REPO_RE = r"(?P<type>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)"
_ROUTES: list[tuple[str, re.Pattern, str]] = [
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("GET", re.compile(r"^/api/whoami-v2$"), "whoami"),
    ("GET", re.compile(r"^/api/agent-harnesses$"), "agent_harnesses"),
    ("GET", re.compile(r"^/api/datasets$"), "list_datasets"),
    ("POST", re.compile(rf"^/api/{_REPO_RE}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/{_REPO_RE}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("POST", re.compile(rf"^/api/{_REPO_RE}/tag/(?P<rev>[^/]+)$"), "create_tag"),
    ("GET", re.compile(rf"^/api/{_REPO_RE}/refs$"), "refs"),
    ("GET", re.compile(rf"^/api/{_REPO_RE}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$"), "tree"),
    ("GET", re.compile(rf"^/api/{_REPO_RE}(?:/revision/(?P<rev>[^/]+))?$"), "repo_info"),
    ("GET", re.compile(rf"^/{_REPO_RE}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("HEAD", re.compile(rf"^/{_REPO_RE}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]


class _HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    # plumbing ----------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        url = urlparse(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.hub.requests.append((method, url.path))
        length = int(self.headers.get("Content-Length") or 0)
        self.body = self.rfile.read(length) if length else b""
        for route_method, pattern, name in _ROUTES:
            match = pattern.match(url.path)
            if route_method == method and match:
                try:
                    with self.hub.lock:
                        getattr(self, f"_{name}")(**dict(match.groupdict().items()))
                except _HubError as error:
                    self._send_json({"error": error.message}, status=error.status,
                                    headers={"X-Error-Code": error.code} if error.code else None,
                                    head=method == "HEAD")
                return
        self.hub.unhandled.append((method, url.path))
        self._send_json({"error": f"fake hub: no route for {method} {url.path}"}, status=404, head=method == "HEAD")

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch("HEAD")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def _send(self, body: bytes, *, status: int = 200, content_type: str = "application/json",
              headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _send_json(self, data, *, status: int = 200, headers: dict | None = None, head: bool = False) -> None:
        self._send(json.dumps(data).encode(), status=status, headers=headers, head=head)

    def _user(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        token = auth[7:] if auth.startswith("Bearer ") else None
        return self.hub.tokens.get(token) if token else None

    def _require_user(self) -> str:
        user = self._user()
        if user is None:
            raise _HubError(401, "Invalid credentials in Authorization header")
        return user

    def _repo(self, repo_type: str, repo_id: str, *, write: bool = False) -> FakeRepo:
        repo = self.hub.repos.get((repo_type.rstrip("s"), repo_id))
        user = self._user()
        if repo is None or (repo.private and user != repo_id.split("/")[0]):
            raise _HubError(404, "Repository not found", "RepoNotFound")
        if write and user != repo_id.split("/")[0]:
            raise _HubError(403, "You don't have the rights to write to this repo")
        return repo

    def _revision(self, repo: FakeRepo, revision: str | None) -> str:
        sha = repo.resolve(revision or "main")
        if sha is None:
            raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return sha

    def _repo_json(self, repo: FakeRepo, sha: str, *, siblings: bool = True) -> dict:
        card = repo.card_data(sha)
        info = {"id": repo.repo_id, "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
                "author": repo.repo_id.split("/")[0], "sha": sha, "private": repo.private, "disabled": False,
                "gated": False, "downloads": 0, "likes": 0, "tags": list(card.get("tags") or []),
                "createdAt": repo.created_at, "lastModified": repo.created_at, "cardData": card}
        if siblings:
            info["siblings"] = [{"rfilename": path} for path in sorted(repo.commits[sha])]
        return info

    # routes ------------------------------------------------------------------------------
    def _create_repo(self) -> None:
        user = self._require_user()
        payload = json.loads(self.body or b"{}")
        namespace = payload.get("organization") or user
        repo_type = payload.get("type") or "model"
        repo_id = f"{namespace}/{payload['name']}"
        url = f"{self.hub.endpoint}/{'' if repo_type == 'model' else repo_type + 's/'}{repo_id}"
        if namespace != user:
            raise _HubError(403, f"You don't have the rights to create a repo under {namespace}")
        if (repo_type, repo_id) in self.hub.repos:
            self._send_json({"error": "You already created this repo", "url": url}, status=409)
            return
        visibility = payload.get("visibility") or "public"  # huggingface_hub 1.x sends visibility, not private
        repo = FakeRepo(repo_type, repo_id, visibility != "public")
        repo.add_commit({".gitattributes": GITATTRIBUTES}, None)
        self.hub.repos[(repo_type, repo_id)] = repo
        self._send_json({"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self) -> None:
        content = json.loads(self.body).get("content", "")
        if content.startswith("---\n"):
            end = content.find("\n---", 4)
            try:
                metadata = yaml.safe_load(content[4:end]) if end != -1 else None
            except yaml.YAMLError as error:
                self._send_json({"errors": [{"message": str(error)}], "warnings": []}, status=400)
                return
            if metadata is not None and not isinstance(metadata, dict):
                self._send_json({"errors": [{"message": "metadata must be a mapping"}], "warnings": []}, status=400)
                return
        self._send_json({"errors": [], "warnings": []})

    def _whoami(self) -> None:
        user = self._require_user()
        self._send_json({"type": "user", "name": user, "auth": {"type": "access_token",
                                                               "accessToken": {"role": "write"}}})

    def _agent_harnesses(self) -> None:
        self._send_json({"standardEnvVars": [], "harnesses": {}})

    def _list_datasets(self) -> None:
        search = (self.query.get("search") or "").lower()
        author = self.query.get("author")
        wanted_tags = [t for t in parse_qs(urlparse(self.path).query).get("filter", []) if t]
        user = self._user()
        found = []
        for (repo_type, repo_id), repo in sorted(self.hub.repos.items()):
            if repo_type != "dataset" or (repo.private and user != repo_id.split("/")[0]):
                continue
            if author and repo_id.split("/")[0] != author:
                continue
            if search and search not in repo_id.lower():
                continue
            info = self._repo_json(repo, repo.branches["main"], siblings=False)
            if any(tag not in info["tags"] for tag in wanted_tags):
                continue
            found.append(info)
        limit = int(self.query.get("limit") or 1000)
        self._send_json(found[:limit])

    def _preupload(self, type: str, repo: str, rev: str) -> None:
        self._require_user()
        target = self._repo(type, repo, write=True)
        sha = target.resolve(rev)
        current = target.commits.get(sha, {}) if sha else {}
        files = []
        for entry in json.loads(self.body)["files"]:
            existing = current.get(entry["path"])
            files.append({"path": entry["path"], "uploadMode": "regular", "shouldIgnore": False,
                          "oid": git_blob_id(existing) if existing is not None else None})
        self._send_json({"files": files, "commitOid": sha})

    def _commit(self, type: str, repo: str, rev: str) -> None:
        self._require_user()
        target = self._repo(type, repo, write=True)
        branch = unquote(rev)
        parent = target.branches.get(branch)
        if parent is None:
            raise _HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        files = dict(target.commits[parent])
        header = None
        for line in self.body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
                if value.get("parentCommit") and value["parentCommit"] != parent:
                    raise _HubError(412, "A commit has happened since. Please refresh and try again.")
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise _HubError(400, "fake hub: only base64 file content is supported")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise _HubError(404, f"{value['path']} does not exist", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: b for p, b in files.items() if not p.startswith(prefix)}
            else:  # lfsFile / copies: never asked for, since preupload answers "regular"
                raise _HubError(400, f"fake hub: unsupported commit operation {key!r}")
        if header is None:
            raise _HubError(400, "commit payload has no header")
        sha = target.add_commit(files, parent, branch)
        url_type = "" if type == "models" else f"{type}/"
        self._send_json({"success": True, "commitOid": sha,
                         "commitUrl": f"{self.hub.endpoint}/{url_type}{repo}/commit/{sha}", "pullRequestUrl": None})

    def _create_tag(self, type: str, repo: str, rev: str) -> None:
        self._require_user()
        target = self._repo(type, repo, write=True)
        sha = self._revision(target, rev)
        tag = json.loads(self.body)["tag"]
        if tag in target.tags:
            self._send_json({"error": f"Tag {tag} already exists"}, status=409)
            return
        target.tags[tag] = sha
        self._send_json({})

    def _refs(self, type: str, repo: str) -> None:
        target = self._repo(type, repo)
        self._send_json({
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": s} for n, s in target.branches.items()],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": s} for n, s in target.tags.items()],
            "converts": [],
        })

    def _tree(self, type: str, repo: str, rev: str, path: str | None = None) -> None:
        target = self._repo(type, repo)
        sha = self._revision(target, rev)
        recursive = self.query.get("recursive", "false").lower() in ("1", "true")
        prefix = (unquote(path).strip("/") + "/") if path else ""
        entries: dict[str, dict] = {}
        for file_path, data in sorted(target.commits[sha].items()):
            if not file_path.startswith(prefix):
                continue
            rest = file_path[len(prefix):]
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                folder = prefix + "/".join(parts[:depth])
                if recursive or depth == 1:
                    entries.setdefault(folder, {"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                                "size": 0, "path": folder})
            if recursive or len(parts) == 1:
                entries[file_path] = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": file_path}
        if path and not entries:
            raise _HubError(404, f"{path} does not exist", "EntryNotFound")
        self._send_json(list(entries.values()))

    def _repo_info(self, type: str, repo: str, rev: str | None = None) -> None:
        target = self._repo(type, repo)
        self._send_json(self._repo_json(target, self._revision(target, rev)))

    def _resolve(self, type: str, repo: str, rev: str, path: str) -> None:
        target = self._repo(type, repo)
        sha = self._revision(target, rev)
        path = unquote(path)
        data = target.commits[sha].get(path)
        if data is None:
            raise _HubError(404, f"{path} does not exist", "EntryNotFound")
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_id(data)}"', "Accept-Ranges": "bytes"}
        status = 200
        range_header = self.headers.get("Range")
        if range_header and range_header.startswith("bytes="):
            start_text, _, end_text = range_header[6:].partition("-")
            start = int(start_text or 0)
            end = int(end_text) if end_text else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start:end + 1], 206
        self._send(data, status=status, content_type="application/octet-stream", headers=headers,
                   head=self.command == "HEAD")
