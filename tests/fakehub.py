"""A fake Hugging Face Hub (and its LFS CDN) that the real `huggingface_hub` client can talk to.

Two threaded stdlib HTTP servers on 127.0.0.1: the hub (API + `resolve` downloads) and a second origin that
plays the CDN LFS files are redirected to, so tests can check that the Authorization header never leaves the
hub. Repos are built in memory (or loaded from a folder) per test; branches and tags map to commits, so a test
can move a branch after a client resolved it.

What it speaks (huggingface_hub 2.x, see docs/specs/transfer-and-test-servers.md):
- `GET  /api/{models|datasets}/{org}/{name}[/revision/{rev}]`   -> {id, sha, private, gated, siblings}
- `GET  /api/{models|datasets}/{org}/{name}/tree/{rev}[/{path}]` -> paginated tree (`Link: <...>; rel="next"`)
- `POST /api/{models|datasets}/{org}/{name}/paths-info/{rev}`    -> entries for the form's `paths`
- `HEAD|GET /[datasets/]{org}/{name}/resolve/{rev}/{path}`       -> bytes (Range, 206/416), or a 302 to the CDN
- errors carry `X-Error-Code`: RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo; a bad token gets a 401
  with `X-Error-Message: Invalid credentials in Authorization header`, as on the real hub.

TLS: `serve_cdn_over_tls(context)` redirects LFS downloads to a CDN origin speaking HTTPS (until `reset()`).

Fault knobs: `fail()` (503 / connection reset / truncated body for the next N matching requests), `corrupt()`
(serve a file with one byte flipped), and a thread-safe log of every request (line + headers) with `count()`.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs, quote, unquote, urlencode

MiB = 1024 * 1024

# The hub's default .gitattributes sends these to LFS whatever their size (plus anything >= 10 MB).
DEFAULT_LFS_SUFFIXES: tuple[str, ...] = (
    ".7z", ".arrow", ".bin", ".bz2", ".ckpt", ".ftz", ".gguf", ".gz", ".h5", ".joblib", ".lfs", ".mlmodel",
    ".model", ".msgpack", ".npy", ".npz", ".onnx", ".ot", ".parquet", ".pb", ".pickle", ".pkl", ".pt", ".pth",
    ".rar", ".safetensors", ".tar", ".tflite", ".tgz", ".wasm", ".xz", ".zip", ".zst",
)  # fmt: skip
DEFAULT_LFS_THRESHOLD = 10 * MiB
DEFAULT_PAGE_SIZE = 1000  # the real hub's page size for tree listings

FaultKind = Literal["503", "reset", "truncate", "throttle"]
Role = Literal["hub", "cdn"]


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: what the hub reports as `oid` and `ETag` for non-LFS files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class FileEntry:
    """One file of a commit, with every digest precomputed (serving must not re-hash large files)."""

    path: str
    data: bytes
    sha256: str
    lfs: bool
    oid: str  # git blob oid: of the content, or of the LFS pointer file for LFS files

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def pointer(self) -> bytes:
        return lfs_pointer(self.sha256, self.size)


def make_entry(path: str, data: bytes, lfs_suffixes: tuple[str, ...], lfs_threshold: int) -> FileEntry:
    sha256 = hashlib.sha256(data).hexdigest()
    lfs = path.lower().endswith(lfs_suffixes) or len(data) >= lfs_threshold
    oid = git_blob_sha1(lfs_pointer(sha256, len(data))) if lfs else git_blob_sha1(data)
    return FileEntry(path, data, sha256, lfs, oid)


@dataclass(frozen=True)
class RecordedRequest:
    role: Role
    method: str
    raw_path: str  # as sent, query included
    path: str  # percent-decoded, without the query
    request_line: str
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key.lower() == name.lower()), None)

    @property
    def text(self) -> str:
        """The request line and every header, as a test would search them for a leaked secret."""
        return "\n".join([self.request_line, *(f"{key}: {value}" for key, value in self.headers)])


@dataclass
class Fault:
    pattern: str  # substring of the decoded request path
    kind: FaultKind
    remaining: int
    role: Role | None = None
    methods: frozenset[str] | None = None
    status: int = 429  # "throttle": the status and headers answered
    headers: tuple[tuple[str, str], ...] = ()

    def matches(self, role: Role, method: str, path: str) -> bool:
        return (
            self.remaining > 0
            and (self.role is None or self.role == role)
            and (self.methods is None or method in self.methods)
            and self.pattern in path
        )


@dataclass
class FakeRepo:
    """A repo: commits (sha -> files) and refs (branch or tag -> sha). Change it only through its methods."""

    hub: FakeHub
    repo_id: str
    repo_type: str = "model"
    gated: bool = False
    private: bool = False
    granted: set[str] = field(default_factory=set)  # tokens that may read a gated or private repo
    lfs_suffixes: tuple[str, ...] = DEFAULT_LFS_SUFFIXES
    lfs_threshold: int = DEFAULT_LFS_THRESHOLD
    commits: dict[str, dict[str, FileEntry]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    _counter: int = 0

    def commit(
        self,
        files: Mapping[str, bytes | str] | None = None,
        *,
        branch: str = "main",
        delete: Iterable[str] = (),
        replace: bool = False,
    ) -> str:
        """Add a commit on `branch` (created if missing) that writes `files` and removes `delete`; its sha."""
        with self.hub._lock:
            parent = self.refs.get(branch)
            tree = {} if replace or parent is None else dict(self.commits[parent])
            for path in delete:
                tree.pop(path, None)
            for path, content in (files or {}).items():
                data = content.encode() if isinstance(content, str) else bytes(content)
                entry = make_entry(path, data, self.lfs_suffixes, self.lfs_threshold)
                tree[path] = entry
                if entry.lfs:
                    self.hub._blobs[entry.sha256] = data
            self._counter += 1
            digest = hashlib.sha1(f"{self.repo_id}\0{parent}\0{self._counter}".encode())
            for path in sorted(tree):
                digest.update(f"\0{path}\0{tree[path].oid}".encode())
            sha = digest.hexdigest()
            self.commits[sha] = tree
            self.refs[branch] = sha
            return sha

    def tag(self, name: str, revision: str = "main") -> str:
        """Point tag (or branch) `name` at what `revision` resolves to; the commit sha."""
        with self.hub._lock:
            sha = self.resolve(revision)
            if sha is None:
                raise KeyError(revision)
            self.refs[name] = sha
            return sha

    def grant(self, token: str) -> None:
        with self.hub._lock:
            self.granted.add(token)

    def resolve(self, revision: str) -> str | None:
        """A branch, a tag or a full commit sha -> commit sha (None when unknown)."""
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None

    def files(self, revision: str = "main") -> dict[str, FileEntry]:
        sha = self.resolve(revision)
        if sha is None:
            raise KeyError(revision)
        return self.commits[sha]

    @property
    def web_path(self) -> str:
        return self.repo_id if self.repo_type == "model" else f"datasets/{self.repo_id}"


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    truncate: bool = False  # send half the body, then reset the connection


def _json(status: int, payload: object, headers: Iterable[tuple[str, str]] = ()) -> Response:
    body = json.dumps(payload).encode()
    return Response(status, [("Content-Type", "application/json"), *headers], body)


def _error(status: int, code: str | None, message: str) -> Response:
    headers = [("X-Error-Message", message)]
    if code is not None:
        headers.append(("X-Error-Code", code))
    return _json(status, {"error": message}, headers)


def _parse_range(header: str | None, size: int) -> tuple[int, int] | Literal["unsatisfiable"] | None:
    """One `bytes=` range -> (start, end exclusive); None to serve the whole object (absent or multi-range)."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[len("bytes=") :].strip().partition("-")
    try:
        if not first:  # suffix range: the last N bytes
            count = int(last)
            return (max(0, size - count), size) if count > 0 and size > 0 else "unsatisfiable"
        start = int(first)
        end = size if not last else min(size, int(last) + 1)
    except ValueError:
        return None
    if start >= size or end <= start:
        return "unsatisfiable"
    return start, end


