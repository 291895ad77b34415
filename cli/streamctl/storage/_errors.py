"""Turn cloud SDK failures into the `streamctl.errors` tree the same way for every backend.

Each backend reduces an SDK exception to a `Failure` (a service-neutral kind plus the service's own words);
`to_error` turns that into one error whose message is one line naming the URL and whose hint names the fix.
`guard` is the context manager the backends wrap every SDK call in (generator bodies included);
`CloudRequests` is the request plumbing the cloud stores share, and the checks they make before a request
live here too. Nothing here imports an SDK, so this module is as
cheap to import as `base.py`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from streamctl.common.redact import mask_credentials
from streamctl.errors import (
    AccessDeniedError,
    IntegrityError,
    NotFoundError,
    RangeIgnoredError,
    RemoteError,
    StreamctlError,
    UsageError,
)
from streamctl.storage import deadlines

T = TypeVar("T")


class Op(enum.Enum):
    """What the caller was doing; it picks the permission a 403 hint names."""

    LIST = "list"
    READ = "read"
    WRITE = "write"
    DELETE = "delete"


class Kind(enum.Enum):
    NO_CREDENTIALS = "no credentials"  # nothing found to authenticate with
    BAD_CREDENTIALS = "bad credentials"  # found, but rejected (wrong key, expired token, bad signature)
    DENIED = "denied"  # authenticated, but lacking a permission
    NO_BUCKET = "no bucket"
    NO_OBJECT = "no object"
    NOT_FOUND = "not found"  # a 404 that does not say which: the store probes the bucket to decide
    UNAVAILABLE = "unavailable"  # network, timeout, throttling or 5xx, after the SDK's retries
    INVALID = "invalid"  # the service refused the request as malformed (usually our input)
    CORRUPT = "corrupt"  # a checksum failed in transit
    OTHER = "other"


@dataclass(frozen=True)
class Failure:
    kind: Kind
    detail: str  # the service's words, e.g. "403 AccessDenied: Access Denied"


@dataclass(frozen=True)
class ServiceHints:
    """Per-service wording for hints."""

    service: str  # "S3", "GCS", "Azure Blob"
    container: str  # what the service calls a bucket
    credentials: str  # how to provide credentials
    permissions: Mapping[Op, str]  # what to grant for each operation
    network: str  # what to check when the service cannot be reached


def one_line(text: object, limit: int = 240) -> str:
    """The service's message squeezed onto one short line (SDK messages span lines and carry XML)."""
    line = re.sub(r"\s+", " ", str(text)).strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def kind_for_status(status: int | None) -> Kind:
    """The usual meaning of an HTTP status; service error codes refine it before this is consulted."""
    if status is None:
        return Kind.OTHER
    if status == 401:
        return Kind.BAD_CREDENTIALS
    if status == 403:
        return Kind.DENIED
    if status == 404:
        return Kind.NOT_FOUND
    if status in (408, 429) or status >= 500:
        return Kind.UNAVAILABLE
    if status == 400:
        return Kind.INVALID
    return Kind.OTHER


def resolve_not_found(failure: Failure, bucket_exists: Callable[[], bool | None]) -> Failure:
    """Turn an ambiguous 404 into NO_BUCKET or NO_OBJECT by probing the bucket (only on the error path).

    `bucket_exists` returns None when it cannot tell (for example when the probe itself is denied);
    the object is then assumed missing, the likelier case.
    """
    if failure.kind is not Kind.NOT_FOUND:
        return failure
    exists = bucket_exists()
    return Failure(Kind.NO_BUCKET if exists is False else Kind.NO_OBJECT, failure.detail)


def to_error(failure: Failure, *, url: str, bucket: str, op: Op, hints: ServiceHints) -> StreamctlError:
    """The one error to raise for `failure` while doing `op` on `url`.

    Credentials in the URL (an endpoint's `user:pass@`, a SAS signature), and in the service's words, which
    often repeat the URL, are masked here, so no later path (JSON, logs, --debug) can show them.
    """
    kind, detail = failure.kind, mask_credentials(failure.detail)
    url = mask_credentials(url)
    where = f"{hints.container} {bucket!r}"
    if kind is Kind.NO_CREDENTIALS:
        return AccessDeniedError(f"{url}: no {hints.service} credentials found ({detail})", hint=hints.credentials)
    if kind is Kind.BAD_CREDENTIALS:
        return AccessDeniedError(
            f"{url}: {hints.service} rejected the credentials ({detail})",
            hint=f"refresh or replace them: {hints.credentials}",
        )
    if kind is Kind.DENIED:
        return AccessDeniedError(
            f"{url}: access denied to {op.value} ({detail})",
            hint=f"grant {hints.permissions[op]} on {where} to the identity in use, or use other credentials",
        )
    if kind is Kind.NO_BUCKET:
        return NotFoundError(
            f"{url}: {where} does not exist",
            hint=f"check the {hints.container} name in the URL, or create the {hints.container} first",
        )
    if kind in (Kind.NO_OBJECT, Kind.NOT_FOUND):
        return NotFoundError(f"{url}: no such object", hint="check the path; list the prefix to see what exists")
    if kind is Kind.UNAVAILABLE:
        return RemoteError(f"{url}: {hints.service} unavailable after retries ({detail})", hint=hints.network)
    if kind is Kind.CORRUPT:
        return IntegrityError(f"{url}: data corrupted in transit ({detail})", hint="retry the command")
    if kind is Kind.INVALID:
        return UsageError(f"{url}: {hints.service} refused the request ({detail})")
    return RemoteError(f"{url}: {hints.service} {op.value} failed ({detail})")


# Exceptions from these packages (and OSError, which sockets raise through every SDK) are translated;
# anything else inside a guarded block is a bug in our code and propagates unchanged.
SDK_MODULES = ("botocore", "boto3", "s3transfer", "urllib3", "requests", "google", "azure")


