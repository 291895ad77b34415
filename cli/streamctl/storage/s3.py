"""S3 and S3-compatible stores through boto3.

Credentials come from boto3's own chain only (env, profiles, SSO, instance roles). The endpoint comes from
`StorageOptions.endpoint_url`, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (passed explicitly so that it also
works with boto3 versions that do not read them). Multipart uploads are native S3 multipart uploads.

An upload started with a `resume` token (Store.start_multipart) also writes a small object, its record, under
the one temporary form of storage/base.py (`DIR/.streamctl-tmp/TOKEN/NAME`, hidden from `list()`): the
upload id and the metadata it was created with, which S3 has no request to read back. A later run with the
same token reads the record, asks ListParts what the upload holds (size and ETag, the MD5 of each part's
bytes as S3 received them) and reopens it; the record goes when the upload completes or is aborted.
"""

from __future__ import annotations

import builtins
import json
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.exceptions as bce
from botocore.config import Config
from botocore.response import StreamingBody

from streamctl.common.sizes import GiB, KiB, MiB
from streamctl.errors import NotFoundError, PreconditionFailed, StreamctlError, UsageError
from streamctl.storage import _errors, deadlines
from streamctl.storage._errors import Failure, Kind, Op, ServiceHints, kind_for_status, lower_keys, one_line, strip_etag
from streamctl.storage.base import (
    TEMPORARY_FOLDER,
    HeldPart,
    ObjectInfo,
    StorageOptions,
    UnfinishedUpload,
    content_type_for,
    copy_into,
    parse_temporary_key,
    read_through_buffer,
    receive_body_into,
    temporary_key,
)
from streamctl.storage.url import ParsedURL

MAX_COPY_OBJECT_BYTES = 5 * GiB  # CopyObject's limit; larger objects are copied in parts
COPY_PART_BYTES = GiB

HINTS = ServiceHints(
    service="S3",
    container="bucket",
    credentials=(
        "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
        "(run `aws configure`, or `aws sso login` for SSO profiles)"
    ),
    permissions={
        Op.LIST: "s3:ListBucket",
        # Without s3:ListBucket, S3 also answers 403 instead of 404 for a missing object.
        Op.READ: "s3:GetObject (and s3:ListBucket)",
        Op.WRITE: "s3:PutObject (and s3:AbortMultipartUpload)",
        Op.DELETE: "s3:DeleteObject",
    },
    network="check the network and the endpoint (--endpoint-url or AWS_ENDPOINT_URL)",
)

# Error codes S3 and S3-compatible services use for rejected (rather than insufficient) credentials.
_BAD_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "RequestTimeTooSkewed",
    }
)
_UNAVAILABLE_CODES = frozenset(
    {"SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError", "Throttling", "ThrottlingException"}
)


def _botocore_errors(*names: str) -> tuple[type[BaseException], ...]:
    """The botocore exception classes of these names that the installed botocore has."""
    return tuple(cls for cls in (getattr(bce, name, None) for name in names) if cls is not None)


_MISSING_CREDENTIALS = _botocore_errors(
    "NoCredentialsError", "PartialCredentialsError", "ProfileNotFound", "NoAuthTokenError"
)
# SSO / login token problems: credentials exist but need refreshing.
_STALE_CREDENTIALS = _botocore_errors("CredentialRetrievalError", "TokenRetrievalError", "SSOError", "LoginError")
T = TypeVar("T")
_NETWORK = (bce.HTTPClientError, bce.ConnectionError, bce.IncompleteReadError)