def serve_bytes(data: bytes, range_header: str | None, headers: list[tuple[str, str]]) -> Response:
    headers = [*headers, ("Accept-Ranges", "bytes"), ("Content-Type", "application/octet-stream")]
    span = _parse_range(range_header, len(data))
    if span == "unsatisfiable":
        return Response(416, [*headers, ("Content-Range", f"bytes */{len(data)}")])
    if span is None:
        return Response(200, headers, data)
    start, end = span
    return Response(206, [*headers, ("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")], data[start:end])


def tree_entries(files: Mapping[str, FileEntry], folder: str, recursive: bool) -> list[dict[str, object]]:
    """The hub's tree listing of `folder` ('' = root): per level, folders (each followed by its subtree) then
    files. Deliberately not in key order, so clients that need order must sort."""
    children_dirs: dict[str, set[str]] = {}
    children_files: dict[str, list[str]] = {}
    for path in files:
        parent, _, _ = path.rpartition("/")
        children_files.setdefault(parent, []).append(path)
        while parent:
            grand, _, _ = parent.rpartition("/")
            children_dirs.setdefault(grand, set()).add(parent)
            parent = grand

    def tree_oid(path: str) -> str:
        inside = sorted(f"{key}:{entry.oid}" for key, entry in files.items() if key.startswith(path + "/"))
        return hashlib.sha1("\n".join(inside).encode()).hexdigest()

    def walk(level: str) -> Iterator[dict[str, object]]:
        for directory in sorted(children_dirs.get(level, ())):
            yield {"type": "directory", "oid": tree_oid(directory), "size": 0, "path": directory}
            if recursive:
                yield from walk(directory)
        for path in sorted(children_files.get(level, ())):
            yield file_json(files[path])

    return list(walk(folder))


