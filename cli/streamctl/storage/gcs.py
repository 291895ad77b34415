"""Google Cloud Storage through google-cloud-storage (JSON API).

Credentials are Application Default Credentials. With STORAGE_EMULATOR_HOST set (tests, local emulators) the
client talks to the emulator with anonymous credentials and a project from GOOGLE_CLOUD_PROJECT.

Multipart uploads: the SDK's parallel upload path (XML multipart, `transfer_manager.upload_chunks_concurrently`)
is not served by the emulator, so parts are uploaded as temporary objects under
`DIR/.streamctl-tmp/{upload_id}/NAME/` (the one temporary form of storage/base.py; never under the final
name) and joined with `compose`. Each part object is one media upload sent straight from the caller's
buffer and checked by CRC32C against what the service stored (`_upload_part_object`). Compose takes at
most 32 sources per call, so larger uploads are composed as a tree, each level in parallel, into temporary
intermediates; only the last compose writes the final key, with its metadata, so nothing is visible under the
key until `complete()` returns. Temporary objects are then deleted; `list()` hides exactly that shape so an
upload in flight (or one left behind by a crash) never shows up as data, and no other name is hidden.
"""

from __future__ import annotations

import base64
import builtins
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, TypeVar
from urllib.parse import quote, urlsplit

import google.api_core.exceptions as gexc
import google.auth
import google.auth.exceptions as gauth
import google_crc32c
import requests
from google.api_core.retry import Retry
from google.auth.credentials import AnonymousCredentials
from google.auth.transport.requests import AuthorizedSession
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from streamctl.common.sizes import KiB, TiB
from streamctl.errors import PreconditionFailed, RemoteError, StreamctlError, UsageError
from streamctl.storage import _errors, deadlines
from streamctl.storage._errors import Failure, Kind, Op, ServiceHints, kind_for_status, lower_keys, one_line
from streamctl.storage.base import (
    HeldPart,
    ObjectInfo,
    StorageOptions,
    UnfinishedUpload,
    content_type_for,
    copy_into,
    new_temporary_token,
    parse_temporary_key,
    read_through_buffer,
    receive_body_into,
    temporary_key,
)
from streamctl.storage.url import ParsedURL

HINTS = ServiceHints(
    service="GCS",
    container="bucket",
    credentials=(
        "run `gcloud auth application-default login`, "
        "or set GOOGLE_APPLICATION_CREDENTIALS to a service account key file"
    ),
    permissions={
        Op.LIST: "storage.objects.list (roles/storage.objectViewer)",
        Op.READ: "storage.objects.get (roles/storage.objectViewer)",
        # Overwrites and multipart uploads (temporary part objects) also delete objects.
        Op.WRITE: "storage.objects.create and storage.objects.delete (roles/storage.objectUser)",
        Op.DELETE: "storage.objects.delete (roles/storage.objectUser)",
    },
    network="check the network (and STORAGE_EMULATOR_HOST if you use an emulator)",
)

COMPOSE_LIMIT = 32  # sources per compose request
_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
_DEFAULT_EMULATOR_PROJECT = "streamctl-emulator"
_PART_CONTENT_TYPE = "application/octet-stream"  # temporary part objects; the final object gets its own
_CRC_SLICE = 256 * KiB
_SOCKET_TIMEOUT_S = 60.0  # per socket operation, as the SDK's default (the whole request has its deadline)
_RETRYABLE = (
    gexc.TooManyRequests,
    gexc.InternalServerError,
    gexc.BadGateway,
    gexc.ServiceUnavailable,
    gexc.GatewayTimeout,
    requests.exceptions.ConnectionError,
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.Timeout,
    gauth.TransportError,
    ConnectionError,
)
T = TypeVar("T")


