"""A stand-in Hugging Face Hub on 127.0.0.1: the routes and headers `huggingface_hub` itself uses
(read from its source: hf_api.model_info / list_repo_tree, file_download.get_hf_file_metadata /
http_get, hf_api.parse_safetensors_file_metadata), over real HTTP.

    GET  /api/models/{repo}[/revision/{rev}]      model info: sha, siblings (with sizes)
    GET  /api/models/{repo}/tree/{rev}            the file listing (snapshot_download)
    HEAD /{repo}/resolve/{rev}/{file}             X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{file}             200, or 206 for `Range: bytes=a-b` / `bytes=a-`

Errors as the hub sends them: 404 + X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound,
401 + X-Error-Code GatedRepo. Every request is logged as (method, path, Range header). A file can
be declared larger than what is stored (`Lazy`: a real safetensors header for tens of GB of
tensors): a read ending more than 1 MiB past the stored prefix is logged as a body read and refused. `cut_once` names
files whose first whole-file GET stops after N bytes (Content-Length promised, connection closed);
`stall_once` names files whose first whole-file GET sends N bytes, sets `stalled` and then holds
the connection open until `release` is set (a transfer in progress, for a test to kill its client).
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Lazy:
    """A file of `size` bytes of which only `prefix` (its safetensors header) is stored."""
    prefix: bytes
    size: int


@dataclass
class Repo:
    files: dict[str, bytes | Lazy]
    sha: str = ""
    gated: bool = False
    branches: tuple[str, ...] = ("main",)

    def __post_init__(self):
        if not self.sha:
            h = hashlib.sha1()
            for name in sorted(self.files):
                h.update(name.encode() + _etag(self.files[name]).encode())
            self.sha = h.hexdigest()


def _size(data: bytes | Lazy) -> int:
    return data.size if isinstance(data, Lazy) else len(data)


def _etag(data: bytes | Lazy) -> str:
    body = data.prefix + str(data.size).encode() if isinstance(data, Lazy) else data
    return hashlib.sha256(body).hexdigest()


def repo_from_dir(path: Path, skip: tuple[str, ...] = ()) -> Repo:
    return Repo({p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.is_file() and p.name not in skip})


def lazy_safetensors(tensors: dict[str, tuple[str, list[int]]]) -> Lazy:
    """A safetensors file with these (dtype, shape) tensors, of which only the header exists."""
    per = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "U8": 1, "F8_E4M3": 1}
    header, off = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = per[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    return Lazy(prefix, len(prefix) + off)


@dataclass
class StubHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    cut_once: dict[str, int] = field(default_factory=dict)  # "repo/file": its first whole GET stops after N bytes
    log: list[tuple[str, str, str]] = field(default_factory=list)
    body_reads: list[str] = field(default_factory=list)
    stall_once: dict[str, int] = field(default_factory=dict)  # "repo/file": send N bytes, then wait for `release`
    stalled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> "StubHub":
        hub = self

        class Handler(_Handler):
            stub = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def gets(self, repo: str, file: str) -> list[str]:
        """The Range headers of the GETs of `repo`'s `file` ('' for a whole-file GET)."""
        return [r for m, p, r in self.log
                if m == "GET" and p.startswith(f"/{repo}/resolve/") and p.endswith("/" + file)]


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?/?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_PAD = 1 << 20       # a read ending this close past a Lazy file's header gets zeros (not a body read)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    stub: StubHub

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        path = urlsplit(self.path).path
        self.stub.log.append((self.command, path, self.headers.get("Range", "")))
        if m := _API.match(path):
            return self._api(unquote(m[1]), m[2], unquote(m[3] or "main"))
        if m := _RESOLVE.match(path):
            return self._file(unquote(m[1]), unquote(m[2]), unquote(m[3]), head)
        self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"})

    def _repo(self, name: str, rev: str) -> Repo | None:
        repo = self.stub.repos.get(name)
        if repo is None:
            self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        elif rev not in repo.branches and rev != repo.sha:
            self._send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
            return None
        return repo

    def _api(self, name: str, kind: str | None, rev: str) -> None:
        repo = self._repo(name, rev)
        if repo is None:
            return
        if kind == "tree":
            body = [{"type": "file", "oid": _etag(d)[:40], "size": _size(d), "path": f} for f, d in repo.files.items()]
        else:
            body = {"id": name, "modelId": name, "sha": repo.sha, "private": False,
                    "gated": "auto" if repo.gated else False,
                    "siblings": [{"rfilename": f, "size": _size(d), "blobId": _etag(d)[:40]}
                                 for f, d in repo.files.items()]}
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _file(self, name: str, rev: str, file: str, head: bool) -> None:
        repo = self._repo(name, rev)
        if repo is None:
            return
        if repo.gated:
            return self._send(401, b'{"error": "Access to this model is restricted"}', {"X-Error-Code": "GatedRepo"})
        data = repo.files.get(file)
        commit = {"X-Repo-Commit": repo.sha}
        if data is None:
            return self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound", **commit})
        size = _size(data)
        headers = {**commit, "ETag": f'"{_etag(data)}"', "Accept-Ranges": "bytes"}
        if head:
            return self._send(200, b"", {**headers, "Content-Length": str(size)}, body=False)
        start, end = 0, size - 1
        rng = _RANGE.match(self.headers.get("Range", ""))
        if rng:
            start, end = int(rng[1]), min(int(rng[2]) if rng[2] else size - 1, size - 1)
        stored = data.prefix if isinstance(data, Lazy) else data
        if end - len(stored) >= _PAD:                 # a read of bytes that only the declaration has
            self.stub.body_reads.append(f"{file} {self.headers.get('Range', 'whole file')}")
            return self._send(500, b"the stand-in hub never serves this file's body", {})
        chunk = stored[start:end + 1].ljust(end + 1 - start, b"\0")   # a header read may run a little past it
        if rng:
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        key = f"{name}/{file}"
        if not rng and (key in self.stub.cut_once or key in self.stub.stall_once):  # promise it all, send part
            stall = key in self.stub.stall_once
            cut = self.stub.stall_once.pop(key) if stall else self.stub.cut_once.pop(key)
            self.send_response(200)
            for k, v in {**headers, "Content-Length": str(size)}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(chunk[:cut])
            self.wfile.flush()
            if stall:                                 # ... and keep the transfer open until released
                self.stub.stalled.set()
                self.stub.release.wait(120)
            self.close_connection = True              # then hang up
            return
        self._send(206 if rng else 200, chunk, headers)

    def _send(self, status: int, payload: bytes, headers: dict, body: bool = True) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body and payload and self.command != "HEAD":   # a HEAD answer has no body (keep-alive)
            self.wfile.write(payload)