def file_json(entry: FileEntry) -> dict[str, object]:
    item: dict[str, object] = {"type": "file", "oid": entry.oid, "size": entry.size, "path": entry.path}
    if entry.lfs:
        item["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": len(entry.pointer)}
    return item


def _is_folder(files: Mapping[str, FileEntry], path: str) -> bool:
    return not path or any(key.startswith(path + "/") for key in files)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, hub: FakeHub, role: Role, tls: ssl.SSLContext | None = None) -> None:
        self.hub = hub
        self.role: Role = role
        super().__init__(("127.0.0.1", 0), _Handler)
        if tls is not None:  # the handshake happens in accept(), on the serving thread
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.scheme = "http" if tls is None else "https"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: object, client_address: object) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client dropping a kept-alive connection (or a stream it stopped reading) is normal
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the real hub; every response carries Content-Length
    disable_nagle_algorithm = True  # headers and body go in separate writes: avoid 40 ms delayed-ACK stalls
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_GET(self) -> None:
        self.server.hub._handle(self, "GET")

    def do_HEAD(self) -> None:
        self.server.hub._handle(self, "HEAD")

    def do_POST(self) -> None:
        self.server.hub._handle(self, "POST")

    def hard_close(self) -> None:
        """Reset the connection (RST, not FIN): what a client sees when a load balancer drops it."""
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.rfile.close()
            self.wfile.close()
            self.connection.close()  # the last reference: the kernel sends RST (SO_LINGER 0)
        except OSError:
            pass
        # http.server still flushes and closes these after the handler returns.
        self.rfile, self.wfile = io.BytesIO(), io.BytesIO()