def classify(error: BaseException) -> Failure:
    """What an exception from google-cloud-storage or google-auth means, in service-neutral terms."""
    if isinstance(error, gauth.DefaultCredentialsError):
        return Failure(Kind.NO_CREDENTIALS, one_line(error))
    if isinstance(error, gauth.RefreshError):
        return Failure(Kind.BAD_CREDENTIALS, one_line(error))
    if isinstance(error, gauth.TransportError):
        return Failure(Kind.UNAVAILABLE, one_line(error))
    if isinstance(error, gexc.RetryError):
        return Failure(Kind.UNAVAILABLE, one_line(error.cause or error))
    if isinstance(error, DataCorruption):
        return Failure(Kind.CORRUPT, one_line(error))
    if isinstance(error, gexc.GoogleAPICallError):
        status = error.code if isinstance(error.code, int) else None
        detail = one_line(f"{status} {error.message}" if status else error.message)
        if status == 404:
            if "bucket does not exist" in (error.message or "").lower():
                return Failure(Kind.NO_BUCKET, detail)
            if "no such object" in (error.message or "").lower():
                return Failure(Kind.NO_OBJECT, detail)
        return Failure(kind_for_status(status), detail)
    if isinstance(error, InvalidResponse):
        status = getattr(getattr(error, "response", None), "status_code", None)
        return Failure(kind_for_status(status), one_line(error))
    if isinstance(error, (requests.exceptions.RequestException, OSError)):
        return Failure(Kind.UNAVAILABLE, one_line(error))
    if type(error).__module__.startswith("urllib3"):
        return Failure(Kind.UNAVAILABLE, one_line(error))
    return Failure(Kind.OTHER, one_line(f"{type(error).__name__}: {error}"))


SERVICE = _errors.Service(classify, HINTS, listing_404_is_bucket=True)


def map_error(error: BaseException, *, url: str, bucket: str, op: Op) -> StreamctlError:
    """The streamctl error for an SDK exception (without the bucket probe a store adds for bare 404s)."""
    return _errors.to_error(classify(error), url=url, bucket=bucket, op=op, hints=HINTS)


def crc32c_base64(data: bytes | memoryview) -> str:
    """The CRC32C of `data` as GCS writes it (base64 of the big-endian value). google_crc32c's C functions
    take bytes only: a memoryview goes through in 256 KiB copies, which stay in cache (~0.06 s/GB)."""
    if isinstance(data, bytes):
        crc = google_crc32c.value(data)
    else:
        crc, view = 0, memoryview(data).cast("B")
        for start in range(0, len(view), _CRC_SLICE):
            crc = google_crc32c.extend(crc, bytes(view[start : start + _CRC_SLICE]))
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def is_temporary(name: str) -> bool:
    """A part or intermediate object of an upload: `DIR/.streamctl-tmp/TOKEN/NAME/PART`."""
    return parse_temporary_key(name, tail_segments=1) is not None


def _emulator_endpoint(environ: Mapping[str, str]) -> str | None:
    host = environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host:
        return None
    return host if "://" in host else f"http://{host}"  # gcloud tools accept host:port without a scheme


def _make_client(environ: Mapping[str, str] = os.environ) -> storage.Client:
    emulator = _emulator_endpoint(environ)
    project = environ.get("GOOGLE_CLOUD_PROJECT") or None
    options: dict[str, str] = {}
    if emulator:
        # ADC does not exist next to an emulator, and the emulator ignores credentials anyway.
        credentials: Any = AnonymousCredentials()
        project = project or _DEFAULT_EMULATOR_PROJECT
        options["api_endpoint"] = emulator
    else:
        credentials, adc_project = google.auth.default(scopes=_SCOPES)
        project = project or adc_project
    import google.api_core.retry.retry_unary as retry_unary

    deadlines.route_sleeps(retry_unary)  # its back-off: stoppable, and a Retry-After served capped
    session = AuthorizedSession(credentials)
    # Its token refreshes go through a session of google-auth's own (private; as google-auth mounts it):
    # timed too, as they were when the deadline patched urllib3 for the whole process.
    auth_session = getattr(session, "_auth_request_session", None)
    if isinstance(auth_session, requests.Session):
        auth_session.mount("https://", deadlines.timed_adapter(requests.adapters.HTTPAdapter)(max_retries=3))
    # Transfers run ~32 threads on one client; requests' default pool of 10 would keep reconnecting.
    # Timed pools: requests' timeouts are per socket read, the overall deadline is ours (deadlines.py).
    adapter = deadlines.timed_adapter(requests.adapters.HTTPAdapter)(pool_connections=4, pool_maxsize=64)
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return storage.Client(project=project, credentials=credentials, _http=session, client_options=options or None)


