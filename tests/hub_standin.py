"""A local stand-in of the Hugging Face Hub: the endpoints huggingface-hub calls to list a repository
and download its files, serving real GGUF files from disk. Point a process at it with
HF_ENDPOINT=<url> (read by huggingface-hub when it is imported).

Endpoints (as the Hub answers them):
- GET  /api/models/<user>/<repo>[/revision/<rev>]  the repository, its commit and files (sizes and
  LFS SHA-256 with ?blobs=true); 401 with X-Error-Code GatedRepo for a gated repository without
  the right token, 404 RepoNotFound / RevisionNotFound;
- HEAD /<user>/<repo>/resolve/<rev>/<path>         X-Repo-Commit, X-Linked-Etag (the SHA-256),
  X-Linked-Size;
- GET  the same                                     the bytes, honouring `Range: bytes=N-` (206).

Faults a test can ask for: cut a file's next N downloads after `cut_at` bytes (the connection
drops mid-body), serve a file corrupted (one byte flipped) its next N times, pace downloads.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import gguf
from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

_HASHES: dict[tuple[str, int, int], str] = {}


def sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def split_gguf(src: Path, out: Path, shards: int) -> list[Path]:
    """Write `src` as a split GGUF (`out` stem + -0000k-of-0000n.gguf), as llama.cpp's gguf-split does:
    the metadata in the first file, the tensors spread over all of them."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    per = (len(reader.tensors) + shards - 1) // shards
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess, split_max_tensors=per)
    import contextlib
    import io

    with contextlib.redirect_stderr(io.StringIO()):  # its own progress bar
        copy_with_new_metadata(reader, writer, {}, [])
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))


@dataclass
class Repo:
    files: dict[str, Path]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated_token: str | None = None  # set: requests need "Authorization: Bearer <token>"


@dataclass
class HubStandIn:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Range header)
    cut: dict[str, int] = field(default_factory=dict)  # file -> downloads still to cut short
    cut_at: int = 1 << 20
    corrupt: dict[str, int] = field(default_factory=dict)  # file -> downloads still to corrupt
    pace_bps: float = 0.0  # bytes per second per download; 0 = as fast as it goes
    url: str = ""

    def start(self) -> HubStandIn:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
                hub._serve(self, head=True)

            def do_GET(self) -> None:  # noqa: N802
                hub._serve(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloads(self, name: str) -> list[str]:
        """The Range headers of every GET of file `name` so far ("" for a whole-file GET)."""
        return [rng for method, path, rng in self.log if method == "GET" and "/resolve/" in path and path.endswith("/" + name)]

    # --- the endpoints -----------------------------------------------------------------------

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str, head: bool) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _allowed(self, h: BaseHTTPRequestHandler, repo: Repo) -> bool:
        return repo.gated_token is None or h.headers.get("Authorization") == f"Bearer {repo.gated_token}"

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        parts = urlsplit(h.path)
        path = unquote(parts.path)
        with self._lock:
            self.log.append((h.command, path, h.headers.get("Range") or ""))
        m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
        if m:
            return self._info(h, m.group(1), m.group(2) or "main", "blobs=true" in (parts.query or ""), head)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._file(h, m.group(1), m.group(2), m.group(3), head)
        self._error(h, 404, "EntryNotFound", f"no route {path}", head)

    def _repo(self, h: BaseHTTPRequestHandler, name: str, revision: str, head: bool) -> Repo | None:
        repo = self.repos.get(name)
        if repo is None:
            self._error(h, 404, "RepoNotFound", f"Repository {name} not found", head)
            return None
        if not self._allowed(h, repo):
            self._error(h, 401, "GatedRepo", f"Access to model {name} is restricted. You must have access "
                        "to it and be authenticated to access it.", head)
            return None
        if revision not in ("main", repo.commit):
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
            return None
        return repo

    def _info(self, h: BaseHTTPRequestHandler, name: str, revision: str, blobs: bool, head: bool) -> None:
        repo = self._repo(h, name, revision, head)
        if repo is None:
            return
        siblings = []
        for rel, local in repo.files.items():
            s: dict[str, object] = {"rfilename": rel}
            if blobs:
                size = local.stat().st_size
                s.update(size=size, blobId=sha256(local)[:40],
                         lfs={"sha256": sha256(local), "size": size, "pointerSize": 134})
            siblings.append(s)
        body = json.dumps({"id": name, "modelId": name, "sha": repo.commit, "private": False,
                           "gated": "auto" if repo.gated_token else False, "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _file(self, h: BaseHTTPRequestHandler, name: str, revision: str, rel: str, head: bool) -> None:
        repo = self._repo(h, name, revision, head)
        if repo is None:
            return
        local = repo.files.get(rel)
        if local is None:
            self._error(h, 404, "EntryNotFound", f"{rel} does not exist in {name}", head)
            return
        size = local.stat().st_size
        digest = sha256(local)
        start = 0
        rng = h.headers.get("Range")
        if rng and (m := re.match(r"bytes=(\d+)-$", rng)):
            start = int(m.group(1))
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", repo.commit)
        h.send_header("X-Linked-Etag", f'"{digest}"')
        h.send_header("ETag", f'"{digest}"')
        h.send_header("X-Linked-Size", str(size))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(size - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        h.end_headers()
        if head:
            return
        with self._lock:
            cut = self.cut.get(rel, 0) > 0 and not start
            if cut:
                self.cut[rel] -= 1
            corrupt = self.corrupt.get(rel, 0) > 0
            if corrupt:
                self.corrupt[rel] -= 1
        sent = start
        t0 = time.monotonic()
        with local.open("rb") as f:
            f.seek(start)
            while sent < size:
                chunk = f.read(min(1 << 20, size - sent))
                if corrupt and sent <= size // 2 < sent + len(chunk):
                    i = size // 2 - sent
                    chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1:]
                if cut and sent + len(chunk) > self.cut_at:
                    chunk = chunk[: self.cut_at - sent]
                    h.wfile.write(chunk)
                    h.wfile.flush()
                    h.close_connection = True
                    h.connection.shutdown(2)
                    return
                try:
                    h.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return
                sent += len(chunk)
                if self.pace_bps:
                    ahead = (sent - start) / self.pace_bps - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