def is_sdk_exception(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return True
    return any(cls.__module__.split(".", 1)[0] in SDK_MODULES for cls in type(error).__mro__)


@contextmanager
def guard(translate: Callable[[Exception], StreamctlError]) -> Iterator[None]:
    """Re-raise every SDK exception from the block as `translate(exception)`, chained for debugging.

    Used around generator bodies too, so errors raised while paging through a listing are translated.
    """
    try:
        yield
    except StreamctlError:
        raise
    except Exception as error:
        if not is_sdk_exception(error):
            raise
        raise translate(error) from error


@dataclass(frozen=True)
class Service:
    """How one cloud service's failures read: its classifier and its hints."""

    classify: Callable[[BaseException], Failure]
    hints: ServiceHints
    listing_404_is_bucket: bool = False  # a listing of a missing bucket answers a bare 404 (no object to miss)


class CloudRequests:
    """What every cloud store (S3, GCS, Azure) does around each SDK request: the call runs under the
    per-request deadline (storage/deadlines.py), and every SDK exception from it becomes one streamctl error,
    an ambiguous 404 resolved by probing the bucket. The store class sets `service` and defines the rest."""

    service: ClassVar[Service]
    bucket: str

    def url(self, key: str) -> str:
        raise NotImplementedError

    def _attempts(self) -> int:
        """Tries per request (the SDK's retries are within each)."""
        raise NotImplementedError

    def _bucket_exists(self) -> bool | None:
        """Whether the bucket exists; None when the probe cannot tell. Only on the error path."""
        raise NotImplementedError

    def _guard(self, op: Op, key: str) -> AbstractContextManager[None]:
        return guard(lambda error: self._error(error, op, key))

    def _call(self, key: str, operation: Callable[[], T], expected_bytes: int = 0) -> T:
        """One SDK call (body included) under the per-request deadline."""
        return deadlines.call(operation, url=self.url(key), attempts=self._attempts(), expected_bytes=expected_bytes)

    def _error(self, error: BaseException, op: Op, key: str) -> StreamctlError:
        failure = self.service.classify(error)
        if self.service.listing_404_is_bucket and failure.kind is Kind.NOT_FOUND and op is Op.LIST:
            failure = Failure(Kind.NO_BUCKET, failure.detail)
        failure = resolve_not_found(failure, self._bucket_exists)
        return to_error(failure, url=self.url(key), bucket=self.bucket, op=op, hints=self.service.hints)


def lower_keys(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """User metadata with lower-cased keys: stores disagree on case, so every backend normalises."""
    return {str(key).lower(): str(value) for key, value in (metadata or {}).items()}


def strip_etag(etag: str | None) -> str | None:
    """ETags without the HTTP quotes some services add."""
    return etag.strip('"') if etag else None


def check_range(start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise UsageError(f"invalid range {start}+{length}")


def is_empty_range(start: int, length: int, stat: Callable[[], object]) -> bool:
    """Check a read_range request; True when it asks for no bytes, after `stat()` confirmed the object exists
    (an empty range still reports a missing object)."""
    check_range(start, length)
    if length == 0:
        stat()
        return True
    return False


def check_part(url: str, state: str, index: int, max_parts: int) -> None:
    """Refuse a part for an upload that is no longer open, or an index the store cannot hold."""
    if state != "open":
        raise UsageError(f"upload of {url} is already {state}")
    if not 0 <= index < max_parts:
        raise UsageError(f"part index {index} out of range 0..{max_parts - 1}")


def check_no_gaps(url: str, indices: list[int]) -> None:
    """Refuse to complete an upload whose parts (sorted indices) are not exactly 0..n-1."""
    if indices != list(range(len(indices))):
        missing = sorted(set(range(indices[-1] + 1)) - set(indices))
        raise UsageError(f"upload of {url} is missing parts {missing[:10]}")


def content_range_start(header: str | None) -> int | None:
    """The first byte of a `Content-Range: bytes A-B/SIZE` answer (None: absent or malformed). The GCS
    emulator answers an empty object's range with `bytes 0--1/0`: only A is judged."""
    match = re.match(r"^bytes (\d+)-", (header or "").strip())
    return int(match.group(1)) if match else None


# A whole-object answer to a range that starts this near the beginning is read from byte 0 and the bytes
# before the range dropped: a safetensors header read (from byte 8) stays cheap on a server that ignores Range.
WHOLE_OBJECT_SKIP_LIMIT = 64 * 1024


def check_range_answer(url: str, endpoint: str, start: int, content_range: str | None) -> int:
    """A ranged GET's answer, before any of its body is read; returns how many leading body bytes to drop.

    The range asked for (a Content-Range starting at `start`): 0. The whole object (no Content-Range, a 200
    from a server that ignores Range) for a range within its first WHOLE_OBJECT_SKIP_LIMIT bytes: `start`
    (the caller reads only up to the end of its range and closes the rest). A whole object for a range
    further in would cost the whole file once per part (32 MiB read as 1 GiB): RangeIgnoredError, not
    retried. Another range: RemoteError (retried: a proxy's mix-up)."""
    if content_range is None:
        if start > WHOLE_OBJECT_SKIP_LIMIT:
            raise RangeIgnoredError(
                f"{url}: {endpoint} ignored the byte range asked for (HTTP 200 with the whole file, not 206)",
                hint="streamctl reads large files in parts; use an endpoint (or proxy) that honours Range "
                "requests, or a --part-size of at least the file's size to read each file in one request",
            )
        return start
    if content_range_start(content_range) != start:
        raise RemoteError(f"{url}: {endpoint} answered a different byte range ({content_range!r}, asked from {start})")
    return 0