class FakeHub:
    """The hub plus its CDN. Thread-safe; `reset()` between tests, `stop()` once at the end."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._repos: dict[tuple[str, str], FakeRepo] = {}
        self._blobs: dict[str, bytes] = {}  # sha256 -> bytes, what the CDN serves
        self._faults: list[Fault] = []
        self._corrupt: set[str] = set()  # sha256 of files served with one byte flipped
        self._requests: list[RecordedRequest] = []
        self.sent: dict[Role, int] = {"hub": 0, "cdn": 0}  # body bytes each origin handed its sockets
        self.tokens: set[str] = set()  # every token the hub accepts
        self.page_size = DEFAULT_PAGE_SIZE
        self.redirect_lfs = True  # LFS downloads: 302 to the CDN origin (as the real hub does)
        self.honor_range = True  # False: answer every ranged GET with 200 and the whole file
        self._hub = _Server(self, "hub")
        self._cdn = _Server(self, "cdn")
        self._threads: list[threading.Thread] = []
        self._tls_cdn: _Server | None = None  # started by serve_cdn_over_tls, kept until stop()
        self._redirect_to = self._cdn  # the CDN origin LFS downloads are redirected to

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """What HF_ENDPOINT must be (known as soon as the object exists: the ports are bound in __init__)."""
        return self._hub.url

    @property
    def cdn_endpoint(self) -> str:
        return self._redirect_to.url

    def serve_cdn_over_tls(self, context: ssl.SSLContext) -> str:
        """Until `reset()`, redirect LFS downloads to a second CDN origin that speaks TLS with `context` (the
        same blobs, faults and request log, role "cdn"); returns its URL."""
        with self._lock:
            if self._tls_cdn is None:
                self._tls_cdn = _Server(self, "cdn", context)
                threading.Thread(
                    target=self._tls_cdn.serve_forever, args=(0.05,), name="fakehub-cdn-tls", daemon=True
                ).start()
            self._redirect_to = self._tls_cdn
            return self._tls_cdn.url

    def start(self) -> FakeHub:
        with self._lock:
            if not self._threads:
                for server in (self._hub, self._cdn):
                    thread = threading.Thread(
                        target=server.serve_forever, args=(0.05,), name=f"fakehub-{server.role}", daemon=True
                    )
                    thread.start()
                    self._threads.append(thread)
        return self

    def stop(self) -> None:
        if self._tls_cdn is not None:
            self._tls_cdn.shutdown()
            self._tls_cdn.server_close()
            self._tls_cdn = None
        for server in (self._hub, self._cdn):
            if self._threads:
                server.shutdown()
            server.server_close()
        self._threads.clear()

    def reset(self) -> None:
        """Forget every repo, token, fault and recorded request; restore default options."""
        with self._lock:
            self._repos.clear()
            self._blobs.clear()
            self._faults.clear()
            self._corrupt.clear()
            self._requests.clear()
            self.sent = {"hub": 0, "cdn": 0}
            self.tokens.clear()
            self.page_size = DEFAULT_PAGE_SIZE
            self.redirect_lfs = True
            self.honor_range = True
            self._redirect_to = self._cdn

    # -- building repos ----------------------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | str] | None = None,
        *,
        folder: str | Path | None = None,
        repo_type: str = "model",
        gated: bool = False,
        private: bool = False,
        granted: Iterable[str] = (),
        lfs_suffixes: tuple[str, ...] = DEFAULT_LFS_SUFFIXES,
        lfs_threshold: int = DEFAULT_LFS_THRESHOLD,
    ) -> FakeRepo:
        """Create a repo whose `main` holds `files` (and/or every file under `folder`)."""
        if repo_type not in ("model", "dataset"):
            raise ValueError(f"repo_type {repo_type!r}")
        contents: dict[str, bytes | str] = {}
        if folder is not None:
            root = Path(folder)
            for path in sorted(root.rglob("*")):
                if path.is_file():
                    contents[path.relative_to(root).as_posix()] = path.read_bytes()
        contents.update(files or {})
        repo = FakeRepo(self, repo_id, repo_type, gated, private, set(granted), lfs_suffixes, lfs_threshold)
        with self._lock:
            self._repos[(repo_type, repo_id)] = repo
        repo.commit(contents)
        return repo

    def add_token(self, token: str) -> str:
        with self._lock:
            self.tokens.add(token)
        return token

    # -- faults and observation --------------------------------------------------------------------------------

    def fail(
        self,
        pattern: str,
        times: int = 1,
        kind: FaultKind = "503",
        *,
        role: Role | None = None,
        methods: Iterable[str] | None = None,
        status: int = 429,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """The next `times` requests whose decoded path contains `pattern` fail: `503` (a JSON 503), `reset`
        (connection reset before any response) or `truncate` (full Content-Length, half the body, then reset).
        CDN paths end with the repo file name, so a file name matches on both origins. `throttle`: answer
        `status` with `headers` (a rate limit's Retry-After or RateLimit) and a small JSON error body."""
        with self._lock:
            self._faults.append(
                Fault(
                    pattern,
                    kind,
                    times,
                    role,
                    frozenset(methods) if methods else None,
                    status,
                    tuple((headers or {}).items()),
                )
            )

    def corrupt(self, repo_id: str, path: str, *, repo_type: str = "model", revision: str = "main") -> None:
        """Serve `path` (at `revision`, and every other file with the same bytes) with one byte flipped."""
        with self._lock:
            self._corrupt.add(self._repos[(repo_type, repo_id)].files(revision)[path].sha256)

    def requests(self, role: Role | None = None) -> list[RecordedRequest]:
        with self._lock:
            return [request for request in self._requests if role is None or request.role == role]

    def count(self, pattern: str = "", *, role: Role | None = None, method: str | None = None) -> int:
        """How many requests so far had `pattern` in their decoded path."""
        with self._lock:
            return sum(
                1
                for request in self._requests
                if pattern in request.path
                and (role is None or request.role == role)
                and (method is None or request.method == method)
            )

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    # -- request handling --------------------------------------------------------------------------------------

    def _handle(self, handler: _Handler, method: str) -> None:
        role = handler.server.role
        raw_path = handler.path
        path = unquote(raw_path.partition("?")[0])
        record = RecordedRequest(
            role, method, raw_path, path, handler.requestline, tuple((k, v) for k, v in handler.headers.items())
        )
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        with self._lock:
            self._requests.append(record)
            fault = next((f for f in self._faults if f.matches(role, method, path)), None)
            if fault is not None:
                fault.remaining -= 1
        if fault is not None and fault.kind == "reset":
            handler.hard_close()
            return
        if fault is not None and fault.kind == "503":
            response = _error(503, None, "Service Unavailable")
        elif fault is not None and fault.kind == "throttle":
            response = _error(fault.status, None, "Too many requests")
            response.headers.extend(fault.headers)
        else:
            try:
                response = self._route_hub(handler, method, body) if role == "hub" else self._route_cdn(handler)
            except Exception as error:  # noqa: BLE001 - a bug in the fake: answer 500 rather than hang the client
                response = _error(500, None, f"fake hub error: {error!r}")
            response.truncate = fault is not None and fault.kind == "truncate"
        self._send(handler, method, response)

    def _send(self, handler: _Handler, method: str, response: Response) -> None:
        headers = {key.lower(): (key, value) for key, value in response.headers}
        handler.send_response(response.status)
        for key, value in headers.values():
            if key.lower() != "content-length":
                handler.send_header(key, value)
        # HEAD answers with the length GET would send (that is how clients learn a file's size).
        content_length = headers.get("content-length", ("", str(len(response.body))))[1]
        handler.send_header("Content-Length", content_length)
        handler.end_headers()
        if method == "HEAD" or not response.body:
            return
        if not self.honor_range:  # `sent` then counts what a client that hangs up leaves unread closely
            handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        body = memoryview(response.body)[: len(response.body) // 2 if response.truncate else None]
        try:
            for offset in range(0, len(body), 64 * 1024):
                piece = body[offset : offset + 64 * 1024]
                handler.wfile.write(piece)
                with self._lock:
                    self.sent[handler.server.role] += len(piece)
            if response.truncate:
                handler.hard_close()
        except OSError:
            handler.close_connection = True  # the client went away mid-body

    def _auth(self, handler: _Handler) -> tuple[str | None, Response | None]:
        """(token, None) for no or a known token; (None, 401) for an unknown one: the real hub rejects an
        invalid token on every endpoint, even for public repos."""
        header = handler.headers.get("Authorization")
        if header is None:
            return None, None
        token = header.removeprefix("Bearer ").strip()
        with self._lock:
            known = token in self.tokens
        if not known:
            return None, _error(401, None, "Invalid credentials in Authorization header")
        return token, None

    def _access(
        self, handler: _Handler, repo_type: str, repo_id: str, files: bool
    ) -> tuple[FakeRepo | None, Response | None]:
        """Authorization, existence, privacy, and (for file downloads only) gating, in the hub's order."""
        token, denied = self._auth(handler)
        if denied is not None:
            return None, denied
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
        if repo is None or (repo.private and token not in repo.granted):
            # Without a token the hub answers 401 for a missing (or hidden) repo, with one 404.
            return None, _error(401 if token is None else 404, "RepoNotFound", "Repository not found")
        if files and repo.gated and token not in repo.granted:
            kind = "model" if repo_type == "model" else repo_type
            if token is None:
                message = (
                    f"Access to {kind} {repo_id} is restricted. You must have access to it and be authenticated "
                    "to access it. Please log in."
                )
                return None, _error(401, "GatedRepo", message)
            message = f"Access to {kind} {repo_id} is restricted and you are not in the authorized list."
            return None, _error(403, "GatedRepo", message)
        return repo, None

    def _route_hub(self, handler: _Handler, method: str, body: bytes) -> Response:
        raw_path, _, raw_query = handler.path.partition("?")
        query = parse_qs(raw_query)
        segments = raw_path.split("/")[1:]  # split before decoding: revisions are sent with '/' as %2F
        if len(segments) >= 4 and segments[0] == "api" and segments[1] in ("models", "datasets"):
            repo_type = "model" if segments[1] == "models" else "dataset"
            repo_id = f"{unquote(segments[2])}/{unquote(segments[3])}"
            rest = segments[4:]
            if not rest and method == "GET":
                return self._info(handler, repo_type, repo_id, "main")
            if len(rest) == 2 and rest[0] == "revision" and method == "GET":
                return self._info(handler, repo_type, repo_id, unquote(rest[1]))
            if len(rest) >= 2 and rest[0] == "tree" and method == "GET":
                folder = "/".join(unquote(part) for part in rest[2:]).strip("/")
                return self._tree(handler, raw_path, query, repo_type, repo_id, unquote(rest[1]), folder)
            if len(rest) == 2 and rest[0] == "paths-info" and method == "POST":
                paths = parse_qs(body.decode()).get("paths", [])
                return self._paths_info(handler, repo_type, repo_id, unquote(rest[1]), paths)
            return _error(404, None, "Not Found")
        repo_type = "model"
        if segments and segments[0] == "datasets":
            repo_type, segments = "dataset", segments[1:]
        if len(segments) >= 5 and segments[2] == "resolve" and method in ("GET", "HEAD"):
            repo_id = f"{unquote(segments[0])}/{unquote(segments[1])}"
            filename = "/".join(unquote(part) for part in segments[4:])
            return self._resolve(handler, repo_type, repo_id, unquote(segments[3]), filename)
        return _error(404, None, "Not Found")

    def _info(self, handler: _Handler, repo_type: str, repo_id: str, revision: str) -> Response:
        repo, denied = self._access(handler, repo_type, repo_id, files=False)
        if denied is not None:
            return denied
        assert repo is not None
        with self._lock:
            sha = repo.resolve(revision)
            files = sorted(repo.commits[sha]) if sha is not None else []
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return _json(
            200,
            {
                "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "sha": sha,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "siblings": [{"rfilename": path} for path in files],
            },
        )

    def _tree(
        self,
        handler: _Handler,
        raw_path: str,
        query: dict[str, list[str]],
        repo_type: str,
        repo_id: str,
        revision: str,
        folder: str,
    ) -> Response:
        repo, denied = self._access(handler, repo_type, repo_id, files=False)
        if denied is not None:
            return denied
        assert repo is not None
        with self._lock:
            sha = repo.resolve(revision)
            files = repo.commits[sha] if sha is not None else {}
            page_size = self.page_size
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if not _is_folder(files, folder):
            return _error(404, "EntryNotFound", f'{folder} does not exist on "{revision}"')
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        entries = tree_entries(files, folder, recursive)
        cursor = int(query.get("cursor", ["0"])[0])
        page = entries[cursor : cursor + page_size]
        headers: list[tuple[str, str]] = []
        if cursor + page_size < len(entries):
            next_query = {key: values[0] for key, values in query.items()}
            next_query["cursor"] = str(cursor + page_size)
            headers.append(("Link", f'<{self.endpoint}{raw_path}?{urlencode(next_query)}>; rel="next"'))
        return _json(200, page, headers)

    def _paths_info(self, handler: _Handler, repo_type: str, repo_id: str, revision: str, paths: list[str]) -> Response:
        repo, denied = self._access(handler, repo_type, repo_id, files=False)
        if denied is not None:
            return denied
        assert repo is not None
        with self._lock:
            sha = repo.resolve(revision)
            files = repo.commits[sha] if sha is not None else {}
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        found: list[dict[str, object]] = []
        for path in paths:
            path = path.strip("/")
            if path in files:
                found.append(file_json(files[path]))
            elif path and _is_folder(files, path):
                found.append({"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "path": path})
        return _json(200, found)

    def _resolve(self, handler: _Handler, repo_type: str, repo_id: str, revision: str, filename: str) -> Response:
        repo, denied = self._access(handler, repo_type, repo_id, files=True)
        if denied is not None:
            return denied
        assert repo is not None
        with self._lock:
            sha = repo.resolve(revision)
            entry = repo.commits[sha].get(filename) if sha is not None else None
            corrupt = entry is not None and entry.sha256 in self._corrupt
            redirect = self.redirect_lfs
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if entry is None:
            return _error(404, "EntryNotFound", "Entry not found")
        headers = [("X-Repo-Commit", sha)]
        if entry.lfs:
            headers += [
                ("ETag", f'"{entry.sha256}"'),
                ("X-Linked-Etag", f'"{entry.sha256}"'),
                ("X-Linked-Size", str(entry.size)),
            ]
            if redirect:
                # A signed, expiring URL on another origin, like cdn-lfs.hf.co: no token may be sent there.
                expires = int(time.time()) + 3600
                signature = hashlib.sha1(f"{entry.sha256}{expires}".encode()).hexdigest()
                query = urlencode({"Expires": expires, "Signature": signature})
                location = f"{self.cdn_endpoint}/blobs/{entry.sha256}/{quote(filename)}?{query}"
                body = f"Found. Redirecting to {location}".encode()
                return Response(302, [*headers, ("Location", location), ("Content-Type", "text/plain")], body)
        else:
            headers.append(("ETag", f'"{entry.oid}"'))
        data = _corrupted(entry.data) if corrupt else entry.data
        return serve_bytes(data, self._range(handler), headers)

    def _range(self, handler: _Handler) -> str | None:
        return handler.headers.get("Range") if self.honor_range else None

    def _route_cdn(self, handler: _Handler) -> Response:
        segments = handler.path.partition("?")[0].split("/")[1:]
        if len(segments) >= 2 and segments[0] == "blobs":
            sha256 = segments[1]
            with self._lock:
                data = self._blobs.get(sha256)
                corrupt = sha256 in self._corrupt
            if data is not None:
                data = _corrupted(data) if corrupt else data
                return serve_bytes(data, self._range(handler), [("ETag", f'"{sha256}"')])
        return Response(404, [("Content-Type", "text/plain")], b"NoSuchKey")


def _corrupted(data: bytes) -> bytes:
    """Same length, one byte flipped in the middle: size checks pass, only a checksum can tell."""
    if not data:
        return data
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
