"""What the writing verbs (transfer, shard) share: the byte budget, part sizing, DEST listing, and the
discarding of uploads a killed earlier run left unfinished (their manifests: streamctl.dest.manifests)."""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from streamctl.common.sizes import binary_size
from streamctl.errors import NotFoundError, StreamctlError, UsageError
from streamctl.progress import Progress
from streamctl.storage.base import Location, MiB, ObjectInfo, Store
from streamctl.storage.schemes import SCHEMES

SHA256_KEY = "sha256"  # the metadata name of the sha256 every object streamctl writes carries


class Cancelled(Exception):
    """Raised inside workers once the run is being torn down (it only echoes the error that caused it)."""


@dataclass(frozen=True)
class CopiedFile:
    """A file written whole into DEST (or left there unchanged: `skipped`), with its sha256."""

    path: str
    size: int
    sha256: str
    action: Literal["copied", "skipped"] = "copied"


class ByteBudget:
    """A counting semaphore in bytes: bounds the data held in memory by parts in flight."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._free = capacity
        self._condition = threading.Condition()

    def acquire(self, amount: int, cancelled: threading.Event) -> int:
        amount = min(amount, self._capacity)  # an oversized part waits for the whole budget
        with self._condition:
            while self._free < amount:
                if cancelled.is_set():
                    raise Cancelled()
                self._condition.wait(0.2)
            self._free -= amount
        return amount

    def release(self, amount: int) -> None:
        with self._condition:
            self._free += amount
            self._condition.notify_all()


class PartBuffers:
    """Reusable part buffers, so a part's bytes land in pages already touched: a fresh multi-MiB buffer per
    part costs a page fault and a zeroed page per 4 KiB (large allocations are mmap'd, see
    streamctl.common.memory). How many exist is bounded by the ByteBudget their holders took first: a buffer is
    taken only with a part's share of the budget held, and given back before that share is."""

    def __init__(self) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            # None of this size is idle: free the idle ones of other sizes (a file whose part size was
            # raised), so that a new buffer is only ever made beside busy ones, which the budget bounds.
            self._free = {}
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            self._free.setdefault(len(buffer), []).append(buffer)


def _service(store: Store) -> str:
    scheme = SCHEMES.get(store.scheme)
    return scheme.service if scheme is not None else store.scheme  # test stand-ins may name their own


def check_part_size(requested: int, store: Store, option: str = "--part-size") -> None:
    """UsageError (exit 2) when the destination takes no parts of `requested` bytes, naming its limits."""
    if requested < store.min_part_size:
        raise UsageError(
            f"{option} {binary_size(requested)} is below {_service(store)}'s smallest part, "
            f"{binary_size(store.min_part_size)} (only the last part of an object may be smaller)",
            hint=f"pass {option} {binary_size(store.min_part_size)} or more",
            code="bad-option-value",
        )
    if requested > store.max_part_size:
        raise UsageError(
            f"{option} {binary_size(requested)} is above {_service(store)}'s largest part, "
            f"{binary_size(store.max_part_size)}",
            hint=f"pass {option} {binary_size(store.max_part_size)} or less",
            code="bad-option-value",
        )


def part_size_for(size: int, requested: int, store: Store) -> int:
    """The part size for an object of `size` bytes: `requested`, raised to the store's smallest part, and
    raised (to whole MiB) when `size` would take more parts than the store allows. UsageError when even the
    largest part cannot fit `size` into that many parts (the object is too large for the store)."""
    part = max(requested, store.min_part_size)
    if size > part * store.max_parts:
        part = math.ceil(size / store.max_parts / MiB) * MiB
    if part > store.max_part_size and size > store.max_part_size:
        raise UsageError(
            f"an object of {size:,} bytes is too large for {_service(store)}: at most {store.max_parts:,} parts "
            f"of at most {binary_size(store.max_part_size)}",
            hint="split the file, or choose another destination",
        )
    return min(part, max(store.max_part_size, store.min_part_size))


def part_size_note(path: str, size: int, requested: int, chosen: int, store: Store) -> str | None:
    """The progress note when `chosen` differs from `requested` for lack of parts, else None."""
    if chosen <= max(requested, store.min_part_size):
        return None
    return (
        f"{path}: {size:,} bytes in parts of {binary_size(requested)} would pass {_service(store)}'s limit of "
        f"{store.max_parts:,} parts; using parts of {binary_size(chosen)}"
    )


def resume_token(fields: Mapping[str, object]) -> str:
    """The `resume` token (Store.start_multipart) of an upload: 16 hex digits that name all of `fields`
    (the object, its size, its part size, its sha256, the source it comes from), so only a run that would
    create the same upload reopens it."""
    body = json.dumps(dict(fields), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(body).hexdigest()[:16]


def list_dest(dest: Location) -> dict[str, ObjectInfo]:
    """DEST's objects by path relative to it; empty for a local folder that does not exist yet."""
    try:
        return {dest.relative(info.key): info for info in dest.list()}
    except NotFoundError:
        if dest.store.scheme == "file":
            return {}  # a local folder is created on the first write
        raise


def discard_unfinished_uploads(
    dest: Location,
    ours: Callable[[str], bool],
    progress: Progress,
    started_before: datetime | None = None,
    resumable: Callable[[str, str], bool] = lambda name, token: False,
) -> tuple[str, ...]:
    """Discard what killed earlier runs left half-uploaded for the objects this run writes (`ours` tells
    them by name relative to DEST): S3 multipart parts and GCS part objects are billed, and local temporary
    files take disk, until someone does. Unfinished uploads of other objects are left alone.

    Called while holding DEST's lease (streamctl.dest.lease), with `started_before` the moment it was taken: an
    upload the store dates from before then belongs to a run that no longer holds the lease (killed, or a
    stale holder we took over); one begun since belongs to a live writer and is never touched. Uploads the
    store gives no date for are discarded (under the lease, no live run can own them). One that this run
    would start again (`resumable(name, token)` for its `resume` token, see Store.start_multipart) is kept:
    the run reopens it and sends only the parts it lacks.

    Best effort: credentials that may write but not list or abort uploads (no s3:ListBucketMultipartUploads,
    say) are common and enough for the run itself, so a refusal here is reported, never fatal.
    """
    try:
        unfinished = dest.store.unfinished_uploads(f"{dest.prefix}/" if dest.prefix else "")
    except StreamctlError as error:
        progress.log(f"could not look for unfinished uploads of earlier runs: {error.message}")
        return ()
    discarded = []
    recent = 0
    for upload in unfinished:
        name = dest.relative(upload.key)
        if not ours(name):
            continue
        if upload.resume is not None and resumable(name, upload.resume):
            continue
        if started_before is not None and upload.started is not None and upload.started >= started_before:
            recent += 1
            continue
        try:
            upload.discard()
        except StreamctlError as error:
            progress.log(f"could not discard an unfinished upload of {name}: {error.message}")
            continue
        discarded.append(name)
    if discarded:
        shown = ", ".join(sorted(set(discarded))[:5]) + (", ..." if len(set(discarded)) > 5 else "")
        progress.log(f"discarded {len(discarded)} unfinished upload(s) an earlier run left: {shown}")
    if recent:
        progress.log(f"left {recent} unfinished upload(s) begun after this run took the lease (another writer's)")
    return tuple(sorted(discarded))
