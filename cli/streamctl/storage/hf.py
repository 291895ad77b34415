"""The Hugging Face Hub as a read-only store: `hf://[models/|datasets/]ORG/NAME[@REV][/PATH]`.

Keys are file paths inside the repo. The revision (branch, tag or commit) is resolved to a commit sha once, on
first use, and every later call reads that commit, so a branch that moves during a transfer cannot mix files
of two commits. Listings come from the tree API (with the sha256 the hub publishes for LFS files); bytes come
from ranged GETs on the `resolve` URL through huggingface_hub's own HTTP session and headers, so the token,
user agent, HF_ENDPOINT and CDN redirects behave as in the real client (the Authorization header is dropped
when the hub redirects to another origin).

This module is imported only when an hf:// URL is opened, so huggingface_hub loads only then.
"""

from __future__ import annotations

import builtins
import json
import socket
import threading
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    DisabledRepoError,
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

try:  # huggingface_hub 2.x speaks httpx2; 1.x spoke httpx (same API)
    import httpcore2 as httpcore
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the installed huggingface_hub
    import httpcore  # type: ignore[no-redef]
    import httpx  # type: ignore[no-redef]

from streamctl import __version__
from streamctl.common.sizes import MiB
from streamctl.errors import AccessDeniedError, Interrupted, NotFoundError, RemoteError, StreamctlError, UsageError
from streamctl.storage import deadlines
from streamctl.storage._errors import check_range_answer
from streamctl.storage.base import (
    ObjectInfo,
    StorageOptions,
    UnfinishedUpload,
    read_through_buffer,
    unsafe_path_reason,
)
from streamctl.storage.url import ParsedURL, format_hf_url

REPO_TYPES = ("model", "dataset")
DEFAULT_REVISION = "main"
READ_ONLY = "the Hugging Face Hub is a read-only source"
# Network failures worth another try: the request (or the rest of a streamed body) is simply sent again.
_RETRYABLE = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
_RETRY_STATUS = (408, 429, 500, 502, 503, 504)
_API_TIMEOUT = 30.0  # seconds for the revision lookup; downloads use HF_HUB_DOWNLOAD_TIMEOUT per read
# Exceptions from these packages are the client's to translate; anything else is a bug here and propagates.
_CLIENT_MODULES = ("huggingface_hub", "httpx2", "httpx", "httpcore2", "httpcore", "h11", "h2")

T = TypeVar("T")


def check_key(key: str) -> str:
    """Refuse repo file names that could escape a destination folder (or that URL normalisation would rewrite)."""
    if unsafe_path_reason(key) is not None:
        raise UsageError(
            f"unsafe file name {key!r} in a Hugging Face repo",
            hint="repo file names must be relative paths without '..', '.', empty segments or backslashes",
        )
    return key


def object_info(entry: RepoFile) -> ObjectInfo:
    """A tree entry as an ObjectInfo: LFS files carry the sha256 the hub publishes, others their git blob sha1."""
    if entry.lfs is not None:
        sha256 = entry.lfs.sha256
        return ObjectInfo(entry.path, entry.lfs.size, sha256, {"sha256": sha256})
    return ObjectInfo(entry.path, entry.size, entry.blob_id, {"gitsha1": entry.blob_id})


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def web_url(repo_type: str, repo_id: str) -> str:
    """The repo's page (where a user accepts a gated model's terms); follows HF_ENDPOINT for mirrors."""
    return f"{constants.ENDPOINT}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"


@dataclass
class _Buffer:
    """Where a GET's body goes for read_range_into: pieces httpx gave copied into place, or counts of the
    bytes `_receive_into` received there itself."""

    buffer: memoryview
    filled: int = 0

    def take(self, piece: bytes | int) -> int:
        if isinstance(piece, int):
            self.filled += piece  # already in place
            return piece
        self.buffer[self.filled : self.filled + len(piece)] = piece
        self.filled += len(piece)
        return len(piece)

    def free(self, length: int) -> memoryview:
        return self.buffer[self.filled : self.filled + length]


def _body_left(response: httpx.Response, delivered: int) -> int:
    """Bytes of the body still to come, by its Content-Length (0 when it has none or a bad one)."""
    try:
        return max(0, int(response.headers.get("content-length", "")) - delivered)
    except ValueError:
        return 0