def _client_error_status(error: bce.ClientError) -> tuple[int | None, str, str]:
    info = error.response.get("Error", {}) or {}
    status = (error.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
    return status, str(info.get("Code", "") or ""), str(info.get("Message", "") or "")


def classify(error: BaseException) -> Failure:
    """What an exception from boto3 means, in service-neutral terms."""
    if isinstance(error, bce.ClientError):
        status, code, message = _client_error_status(error)
        detail = one_line(f"{status or ''} {code}: {message}".strip(": "))
        if code == "NoSuchBucket":
            return Failure(Kind.NO_BUCKET, detail)
        if code == "NoSuchKey":
            return Failure(Kind.NO_OBJECT, detail)
        if code in _BAD_CREDENTIAL_CODES:
            return Failure(Kind.BAD_CREDENTIALS, detail)
        if code in _UNAVAILABLE_CODES:
            return Failure(Kind.UNAVAILABLE, detail)
        if code in ("InvalidBucketName", "KeyTooLongError"):
            return Failure(Kind.INVALID, detail)
        if code == "NoSuchUpload":  # aborted or expired multipart upload: not the bucket or the object
            return Failure(Kind.OTHER, detail)
        return Failure(kind_for_status(status), detail)
    if isinstance(error, _MISSING_CREDENTIALS):
        return Failure(Kind.NO_CREDENTIALS, one_line(error))
    if isinstance(error, _STALE_CREDENTIALS):
        return Failure(Kind.BAD_CREDENTIALS, one_line(error))
    if isinstance(error, bce.FlexibleChecksumError):
        return Failure(Kind.CORRUPT, one_line(error))
    if isinstance(error, (*_NETWORK, OSError)) or type(error).__module__.startswith("urllib3"):
        return Failure(Kind.UNAVAILABLE, one_line(error))
    if isinstance(error, bce.ParamValidationError):
        return Failure(Kind.INVALID, one_line(error))
    return Failure(Kind.OTHER, one_line(f"{type(error).__name__}: {error}"))


SERVICE = _errors.Service(classify, HINTS)


def map_error(error: BaseException, *, url: str, bucket: str, op: Op) -> StreamctlError:
    """The streamctl error for an exception from boto3 (without the bucket probe a store adds for 404s)."""
    return _errors.to_error(classify(error), url=url, bucket=bucket, op=op, hints=HINTS)


@dataclass(frozen=True)
class S3Settings:
    """How the client is built, resolved from options and the environment (kept apart to be testable)."""

    endpoint_url: str | None
    addressing_style: str  # "path", "virtual" or "auto"
    max_attempts: int


def resolve_settings(options: StorageOptions, environ: Mapping[str, str] = os.environ) -> S3Settings:
    endpoint = options.endpoint_url or environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or None
    path_style = options.path_style
    if path_style is None:
        # The Run:ai Model Streamer's switch, so one environment serves both streamctl and the streamer.
        virtual = environ.get("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "").strip().lower()
        if virtual in ("0", "false", "no"):
            path_style = True
        elif virtual in ("1", "true", "yes"):
            path_style = False
    style = "auto" if path_style is None else ("path" if path_style else "virtual")
    return S3Settings(endpoint, style, max(1, options.max_attempts))


def _make_client(settings: S3Settings) -> Any:
    config = Config(
        retries={"mode": "standard", "max_attempts": settings.max_attempts},
        # Transfers run ~32 threads on one client; botocore's default pool of 10 would serialise them.
        max_pool_connections=64,
        s3={"addressing_style": settings.addressing_style},
        connect_timeout=10,
        read_timeout=120,
        user_agent_extra="streamctl",
    )
    import botocore.endpoint

    deadlines.route_sleeps(botocore.endpoint)  # its retry back-off: stoppable, and a Retry-After served capped
    # A private session: boto3's default session is not safe to create clients from in several threads.
    client = boto3.session.Session().client("s3", endpoint_url=settings.endpoint_url, config=config)
    _time_requests(client)  # read_timeout is per socket read: a dribbling server needs an overall deadline
    return client


def _time_requests(client: Any) -> None:
    """Give this client's HTTP session timed urllib3 pools (streamctl.storage.deadlines). botocore has no public
    way to choose them: its URLLib3Session keeps its pool classes in one dict of its own
    (`_pool_classes_by_scheme`, shared with the pool and proxy managers it makes), replaced here before the
    client's first request. Other botocore clients in the process keep theirs.
    tests/storage/test_library_process.py fails on a botocore that moves it."""
    session = client._endpoint.http_session
    table: dict[str, type] = session._pool_classes_by_scheme
    table.update(deadlines.timed_pool_classes(table))


@dataclass
class S3MultipartUpload:
    store: S3Store
    key: str
    part_size: int
    upload_id: str
    metadata: dict[str, str]
    checksum_algorithm: str | None = None  # per-part checksum S3 verifies (as boto3's own transfers do)
    content_type: str | None = None
    _parts: dict[int, tuple[dict[str, Any], int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _state: str = "open"  # "open", "aborting", "completed" or "aborted"
    record_key: str | None = None  # the upload's record, for uploads started with a `resume` token
    _held: list[HeldPart] = field(default_factory=list)

    def held_parts(self) -> list[HeldPart]:
        return list(self._held)

    def _find_held_parts(self) -> bool:
        """Load the parts S3 holds for this upload (ListParts); False when the upload is gone."""
        try:
            with self.store._guard(Op.WRITE, self.key):
                paginator = self.store._client.get_paginator("list_parts")
                pages = self.store._call(
                    self.key,
                    lambda: list(paginator.paginate(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id)),
                )
        except StreamctlError as error:
            if _is_no_such_upload(error):
                return False
            raise
        for page in pages:
            self.checksum_algorithm = page.get("ChecksumAlgorithm") or self.checksum_algorithm
            for item in page.get("Parts", ()):
                index = int(item["PartNumber"]) - 1
                part = {"PartNumber": item["PartNumber"], "ETag": item["ETag"]}
                part.update({name: value for name, value in item.items() if name.startswith("Checksum")})
                self._parts[index] = (part, int(item["Size"]))
                self._held.append(HeldPart(index, int(item["Size"]), strip_etag(item["ETag"]) or ""))
        return True

    def _drop_record(self) -> None:
        if self.record_key is not None:
            try:
                self.store.delete(self.record_key)
            except StreamctlError:
                pass  # hidden from listings; the next upload under the token replaces it

    def _request(self, method: str, expected_bytes: int = 0, **arguments: Any) -> Any:
        """One request about this upload (Bucket, Key and UploadId filled in) under the store's guard."""
        with self.store._guard(Op.WRITE, self.key):
            operation = getattr(self.store._client, method)
            return self.store._call(
                self.key,
                partial(operation, Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id, **arguments),
                expected_bytes,
            )

    def upload_part(self, index: int, data: bytes | memoryview) -> None:
        _errors.check_part(self.store.url(self.key), self._state, index, self.store.max_parts)
        data = bytes(data)  # botocore takes bytes or a file (no-op for bytes)
        extra = {"ChecksumAlgorithm": self.checksum_algorithm} if self.checksum_algorithm else {}
        response = self._request("upload_part", len(data), PartNumber=index + 1, Body=data, **extra)
        part = {"PartNumber": index + 1, "ETag": response["ETag"]}
        if self.checksum_algorithm:
            # An upload created with a checksum algorithm must list each part's checksum on completion.
            member = f"Checksum{self.checksum_algorithm}"
            if response.get(member):
                part[member] = response[member]
        with self._lock:
            self._parts[index] = (part, len(data))

    def complete(self, metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        late = {name: value for name, value in lower_keys(metadata).items() if self.metadata.get(name) != value}
        if late and not self._parts:
            self.metadata = {**self.metadata, **late}  # an empty object is a plain put: no copy needed
            late = {}
        with self._lock:
            if self._state != "open":
                raise UsageError(f"upload of {self.store.url(self.key)} is already {self._state}")
            parts = dict(self._parts)
        indices = sorted(parts)
        _errors.check_no_gaps(self.store.url(self.key), indices)
        if not parts:
            # S3 refuses to complete an upload without parts; an empty object is a plain put.
            self.abort()
            info = self.store.put(self.key, b"", self.metadata, self.content_type)
            with self._lock:
                self._state = "completed"
            self._drop_record()
            return info
        size = sum(length for _, length in parts.values())
        # S3 may take minutes to assemble a large object (it sends whitespace meanwhile): scale by size.
        response = self._request(
            "complete_multipart_upload", size, MultipartUpload={"Parts": [parts[index][0] for index in indices]}
        )
        with self._lock:
            self._state = "completed"
        etag = strip_etag(response.get("ETag"))
        self._drop_record()
        if late:
            # S3 fixes user metadata when the upload is created: metadata known only now takes a server-side
            # copy onto the same key (no bytes through this machine).
            self.metadata = {**self.metadata, **late}
            etag = self.store._replace_metadata(self.key, size, self.metadata, self.content_type)
        return ObjectInfo(self.key, size, etag, dict(self.metadata))

    def positional_writer(self) -> None:
        return None  # parts are the only way to write an object here

    def kernel_copier(self) -> None:
        return None

    def abort(self) -> None:
        with self._lock:
            if self._state != "open":
                return
            self._state = "aborting"  # refuses further parts
        try:
            self._request("abort_multipart_upload")
        except StreamctlError as error:
            # NoSuchUpload: already gone (aborted elsewhere, or expired by a lifecycle rule).
            if not _is_no_such_upload(error):
                with self._lock:
                    self._state = "open"  # S3 still holds the parts (and bills them): let a later abort retry
                raise
        with self._lock:
            self._state = "aborted"
        self._drop_record()


def _all_pages(paginator: Any, **arguments: Any) -> builtins.list[dict[str, Any]]:
    return list(paginator.paginate(**arguments))


def _is_no_such_upload(error: StreamctlError) -> bool:
    cause = error.__cause__
    return isinstance(cause, bce.ClientError) and _client_error_status(cause)[1] == "NoSuchUpload"


@dataclass
class S3Store(_errors.CloudRequests):
    service: ClassVar[_errors.Service] = SERVICE
    bucket: str
    settings: S3Settings
    scheme: str = "s3"
    min_part_size: int = 5 * MiB
    max_part_size: int = 5 * GiB
    max_parts: int = 10_000
    page_size: int | None = None  # keys per listing request; None: the service default (1000)
    _client_instance: Any = field(default=None, repr=False)
    _client_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def _client(self) -> Any:
        # Built on first use: building it reads config files, and nothing is contacted before a request.
        if self._client_instance is None:
            with self._client_lock:
                if self._client_instance is None:
                    with self._guard(Op.READ, ""):
                        self._client_instance = _make_client(self.settings)
        return self._client_instance

    @property
    def namespace(self) -> str:
        """The endpoint: one bucket name is one bucket only within it (AWS, MinIO and R2 each have their own)."""
        return (self.settings.endpoint_url or "").rstrip("/").lower()

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}" if key else f"s3://{self.bucket}"

    def _attempts(self) -> int:
        return self.settings.max_attempts

    def _bucket_exists(self) -> bool | None:
        # HEAD answers 404 without saying whether the bucket or the key is missing; ask about the bucket.
        try:
            client = self._client
            deadlines.call(lambda: client.head_bucket(Bucket=self.bucket), url=self.url(""), attempts=1)
            return True
        except bce.ClientError as error:
            return False if _client_error_status(error)[0] == 404 else None
        except Exception:  # noqa: BLE001 - a failed probe only means "cannot tell"
            return None

    def _info(self, key: str, response: Mapping[str, Any]) -> ObjectInfo:
        return ObjectInfo(
            key,
            int(response.get("ContentLength", 0)),
            strip_etag(response.get("ETag")),
            lower_keys(response.get("Metadata")),
        )

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """S3 returns keys in UTF-8 byte order, which is Python's str order. Listings carry no user metadata."""
        with self._guard(Op.LIST, prefix):
            paginator = self._client.get_paginator("list_objects_v2")
            config = {"PageSize": self.page_size} if self.page_size else {}

            def items() -> Iterator[dict[str, Any]]:
                for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, PaginationConfig=config):
                    yield from page.get("Contents", ())

            listing = deadlines.iterate(
                items, lambda item: item["Key"], url=self.url(prefix), attempts=self.settings.max_attempts
            )
            for item in listing:
                if parse_temporary_key(item["Key"]) is None:  # an upload's record is not data
                    yield ObjectInfo(item["Key"], int(item["Size"]), strip_etag(item.get("ETag")), {})

    def stat(self, key: str) -> ObjectInfo:
        with self._guard(Op.READ, key):
            client = self._client
            return self._info(key, self._call(key, lambda: client.head_object(Bucket=self.bucket, Key=key)))

    def read_range(self, key: str, start: int, length: int) -> bytes:
        _errors.check_range(start, length)  # before a buffer of `length` is made
        return read_through_buffer(lambda view: self.read_range_into(key, start, view), length)

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        length = len(buffer)
        if _errors.is_empty_range(start, length, lambda: self.stat(key)):
            return 0
        with self._guard(Op.READ, key):
            client = self._client

            def get() -> int:
                response = client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")
                body = response["Body"]
                try:  # an S3-compatible server may ignore Range: never read a whole object per part
                    skip = _errors.check_range_answer(
                        self.url(key), urlsplit(client.meta.endpoint_url).netloc, start, response.get("ContentRange")
                    )
                except StreamctlError:
                    body.close()
                    raise
                # The range itself, straight into place when provable; never past a body that checks a
                # checksum as it is read (botocore's subclasses of StreamingBody).
                if response.get("ContentRange") and type(body) is StreamingBody:
                    received = receive_body_into(getattr(body, "_raw_stream", None), buffer)
                    if received is not None:
                        return received
                try:  # the body inside the deadline too; of a whole object, only up to the range's end
                    return copy_into(buffer, body.read(skip + length)[skip:])
                finally:
                    body.close()

            try:
                return self._call(key, get, length)
            except bce.ClientError as error:
                if _client_error_status(error)[0] == 416:
                    return 0  # the range starts at or after the end of the object
                raise

    def put(
        self, key: str, data: bytes, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> ObjectInfo:
        metadata = lower_keys(metadata)
        with self._guard(Op.WRITE, key):
            client = self._client
            response = self._call(
                key,
                lambda: client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=data,
                    Metadata=metadata,
                    ContentType=content_type or content_type_for(key),
                ),
                len(data),
            )
        return ObjectInfo(key, len(data), strip_etag(response.get("ETag")), metadata)

    def _replace_metadata(self, key: str, size: int, metadata: dict[str, str], content_type: str | None) -> str | None:
        """Rewrite `key` onto itself with new user metadata; the new ETag. Multipart copy above 5 GiB."""
        source = {"Bucket": self.bucket, "Key": key}
        content_type = content_type or content_type_for(key)
        # A fresh whole-object checksum for the copy: the source's was a composite of its parts.
        checksums = self._client.meta.config.request_checksum_calculation == "when_supported"
        extra = {"ChecksumAlgorithm": "CRC32"} if checksums else {}
        with self._guard(Op.WRITE, key):
            if size <= MAX_COPY_OBJECT_BYTES:
                response = self._call(
                    key,
                    lambda: self._client.copy_object(
                        Bucket=self.bucket,
                        Key=key,
                        CopySource=source,
                        Metadata=metadata,
                        MetadataDirective="REPLACE",
                        ContentType=content_type,
                        **extra,
                    ),
                    size,  # the service copies it all before it answers
                )
                return strip_etag(response.get("CopyObjectResult", {}).get("ETag"))
            upload_id = self._call(
                key,
                lambda: self._client.create_multipart_upload(
                    Bucket=self.bucket, Key=key, Metadata=metadata, ContentType=content_type
                ),
            )["UploadId"]
            try:
                parts = []
                for number, start in enumerate(range(0, size, COPY_PART_BYTES), start=1):
                    end = min(start + COPY_PART_BYTES, size) - 1
                    copied = self._call(
                        key,
                        partial(
                            self._client.upload_part_copy,
                            Bucket=self.bucket,
                            Key=key,
                            UploadId=upload_id,
                            PartNumber=number,
                            CopySource=source,
                            CopySourceRange=f"bytes={start}-{end}",
                        ),
                        end + 1 - start,
                    )
                    parts.append({"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]})
                response = self._call(
                    key,
                    lambda: self._client.complete_multipart_upload(
                        Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                    ),
                    size,
                )
            except BaseException:
                self._call(
                    key, lambda: self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
                )
                raise
            return strip_etag(response.get("ETag"))

    def start_multipart(
        self,
        key: str,
        part_size: int,
        metadata: Mapping[str, str] | None = None,
        content_type: str | None = None,
        resume: str | None = None,
    ) -> S3MultipartUpload:
        metadata = lower_keys(metadata)
        content_type = content_type or content_type_for(key)
        if resume is None:
            return self._create_upload(key, part_size, metadata, content_type)
        record_key = temporary_key(key, resume)
        record = self._read_record(record_key)
        if record is not None:
            upload_id, created_with = record
            upload = S3MultipartUpload(self, key, part_size, upload_id, created_with, None, content_type)
            upload.record_key = record_key
            if upload._find_held_parts():
                return upload
        upload = self._create_upload(key, part_size, metadata, content_type)
        body = json.dumps({"upload_id": upload.upload_id, "metadata": metadata}).encode()
        try:
            self.put(record_key, body, {}, "application/json")
        except BaseException:
            upload.abort()
            raise
        upload.record_key = record_key
        return upload

    def _read_record(self, record_key: str) -> tuple[str, dict[str, str]] | None:
        """(upload id, metadata it was created with) of an upload's record; None when there is none."""
        try:
            document = json.loads(self.read_range(record_key, 0, 64 * KiB))
            return str(document["upload_id"]), {str(k): str(v) for k, v in dict(document["metadata"]).items()}
        except NotFoundError:
            return None
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None  # not a record this version wrote: start afresh (the new one replaces it)

    def _create_upload(
        self, key: str, part_size: int, metadata: dict[str, str], content_type: str
    ) -> S3MultipartUpload:
        with self._guard(Op.WRITE, key):
            # Like boto3's upload_file: CRC32 per part unless checksums are off (AWS_REQUEST_CHECKSUM_CALCULATION
            # =when_required, for S3-compatible services that reject them).
            checksums = self._client.meta.config.request_checksum_calculation == "when_supported"
            extra = {"ChecksumAlgorithm": "CRC32"} if checksums else {}
            client = self._client
            response = self._call(
                key,
                lambda: client.create_multipart_upload(
                    Bucket=self.bucket, Key=key, Metadata=metadata, ContentType=content_type, **extra
                ),
            )
        return S3MultipartUpload(
            self, key, part_size, response["UploadId"], metadata, "CRC32" if checksums else None, content_type
        )

    def delete(self, key: str) -> None:
        try:
            with self._guard(Op.DELETE, key):
                client = self._client
                self._call(key, lambda: client.delete_object(Bucket=self.bucket, Key=key))
        except StreamctlError as error:
            if isinstance(error.__cause__, bce.ClientError) and classify(error.__cause__).kind in (
                Kind.NO_BUCKET,
                Kind.NO_OBJECT,
                Kind.NOT_FOUND,
            ):
                return  # nothing to delete
            raise

    def unfinished_uploads(self, prefix: str) -> builtins.list[UnfinishedUpload]:
        """Multipart uploads in progress under `prefix` (S3 bills their parts until they are aborted)."""
        unfinished = []
        with self._guard(Op.LIST, prefix):
            paginator = self._client.get_paginator("list_multipart_uploads")
            pages = self._call(prefix, lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=prefix)))
            items = [item for page in pages for item in page.get("Uploads", ())]
        records = self._records_of(item["Key"] for item in items)
        for item in items:
            token, record_key = records.get(item["UploadId"], (None, None))
            upload = S3MultipartUpload(self, item["Key"], 0, item["UploadId"], {}, record_key=record_key)
            unfinished.append(UnfinishedUpload(item["Key"], None, upload.abort, item.get("Initiated"), token))
        return unfinished

    def _records_of(self, keys: Iterator[str]) -> dict[str, tuple[str, str]]:
        """upload id: (resume token, record key) of the records in the temporary folders beside `keys`."""
        parents = {key.rpartition("/")[0] for key in keys}
        folders = sorted(f"{parent}/{TEMPORARY_FOLDER}/" if parent else f"{TEMPORARY_FOLDER}/" for parent in parents)
        records: dict[str, tuple[str, str]] = {}
        for folder in folders:
            with self._guard(Op.LIST, folder):
                paginator = self._client.get_paginator("list_objects_v2")
                pages = self._call(folder, partial(_all_pages, paginator, Bucket=self.bucket, Prefix=folder))
            for item in (item for page in pages for item in page.get("Contents", ())):
                temporary = parse_temporary_key(item["Key"])
                record = self._read_record(item["Key"]) if temporary is not None else None
                if temporary is not None and record is not None:
                    records[record[0]] = (temporary.token, item["Key"])
        return records

    @contextmanager
    def _conditional(self, key: str, op: Op) -> Iterator[None]:
        """412 PreconditionFailed, 409 ConditionalRequestConflict (another conditional write to the key in
        flight) and a 404 for a key that If-Match named all mean: not in the state we asked for."""
        try:
            with self._guard(op, key):
                yield
        except StreamctlError as error:
            cause = error.__cause__
            if isinstance(cause, bce.ClientError):
                status, code, message = _client_error_status(cause)
                if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"):
                    raise PreconditionFailed(f"{self.url(key)}: {code or status}: {message}") from None
            raise

    def create_if_absent(self, key: str, data: bytes, metadata: Mapping[str, str] | None = None) -> str:
        with self._conditional(key, Op.WRITE):
            response = self._call(key, lambda: self._client.put_object(
                Bucket=self.bucket, Key=key, Body=data, Metadata=lower_keys(metadata),
                ContentType="application/octet-stream", IfNoneMatch="*",
            ), len(data))  # fmt: skip
        return str(response["ETag"])

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        with self._guard(Op.READ, key):

            def read() -> tuple[bytes, str]:
                response = self._client.get_object(Bucket=self.bucket, Key=key)
                return response["Body"].read(), str(response["ETag"])

            return self._call(key, read)

    def replace_if_version(self, key: str, data: bytes, version: str, metadata: Mapping[str, str] | None = None) -> str:
        with self._conditional(key, Op.WRITE):
            response = self._call(key, lambda: self._client.put_object(
                Bucket=self.bucket, Key=key, Body=data, Metadata=lower_keys(metadata),
                ContentType="application/octet-stream", IfMatch=version,
            ), len(data))  # fmt: skip
        return str(response["ETag"])

    def delete_if_version(self, key: str, version: str) -> None:
        # Conditional deletes: S3 general purpose buckets accept If-Match on DeleteObject (since 2025).
        with self._conditional(key, Op.DELETE):
            self._call(key, lambda: self._client.delete_object(Bucket=self.bucket, Key=key, IfMatch=version))


def open_store(parsed: ParsedURL, options: StorageOptions) -> S3Store:
    return S3Store(parsed.bucket, resolve_settings(options))