@dataclass
class GCSMultipartUpload:
    store: GCSStore
    key: str
    part_size: int
    upload_id: str
    metadata: dict[str, str]
    content_type: str
    _sizes: dict[int, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _state: str = "open"  # "open", "completing", "completed" or "aborted"
    _cleaned: bool = False  # an abort deleted every temporary object
    # Temporary objects that could not be deleted after a successful complete (best effort; hidden anyway).
    leftovers: list[str] = field(default_factory=list)
    _held: list[HeldPart] = field(default_factory=list)

    def held_parts(self) -> list[HeldPart]:
        return list(self._held)

    def _find_held_parts(self) -> None:
        """The part objects an earlier run of this upload left (a reopened upload), with GCS's MD5 of each."""
        for blob in self.store._list_raw(self.temporary_prefix, Op.WRITE):
            tail = blob.name[len(self.temporary_prefix) :]
            if len(tail) == 5 and tail.isdigit() and blob.md5_hash:
                index = int(tail)
                self._held.append(HeldPart(index, int(blob.size or 0), base64.b64decode(blob.md5_hash).hex()))
                self._sizes[index] = int(blob.size or 0)

    @property
    def temporary_prefix(self) -> str:
        return temporary_key(self.key, self.upload_id) + "/"

    def part_name(self, index: int) -> str:
        return f"{self.temporary_prefix}{index:05d}"

    def upload_part(self, index: int, data: bytes | memoryview) -> None:
        _errors.check_part(self.store.url(self.key), self._state, index, self.store.max_parts)
        self.store._upload_part_object(self.part_name(index), data, report_key=self.key)
        with self._lock:
            self._sizes[index] = len(data)
            aborted = self._state == "aborted"
        if aborted:
            # abort() ran while this part was in flight and may have missed it.
            self.store._delete_quietly([self.part_name(index)])

    def complete(self, metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        with self._lock:
            if self._state != "open":
                raise UsageError(f"upload of {self.store.url(self.key)} is already {self._state}")
            self._state = "completing"
            self.metadata = {**self.metadata, **lower_keys(metadata)}
            sizes = dict(self._sizes)
        try:
            indices = sorted(sizes)
            _errors.check_no_gaps(self.store.url(self.key), indices)
            if not indices:
                info = self.store.put(self.key, b"", self.metadata, self.content_type)
            else:
                info = self._compose_tree([self.part_name(index) for index in indices])
        except BaseException:
            with self._lock:
                self._state = "open"  # so that abort() cleans up
            raise
        with self._lock:
            self._state = "completed"
        self._cleanup()
        return info

    def _compose_tree(self, names: list[str]) -> ObjectInfo:
        level = 0
        while len(names) > COMPOSE_LIMIT:
            groups = [names[i : i + COMPOSE_LIMIT] for i in range(0, len(names), COMPOSE_LIMIT)]
            targets = [f"{self.temporary_prefix}c{level}-{j:05d}" for j in range(len(groups))]
            self.store._parallel(
                lambda pair: self.store._compose(pair[0], pair[1], None, _PART_CONTENT_TYPE, report_key=self.key),
                list(zip(groups, targets, strict=True)),
            )
            names, level = targets, level + 1
        blob = self.store._compose(names, self.key, self.metadata, self.content_type, report_key=self.key)
        return self.store._info(self.key, blob)

    def _cleanup(self) -> None:
        try:
            names = [info.name for info in self.store._list_raw(self.temporary_prefix, Op.WRITE)]
        except StreamctlError:
            names = [self.part_name(index) for index in self._sizes]
        self.leftovers = self.store._delete_quietly(names)

    def positional_writer(self) -> None:
        return None  # parts are the only way to write an object here

    def kernel_copier(self) -> None:
        return None

    def abort(self) -> None:
        with self._lock:
            if self._state == "completed" or self._cleaned:
                return
            self._state = "aborted"  # parts still in flight delete themselves when they land
        # List rather than trust our own record: a part whose response was lost may still have landed.
        names = [info.name for info in self.store._list_raw(self.temporary_prefix, Op.WRITE)]
        failed = self.store._delete_quietly(names)
        self._cleaned = not failed  # else a later abort() tries again
        if failed:
            raise RemoteError(
                f"{self.store.url(self.key)}: {len(failed)} temporary part objects could not be deleted",
                hint=f"delete {self.store.url(self.temporary_prefix)}* by hand, or run the command again",
            )


@dataclass
class GCSStore(_errors.CloudRequests):
    service: ClassVar[_errors.Service] = SERVICE
    bucket: str
    max_attempts: int = 5
    scheme: str = "gs"
    namespace: ClassVar[str] = ""  # bucket names are global
    # Compose accepts sources of any size; parts are plain objects.
    min_part_size: int = 1
    max_part_size: int = 5 * TiB  # the largest object
    # A composite object may hold at most 1024 components (Cloud Storage documentation).
    max_parts: int = 1024
    page_size: int | None = None  # objects per listing request; None: the service default (1000)
    workers: int = 16  # threads for composing a level and for deleting temporary objects
    _client_instance: storage.Client | None = field(default=None, repr=False)
    _client_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def _client(self) -> storage.Client:
        # Built on first use: ADC lookup may read files or ask a metadata server.
        if self._client_instance is None:
            with self._client_lock:
                if self._client_instance is None:
                    with self._guard(Op.READ, ""):
                        self._client_instance = _make_client()
        return self._client_instance

    @property
    def _bucket(self) -> storage.Bucket:
        return self._client.bucket(self.bucket)

    def url(self, key: str) -> str:
        return f"gs://{self.bucket}/{key}" if key else f"gs://{self.bucket}"

    def _retry(self) -> Retry | None:
        """A retry policy bounded by attempts (google's own is bounded only by time); fresh per call."""
        if self.max_attempts <= 1:
            return None
        failures = itertools.count(1)

        def predicate(error: BaseException) -> bool:
            return isinstance(error, _RETRYABLE) and next(failures) < self.max_attempts

        return Retry(predicate=predicate, initial=0.5, maximum=8.0, multiplier=2.0, timeout=600.0)

    def _attempts(self) -> int:
        return self.max_attempts

    def _bucket_exists(self) -> bool | None:
        try:
            bucket = self._bucket
            return bool(deadlines.call(lambda: bucket.exists(retry=None), url=self.url(""), attempts=1))
        except Exception:  # noqa: BLE001 - needs storage.buckets.get, which object roles lack: "cannot tell"
            return None

    def _info(self, key: str, blob: Any) -> ObjectInfo:
        return ObjectInfo(key, int(blob.size or 0), blob.etag, lower_keys(blob.metadata))

    def _list_raw(self, prefix: str, op: Op) -> Iterator[Any]:
        with self._guard(op, prefix):
            client = self._client
            yield from deadlines.iterate(
                lambda: client.list_blobs(self.bucket, prefix=prefix, page_size=self.page_size, retry=self._retry()),
                lambda blob: blob.name,
                url=self.url(prefix),
                attempts=self.max_attempts,
            )

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        for blob in self._list_raw(prefix, Op.LIST):
            if not is_temporary(blob.name):
                yield self._info(blob.name, blob)

    def stat(self, key: str) -> ObjectInfo:
        with self._guard(Op.READ, key):
            blob = self._bucket.blob(key)
            self._call(key, lambda: blob.reload(retry=self._retry()))
            return self._info(key, blob)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        # Not the SDK's download_as_bytes: its path cost 6x the CPU of read_range_into's (from the emulator).
        _errors.check_range(start, length)  # before a buffer of `length` is made
        return read_through_buffer(lambda view: self.read_range_into(key, start, view), length)

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        """The range as stored, received straight into `buffer` (base.receive_body_into) when the answer is
        the plain range; a content-encoded one (an object stored gzipped) is taken as stored, never decoded;
        a range from or past the end reads nothing."""
        length = len(buffer)
        if _errors.is_empty_range(start, length, lambda: self.stat(key)):
            return 0
        with self._guard(Op.READ, key):
            client = self._client
            base = client._connection.get_api_base_url_for_mtls()
            url = f"{base}/download/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(key, safe='')}?alt=media"
            # As the SDK's raw download asks: the stored bytes, gzipped ones not decoded in transit.
            headers = {"Range": f"bytes={start}-{start + length - 1}", "Accept-Encoding": "gzip"}

            def get() -> int:
                response = client._http.request("GET", url, headers=headers, stream=True, timeout=_SOCKET_TIMEOUT_S)
                try:
                    if response.status_code == 416:
                        return 0  # the range starts at or after the end of the object
                    if response.status_code >= 400:
                        raise gexc.from_http_response(response)
                    # An emulator or proxy may ignore Range: never read a whole object per part.
                    content_range = response.headers.get("Content-Range", "") if response.status_code == 206 else None
                    skip = _errors.check_range_answer(self.url(key), urlsplit(url).netloc, start, content_range)
                    if response.status_code == 206:
                        received = receive_body_into(response.raw, buffer)
                        if received is not None:
                            return received
                    # The body inside the deadline too; of a whole object, only up to the range's end.
                    return copy_into(buffer, response.raw.read(skip + length, decode_content=False)[skip:])
                finally:
                    response.close()

            retry = self._retry()
            return self._call(key, retry(get) if retry is not None else get, length)

    def _upload(
        self, name: str, data: bytes, metadata: Mapping[str, str] | None, content_type: str, *, report_key: str
    ) -> Any:
        with self._guard(Op.WRITE, report_key):
            blob = self._bucket.blob(name)
            if metadata:
                blob.metadata = dict(metadata)
            self._call(
                report_key,
                lambda: blob.upload_from_string(data, content_type=content_type, retry=self._retry()),
                len(data),
            )
            return blob

    def _upload_part_object(self, name: str, data: bytes | memoryview, *, report_key: str) -> None:
        """One part object in ONE media-upload request, sent straight from `data`. The SDK's upload_from_string
        takes bytes only, copies them into a BytesIO and then again into a multipart body, or (above 8 MiB)
        spends a second request opening a resumable session. Integrity is the SDK's own: the CRC32C of the
        bytes sent is checked against the one the service computed, and a mismatch (DataCorruption) fails."""
        expected = crc32c_base64(data)
        with self._guard(Op.WRITE, report_key):
            client = self._client
            base = client._connection.get_api_base_url_for_mtls()
            url = f"{base}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o?uploadType=media&name={quote(name, safe='')}"

            def send() -> Any:
                response = client._http.request(
                    "POST", url, data=data, headers={"Content-Type": _PART_CONTENT_TYPE}, timeout=_SOCKET_TIMEOUT_S
                )
                if response.status_code >= 400:
                    raise gexc.from_http_response(response)
                if response.json().get("crc32c") != expected:
                    raise DataCorruption(response, f"{name}: the service's CRC32C differs from the bytes sent")
                return response

            retry = self._retry()
            self._call(report_key, retry(send) if retry is not None else send, len(data))

    def _compose(
        self,
        sources: builtins.list[str],
        target: str,
        metadata: Mapping[str, str] | None,
        content_type: str,
        *,
        report_key: str,
    ) -> Any:
        with self._guard(Op.WRITE, report_key):
            bucket = self._bucket
            blob = bucket.blob(target)
            blob.content_type = content_type
            if metadata:
                blob.metadata = dict(metadata)
            # Retrying is safe: composing the same sources into the same name again gives the same bytes.
            self._call(report_key, lambda: blob.compose([bucket.blob(name) for name in sources], retry=self._retry()))
            return blob

    def _parallel(self, function: Callable[[T], object], items: builtins.list[T]) -> None:
        with ThreadPoolExecutor(max_workers=min(self.workers, max(1, len(items)))) as pool:
            for future in [pool.submit(function, item) for item in items]:
                future.result()  # re-raises the first failure (already a StreamctlError)

    def _delete_quietly(self, names: builtins.list[str]) -> builtins.list[str]:
        """Delete `names` in parallel; return those that could not be deleted."""
        failed: list[str] = []

        def delete(name: str) -> None:
            try:
                self.delete(name)
            except StreamctlError:
                failed.append(name)

        if names:
            self._parallel(delete, names)
        return failed

    def put(
        self, key: str, data: bytes, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> ObjectInfo:
        blob = self._upload(key, data, lower_keys(metadata), content_type or content_type_for(key), report_key=key)
        return self._info(key, blob)

    def start_multipart(
        self,
        key: str,
        part_size: int,
        metadata: Mapping[str, str] | None = None,
        content_type: str | None = None,
        resume: str | None = None,
    ) -> GCSMultipartUpload:
        # Nothing to create on the server: parts are independent objects until complete() composes them.
        # Under a `resume` token, the part objects an earlier run left under that token are the upload's.
        token = resume or new_temporary_token()
        upload = GCSMultipartUpload(
            self, key, part_size, token, lower_keys(metadata), content_type or content_type_for(key)
        )
        if resume is not None:
            upload._find_held_parts()
        return upload

    def delete(self, key: str) -> None:
        with self._guard(Op.DELETE, key):
            try:
                blob = self._bucket.blob(key)
                self._call(key, lambda: blob.delete(retry=self._retry()))
            except gexc.NotFound:
                return  # nothing to delete (object or bucket)

    def unfinished_uploads(self, prefix: str) -> builtins.list[UnfinishedUpload]:
        """Part objects of uploads that were never composed (billed like any object until deleted)."""
        stored: dict[tuple[str, str], int] = {}
        started: dict[tuple[str, str], datetime] = {}
        base_dir, separator, _ = prefix.rpartition("/")  # the part objects sit beside the name, not under it
        for blob in self._list_raw(base_dir + separator, Op.LIST):
            temporary = parse_temporary_key(blob.name, tail_segments=1)
            if temporary is not None and temporary.final_key.startswith(prefix):
                upload = (temporary.final_key, temporary.token)
                stored[upload] = stored.get(upload, 0) + int(blob.size or 0)
                if blob.time_created is not None:
                    first = started.get(upload)
                    started[upload] = min(first, blob.time_created) if first else blob.time_created
        return [
            UnfinishedUpload(
                key,
                size,
                GCSMultipartUpload(self, key, 0, upload_id, {}, _PART_CONTENT_TYPE).abort,
                started.get((key, upload_id)),
                upload_id,
            )
            for (key, upload_id), size in sorted(stored.items())
        ]

    @contextmanager
    def _conditional(self, key: str, op: Op) -> Iterator[None]:
        """412 (generation differs) and a 404 of the object an ifGenerationMatch named: not as asked."""
        try:
            with self._guard(op, key):
                yield
        except StreamctlError as error:
            cause = error.__cause__
            if isinstance(cause, gexc.PreconditionFailed) or (
                isinstance(cause, gexc.NotFound) and classify(cause).kind is not Kind.NO_BUCKET
            ):
                raise PreconditionFailed(f"{self.url(key)}: {one_line(cause)}") from None
            raise

    def _conditional_upload(self, key: str, data: bytes, metadata: Mapping[str, str] | None, generation: int) -> str:
        with self._conditional(key, Op.WRITE):
            blob = self._bucket.blob(key)
            if metadata:
                blob.metadata = lower_keys(metadata)
            self._call(key, lambda: blob.upload_from_string(
                data, content_type=content_type_for(key), if_generation_match=generation, retry=self._retry()
            ), len(data))  # fmt: skip
            return str(blob.generation)

    def create_if_absent(self, key: str, data: bytes, metadata: Mapping[str, str] | None = None) -> str:
        return self._conditional_upload(key, data, metadata, 0)  # generation 0: "no live object"

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        # The generation first, then the bytes of exactly that generation (a 412 if it was replaced between).
        for _ in range(5):
            read = self._read_one_generation(key)
            if read is not None:
                return read
        raise RemoteError(f"{self.url(key)}: replaced five times while being read", hint="run the command again")

    def _read_one_generation(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and generation; None when it was replaced between the two requests."""
        with self._guard(Op.READ, key):
            blob = self._bucket.blob(key)
            self._call(key, lambda: blob.reload(retry=self._retry()))
            generation = blob.generation  # before the download, which resets it from its own headers
            try:
                data = self._call(key, lambda: blob.download_as_bytes(
                    if_generation_match=generation, raw_download=True, retry=self._retry()
                ))  # fmt: skip
            except gexc.PreconditionFailed:
                return None
            return data, str(generation)

    def replace_if_version(self, key: str, data: bytes, version: str, metadata: Mapping[str, str] | None = None) -> str:
        return self._conditional_upload(key, data, metadata, int(version))

    def delete_if_version(self, key: str, version: str) -> None:
        with self._conditional(key, Op.DELETE):
            blob = self._bucket.blob(key)
            self._call(key, lambda: blob.delete(if_generation_match=int(version), retry=self._retry()))


def open_store(parsed: ParsedURL, options: StorageOptions) -> GCSStore:
    return GCSStore(parsed.bucket, max_attempts=max(1, options.max_attempts))
