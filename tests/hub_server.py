"""A local HTTP server that answers as the Hugging Face hub's file API does, for tests of hub downloads (nothing
leaves the machine): the routes huggingface_hub's `snapshot_download` and `list_repo_files` call, as its own
client reads them (huggingface_hub hf_api.py `repo_info`, `list_repo_tree`; file_download.py
`get_hf_file_metadata`, which takes X-Repo-Commit, ETag and Content-Length):

    GET  /api/models/{repo}/revision/{rev}           {"id", "sha", "siblings": [{"rfilename"}]}
    GET  /api/models/{repo}/tree/{rev}?recursive=..   [{"type": "file", "path", "size", "oid"}]
    HEAD /{repo}/resolve/{rev}/{path}, GET the same   the file, headers X-Repo-Commit, ETag, Content-Length

A repo is a local folder served at one commit (its "main" and its commit hash resolve; any other revision is 404
RevisionNotFound); a repo with a token answers 401 unless the request carries `Authorization: Bearer <token>`.
`gets` counts the file downloads by path.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubServer:
    """Serves `repos` ({repo id: folder}) on 127.0.0.1; `url` is the HF_ENDPOINT to use. A context manager."""

    def __init__(self, repos: dict[str, str], tokens: dict[str, str] | None = None) -> None:
        self.repos = {rid: Path(folder) for rid, folder in repos.items()}
        self.tokens = tokens or {}
        self.commits = {rid: hashlib.sha1(rid.encode()).hexdigest() for rid in repos}
        self.gets: Counter[str] = Counter()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo_id: str) -> list[str]:
        root = self.repos[repo_id]
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _error(self, status: int, code: str) -> None:
                self._send(status, json.dumps({"error": code}).encode(),
                           {"X-Error-Code": code, "Content-Type": "application/json"})

            def _repo(self, parts: list[str]) -> tuple[str, list[str]] | None:
                rid = "/".join(parts[:2])
                if rid not in hub.repos:
                    self._error(404, "RepositoryNotFound")
                    return None
                token = hub.tokens.get(rid)
                if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                    self._error(401, "RepositoryNotFound")
                    return None
                return rid, parts[2:]

            def _commit(self, rid: str, rev: str) -> str | None:
                if rev in ("main", hub.commits[rid]):
                    return hub.commits[rid]
                self._error(404, "RevisionNotFound")
                return None

            def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
                self.do_GET()

            def do_GET(self) -> None:  # noqa: N802
                parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
                api = parts[:2] == ["api", "models"]
                found = self._repo(parts[2:] if api else parts)
                if found is None:
                    return
                rid, rest = found
                if api and len(rest) >= 2 and rest[0] in ("revision", "tree"):
                    commit = self._commit(rid, rest[1])
                    if commit is None:
                        return
                    root = hub.repos[rid]
                    if rest[0] == "revision":
                        doc: object = {"id": rid, "sha": commit,
                                       "siblings": [{"rfilename": f} for f in hub.files(rid)]}
                    else:
                        doc = [{"type": "file", "path": f, "size": (root / f).stat().st_size,
                                "oid": hashlib.sha1((root / f).read_bytes()).hexdigest()} for f in hub.files(rid)]
                    self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})
                    return
                if api or len(rest) < 3 or rest[0] != "resolve":
                    self._error(404, "EntryNotFound")
                    return
                commit = self._commit(rid, rest[1])
                if commit is None:
                    return
                path = hub.repos[rid] / "/".join(rest[2:])
                if not path.is_file():
                    self._error(404, "EntryNotFound")
                    return
                data = path.read_bytes()
                if self.command == "GET":
                    hub.gets["/".join(rest[2:])] += 1
                self._send(200, data, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                       "Content-Type": "application/octet-stream"})

        return Handler


def env_for(server: HubServer) -> dict[str, str]:
    """Environment variables that point huggingface_hub at `server` (and nothing else)."""
    return {"HF_ENDPOINT": server.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "NO_PROXY": "127.0.0.1"}