def _receive_into(sock: socket.socket, sink: _Buffer, length: int, request: httpx.Request) -> Iterator[int]:
    """`length` more body bytes from `sock` straight into the sink, a count per receive; errors as httpx's
    (its read timeout, read error, or a body cut short), so the caller retries them as it does those."""
    view = sink.free(length)
    sock.settimeout(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    while view:
        try:
            received = sock.recv_into(view)
        except TimeoutError as error:
            raise httpx.ReadTimeout(str(error) or "timed out", request=request) from error
        except OSError as error:
            raise httpx.ReadError(str(error), request=request) from error
        if not received:
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body", request=request
            )
        view = view[received:]
        yield received


@dataclass
class HfStore:
    repo_id: str
    repo_type: str = "model"
    revision: str | None = None  # as the user wrote it; None means the default branch
    token: str | None = field(default=None, repr=False)  # None: huggingface_hub finds HF_TOKEN or the login
    max_attempts: int = 5
    retry_wait: float = 1.0  # first back-off between attempts, doubled each time (tests lower it)
    scheme: str = "hf"
    namespace: str = ""  # a repo id holds no buckets; read-only, it overlaps nothing
    min_part_size: int = 1  # never written to; present for the Store protocol
    max_part_size: int = 1
    max_parts: int = 1
    _api: HfApi = field(init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _commit: str | None = field(default=None, init=False)
    # Listings by folder ('' = whole repo): folder -> {key: info} for every file under it.
    _listings: dict[str, dict[str, ObjectInfo]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.repo_type not in REPO_TYPES:
            raise UsageError(f"unsupported repo type {self.repo_type!r}", hint="use 'model' or 'dataset'")
        self._api = HfApi(token=self.token, library_name="streamctl", library_version=__version__)

    @property
    def bucket(self) -> str:
        return self.repo_id

    def url(self, key: str) -> str:
        return format_hf_url(self.repo_type, self.repo_id, self.revision, key)

    # -- revision ----------------------------------------------------------------------------------------------

    @property
    def commit(self) -> str:
        """The commit sha the revision resolved to on first use; every read is pinned to it."""
        if self._commit is None:
            with self._lock:
                if self._commit is None:
                    revision = self.revision or DEFAULT_REVISION
                    info = self._call(
                        lambda: self._api.repo_info(
                            self.repo_id,
                            repo_type=self.repo_type,
                            revision=revision,
                            token=self.token,
                            timeout=_API_TIMEOUT,
                        ),
                        self.url(""),
                        retry=True,
                    )
                    if not info.sha:
                        raise RemoteError(f"the Hub returned no commit for {self.url('')}")
                    self._commit = info.sha
        return self._commit

    # -- listing -----------------------------------------------------------------------------------------------

    def _listing(self, folder: str) -> dict[str, ObjectInfo]:
        """Every file under `folder`, from the cache when a listed folder covers it."""
        with self._lock:
            for listed, entries in self._listings.items():
                if not listed or folder == listed or folder.startswith(listed + "/"):
                    return {k: v for k, v in entries.items() if not folder or k.startswith(folder + "/")}
        commit = self.commit

        def fetch() -> dict[str, ObjectInfo]:
            tree = self._api.list_repo_tree(
                self.repo_id,
                path_in_repo=folder or None,
                recursive=True,
                revision=commit,
                repo_type=self.repo_type,
                token=self.token,
            )
            return {entry.path: object_info(entry) for entry in tree if isinstance(entry, RepoFile)}

        try:
            entries = self._call(fetch, self.url(folder))
        except NotFoundError:
            if not folder:
                raise
            entries = {}  # no such folder: an empty listing, like a missing prefix in a bucket
        for key in entries:
            check_key(key)
        with self._lock:
            self._listings[folder] = entries
        return entries

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        folder = prefix.rpartition("/")[0]
        entries = self._listing(folder)
        for key in sorted(entries):
            if key.startswith(prefix):
                yield entries[key]

    def _cached(self, key: str) -> tuple[bool, ObjectInfo | None]:
        """(covered, info): whether a cached listing covers `key`, and its entry there."""
        with self._lock:
            for listed, entries in self._listings.items():
                if not listed or key.startswith(listed + "/"):
                    return True, entries.get(key)
        return False, None

    def stat(self, key: str) -> ObjectInfo:
        check_key(key)
        covered, info = self._cached(key)
        if not covered:
            commit = self.commit
            found = self._call(
                lambda: self._api.get_paths_info(
                    self.repo_id, [key], revision=commit, repo_type=self.repo_type, token=self.token
                ),
                self.url(key),
                retry=True,
            )
            info = next((object_info(e) for e in found if isinstance(e, RepoFile) and e.path == key), None)
        if info is None:
            raise NotFoundError(f"{self.url(key)}: no such file at commit {self.commit[:12]}")
        return info

    # -- reading -----------------------------------------------------------------------------------------------

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:  # before a buffer of `length` is made
            raise UsageError(f"invalid range {start}+{length}")
        return read_through_buffer(lambda view: self.read_range_into(key, start, view), length)

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        # Most of the body is received straight into `buffer` (deadlines.body_socket), the rest copied in
        # once as httpx gave it: httpx's per-piece path (h11, httpcore, 64 KiB at a time) cost 1.4 CPU s/GB,
        # the direct one 0.3, measured on 16 MiB parts from the fake hub.
        sink = _Buffer(buffer)
        for _ in self._ranged(key, start, len(buffer), None, sink):
            pass
        return sink.filled

    def iter_range(self, key: str, start: int, length: int, chunk_size: int = MiB) -> Iterator[bytes]:
        """Bytes [start, start+length) of `key` as one streamed GET, `chunk_size` at a time (fewer when the
        file ends first). A connection lost mid-body is resumed from the last byte received, up to
        `max_attempts` times, so callers can hash what they receive without seeing a duplicate byte."""
        if chunk_size <= 0:
            raise UsageError(f"invalid chunk size {chunk_size}")
        return self._ranged(key, start, length, chunk_size, None)

    def _ranged(
        self, key: str, start: int, length: int, chunk_size: int | None, sink: _Buffer | None
    ) -> Iterator[bytes]:
        """iter_range's loop. With a `sink`, every byte of a GET's body goes to it INSIDE that GET's deadline,
        and nothing is yielded: the whole body is timed, and a piece costs no scope entry. Without, chunks are
        yielded and the caller's work between them runs outside the deadline."""
        check_key(key)
        if start < 0 or length < 0:
            raise UsageError(f"invalid range {start}+{length}")
        _, info = self._cached(key)
        if info is not None:  # the size is known: never ask for bytes past the end (a 416)
            length = max(0, min(length, info.size - start))
        end, position, failures = start + length, start, 0
        while position < end:
            # One deadline per GET (redirects included), for its headers and whole body; our caller's work
            # between chunks runs outside the scope.
            scope = deadlines.Scope(deadlines.policy().budget(end - position))
            chunks = self._stream(key, position, end - position, chunk_size, sink)
            try:
                while True:
                    with deadlines.entered(scope):
                        chunk = next(chunks, None)
                        while sink is not None and chunk is not None:
                            position += sink.take(chunk)
                            chunk = next(chunks, None)
                    if chunk is None:
                        return  # the range is complete, or the file ended first
                    assert isinstance(chunk, bytes)  # no sink: the stream yields bytes only
                    position += len(chunk)
                    yield chunk
            except (*_RETRYABLE, deadlines.RequestCut) as error:
                failures += 1
                if isinstance(error, deadlines.RequestCut):
                    if failures >= self.max_attempts or error.cancelled:
                        raise deadlines.final_error(error, self.url(key), self.max_attempts) from None
                elif failures >= self.max_attempts:
                    raise self._map(error, self.url(key)) from None
            finally:
                chunks.close()
                deadlines.leave(scope)
            if deadlines.pause(self.retry_wait * 2 ** (failures - 1)):
                raise Interrupted(f"{self.url(key)}: stopped while waiting to retry")

    def _stream(
        self, key: str, start: int, length: int, chunk_size: int | None, sink: _Buffer | None = None
    ) -> Generator[bytes | int, None, None]:
        """One ranged GET; status retries (5xx, 429) inside huggingface_hub's back-off, network errors raised.
        Yields the body's bytes; with a sink that takes them directly, the rest of the body once httpx's
        first piece is out goes straight into the sink, and a count of those bytes is yielded instead."""
        url = hf_hub_url(self.repo_id, key, repo_type=self.repo_type, revision=self.commit)
        headers = build_hf_headers(token=self.token, library_name="streamctl", library_version=__version__)
        headers["Range"] = f"bytes={start}-{start + length - 1}"
        headers["Accept-Encoding"] = "identity"  # byte ranges of the stored bytes, never of a compressed body
        try:
            with http_stream_backoff(
                "GET",
                url,
                headers=headers,
                timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                max_retries=max(0, self.max_attempts - 1),
                base_wait_time=self.retry_wait,
                retry_on_exceptions=(),  # network errors: iter_range retries, resuming where it stopped
                retry_on_status_codes=_RETRY_STATUS,
            ) as response:
                if response.status_code == 416:
                    return  # start is at or past the end of the file
                hf_raise_for_status(response)
                # A CDN that ignores Range answers 200 with the whole file: read from byte 0 near the start
                # (up to the range's end, the connection then closed), refused before the body further in.
                content_range = response.headers.get("Content-Range", "") if response.status_code == 206 else None
                skip = check_range_answer(self.url(key), response.url.netloc.decode(), start, content_range)
                remaining, delivered = length, 0
                for chunk in response.iter_bytes(chunk_size):
                    delivered += len(chunk)
                    if skip:
                        dropped = min(skip, len(chunk))
                        chunk, skip = chunk[dropped:], skip - dropped
                    chunk = chunk[:remaining]
                    if chunk:
                        remaining -= len(chunk)
                        yield chunk
                    if not remaining:
                        return
                    if sink is not None and not skip and (left := _body_left(response, delivered)):
                        sock = deadlines.body_socket(response, delivered)
                        if sock is not None:
                            yield from _receive_into(sock, sink, min(remaining, left), response.request)
                            return
        except _RETRYABLE:
            raise
        except Exception as error:
            if not is_client_error(error):
                raise
            raise self._map(error, self.url(key)) from None

    # -- writing: refused --------------------------------------------------------------------------------------

    def put(
        self, key: str, data: bytes, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> NoReturn:
        raise UsageError(READ_ONLY, hint="use an hf:// URL only as the source of a transfer")

    def start_multipart(
        self,
        key: str,
        part_size: int,
        metadata: Mapping[str, str] | None = None,
        content_type: str | None = None,
        resume: str | None = None,
    ) -> NoReturn:
        raise UsageError(READ_ONLY, hint="use an hf:// URL only as the source of a transfer")

    def delete(self, key: str) -> NoReturn:
        raise UsageError(READ_ONLY, hint="use an hf:// URL only as the source of a transfer")

    def unfinished_uploads(self, prefix: str) -> builtins.list[UnfinishedUpload]:
        return []  # nothing is ever uploaded here

    # -- errors ------------------------------------------------------------------------------------------------

    def _call(self, function: Callable[[], T], what: str, retry: bool = False) -> T:
        """Run one API call; with `retry`, network errors and 429/5xx are tried `max_attempts` times (the
        revision and paths-info calls have no back-off of their own; list_repo_tree does)."""
        failures = 0
        while True:
            try:
                return deadlines.call(function, url=what, attempts=self.max_attempts)
            except Exception as error:
                if not is_client_error(error):
                    raise
                failures += 1
                if not (retry and failures < self.max_attempts and _transient(error)):
                    raise self._map(error, what) from None
            if deadlines.pause(self.retry_wait * 2 ** (failures - 1)):  # or the wait a 429 asked for
                raise Interrupted(f"{what}: stopped while waiting to retry")

    def _map(self, error: Exception, what: str) -> StreamctlError:
        mapped = map_error(error, what, self.repo_type, self.repo_id, self.revision or DEFAULT_REVISION)
        # The token must never reach a message, whatever a server or library echoed back.
        hint = redact(mapped.hint, self.token) if mapped.hint else None
        return type(mapped)(redact(mapped.message, self.token), hint=hint)


def is_client_error(error: BaseException) -> bool:
    """Raised by huggingface_hub or its HTTP stack, or a malformed answer (not JSON, a missing field)."""
    if isinstance(error, StreamctlError):
        return False
    if isinstance(error, (OSError, json.JSONDecodeError, KeyError)):  # HfHubHTTPError is an OSError too
        return True
    return any(cls.__module__.split(".")[0] in _CLIENT_MODULES for cls in type(error).__mro__)


def _transient(error: Exception) -> bool:
    if isinstance(error, _RETRYABLE):
        return True
    response = error.response if isinstance(error, HfHubHTTPError) else None
    return response is not None and response.status_code in _RETRY_STATUS


def map_error(error: Exception, what: str, repo_type: str, repo_id: str, revision: str) -> StreamctlError:
    """Every huggingface_hub / httpx exception -> the streamctl error tree (messages written here, not copied)."""
    kind = "dataset" if repo_type == "dataset" else "model"
    login_hint = "set HF_TOKEN to a valid token, run `hf auth login`, or pass --token"
    if isinstance(error, GatedRepoError):  # before RepositoryNotFoundError: it is a subclass
        status = error.response.status_code if error.response is not None else 0
        problem = "reading its files needs a token with access" if status == 401 else "this token has no access"
        return AccessDeniedError(
            f"{what}: {kind} {repo_id} is gated: {problem}",
            hint=f"accept the {kind}'s terms at {web_url(repo_type, repo_id)} and pass --token or set HF_TOKEN",
        )
    if isinstance(error, RepositoryNotFoundError):
        return NotFoundError(
            f"{what}: {kind} repo {repo_id} not found (or private)",
            hint="check the repo id (hf://datasets/ORG/NAME for a dataset), or pass --token for a private repo",
        )
    if isinstance(error, RevisionNotFoundError):
        return NotFoundError(
            f"{what}: revision {revision!r} not found in {repo_id}", hint="check the branch, tag or commit sha"
        )
    if isinstance(error, EntryNotFoundError):
        return NotFoundError(f"{what}: no such file in {repo_id}")
    if isinstance(error, DisabledRepoError):
        return AccessDeniedError(f"{what}: {kind} {repo_id} is disabled on the Hub")
    if isinstance(error, HFValidationError):
        return UsageError(f"invalid repo id {repo_id!r}", hint="write it as ORG/NAME")
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else 0
        if status == 401:
            return AccessDeniedError(f"{what}: the Hub rejected the token (HTTP 401)", hint=login_hint)
        if status == 403:
            return AccessDeniedError(
                f"{what}: this token may not read {repo_id} (HTTP 403)",
                hint="use a token with read access to the repo (fine-grained tokens need it granted)",
            )
        if status == 404:
            return NotFoundError(f"{what}: not found (HTTP 404)")
        if status == 429:
            return RemoteError(
                f"{what}: rate limited by the Hub (HTTP 429)",
                hint="retry later; authenticated requests (HF_TOKEN) get higher limits",
            )
        return RemoteError(f"{what}: the Hub answered HTTP {status}", hint="retry later")
    if isinstance(error, OfflineModeIsEnabled):
        return RemoteError(f"{what}: offline mode is enabled", hint="unset HF_HUB_OFFLINE")
    if isinstance(error, httpx.TimeoutException):
        return RemoteError(f"{what}: timed out talking to the Hub", hint="check the network, or retry")
    if isinstance(error, httpx.HTTPError):  # connection refused or reset, protocol errors, too many redirects
        return RemoteError(
            f"{what}: network error ({type(error).__name__}: {error})", hint="check the network and HF_ENDPOINT"
        )
    if isinstance(error, (json.JSONDecodeError, KeyError)):
        return RemoteError(
            f"{what}: unexpected answer from the Hub ({type(error).__name__}: {error})",
            hint="check HF_ENDPOINT: is a proxy answering instead of the Hub?",
        )
    return RemoteError(f"{what}: {type(error).__name__}: {error}")


_install_lock = threading.Lock()


def _install_deadlines() -> None:
    """huggingface_hub's client with every transport wrapped by the per-request deadline (its timeouts are
    per read, and its default client has none at all)."""
    from huggingface_hub.utils import _http

    make_client = _http.default_client_factory

    def client_factory() -> httpx.Client:
        client = make_client()
        client._transport = deadlines.httpx_transport(httpx, httpcore, client._transport)
        client._mounts = {
            pattern: None if transport is None else deadlines.httpx_transport(httpx, httpcore, transport)
            for pattern, transport in client._mounts.items()
        }
        return client

    with _install_lock:
        if not getattr(_http, "_streamctl_deadlines", False):
            _http.set_client_factory(client_factory)
            deadlines.route_sleeps(_http)  # http_backoff's waits (a Retry-After of days) become capped pauses
            _http._streamctl_deadlines = True  # type: ignore[attr-defined]


def open_store(parsed: ParsedURL, options: StorageOptions) -> HfStore:
    """Options override the URL: --revision / --repo-type / --token beat @REV and datasets/."""
    _install_deadlines()
    repo_type = options.hf_repo_type or parsed.repo_type or "model"
    revision = options.hf_revision or parsed.revision
    return HfStore(
        repo_id=parsed.bucket,
        repo_type=repo_type,
        revision=revision,
        token=options.hf_token or None,
        max_attempts=max(1, options.max_attempts),
    )
