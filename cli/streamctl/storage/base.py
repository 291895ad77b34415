"""The one storage protocol every backend implements, and the types it speaks in.

Keys are full object keys inside the store's bucket or container (for local folders: paths relative to
the store's root folder, with `/` separators). Backends translate every SDK exception into the
`streamctl.errors` tree before it leaves their module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

MiB = 1024 * 1024
# The lease object a writing run holds at the root of its DEST (streamctl.lease). A reserved name: folder-like
# listings (Location.list) never show it at any depth, so it is never copied, removed by --force or reported as
# a stray file. No dot-json suffix, so nothing that pulls every *.json next to the weights (vLLM) fetches it.
LEASE_NAME = ".streamctl-lease"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str | None = None
    # User metadata, keys lower-cased (every store lower-cases or preserves them differently).
    metadata: Mapping[str, str] = field(default_factory=dict)


class MultipartUpload(Protocol):
    """An upload in parts; nothing is visible under `key` until `complete()` returns."""

    key: str
    part_size: int

    def upload_part(self, index: int, data: bytes) -> None:
        """Send part `index` (0-based). Every part but the last is exactly `part_size` bytes.

        Parts may be sent in any order and from several threads at once.
        """
        ...

    def complete(self) -> ObjectInfo: ...

    def abort(self) -> None:
        """Discard every part sent; safe to call twice or after a failure."""
        ...


@dataclass(frozen=True)
class UnfinishedUpload:
    """Storage an upload holds that never became an object (its run was killed): S3 multipart parts, GCS
    part objects, a local temporary file. Billed or taking disk until discarded."""

    key: str  # the object it was meant to become
    stored: int | None  # bytes held, where the listing says
    discard: Callable[[], None]  # removes it; raises StreamctlError when it cannot
    # When the upload began, by the store's clock (S3 Initiated, GCS timeCreated of its first part, Azure
    # creation time, local mtime), timezone-aware; None where the store does not say.
    started: datetime | None = None


class Store(Protocol):
    scheme: str
    bucket: str
    # Smallest part size a multipart upload accepts (except the last part), and the most parts.
    min_part_size: int
    max_parts: int

    def url(self, key: str) -> str:
        """The user-facing URL of `key` (for messages and reports)."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix` (a plain string prefix), recursively, in key order.

        `metadata` is filled where the listing carries it (local, GCS, Azure); S3 listings carry none, so
        call `stat()` when user metadata matters.
        """
        ...

    def stat(self, key: str) -> ObjectInfo: ...

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes [start, start+length) of the object; fewer when the object ends first."""
        ...

    def put(self, key: str, data: bytes, metadata: Mapping[str, str] | None = None) -> ObjectInfo: ...

    def start_multipart(
        self, key: str, part_size: int, metadata: Mapping[str, str] | None = None
    ) -> MultipartUpload: ...

    def delete(self, key: str) -> None:
        """Remove one object; a missing object is not an error."""
        ...

    def unfinished_uploads(self, prefix: str) -> list[UnfinishedUpload]:
        """Uploads started for keys under `prefix` (a plain string prefix) and never completed nor aborted.

        A run killed outright (SIGKILL, a lost machine) cannot abort its own; the next run into the same
        place discards the ones for the objects it writes.
        """
        ...

    # Conditional writes, for the DEST lease (streamctl.lease). A *version* is an opaque token naming one
    # stored state of an object (S3/Azure: the ETag; GCS: the generation; local: inode, mtime and content hash).
    # S3's ETag is the MD5 of the bytes, so two writers must never write identical bytes (the lease's carry a
    # per-run token).
    # Each call is one atomic request on the service: of two racing writers exactly one succeeds, and the other
    # gets PreconditionFailed (never a silent overwrite).

    def create_if_absent(self, key: str, data: bytes, metadata: Mapping[str, str] | None = None) -> str:
        """Write a small object only if no object has `key`; return its version.

        PreconditionFailed when one exists (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`, Azure
        `If-None-Match: *`, local: a hard link that fails on an existing name)."""
        ...

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """The whole (small) object and the version those bytes are; NotFoundError when it is missing."""
        ...

    def replace_if_version(
        self, key: str, data: bytes, version: str, metadata: Mapping[str, str] | None = None
    ) -> str:
        """Overwrite the object only while it is still `version`; return the new version.

        PreconditionFailed when it changed or is gone (S3 `If-Match`, GCS `ifGenerationMatch`, Azure `If-Match`,
        local: compare and rename under an exclusive lock on the folder)."""
        ...

    def delete_if_version(self, key: str, version: str) -> None:
        """Delete the object only while it is still `version`; PreconditionFailed when it changed or is gone."""
        ...


@dataclass(frozen=True)
class StorageOptions:
    """Per-invocation settings that the URL alone does not carry."""

    endpoint_url: str | None = None  # S3-compatible endpoint; else AWS_ENDPOINT_URL
    path_style: bool | None = None  # None: from RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING
    azure_account: str | None = None  # else from the URL, AZURE_STORAGE_ACCOUNT_NAME
    hf_token: str | None = None  # else HF_TOKEN or the huggingface_hub login
    hf_revision: str | None = None  # branch, tag or commit for hf:// sources (else the URL's @REV, else main)
    hf_repo_type: str | None = None  # "model" (default) or "dataset"
    # Retries per request inside each SDK; tests turn this down to keep failures fast.
    max_attempts: int = 5


@dataclass(frozen=True)
class Location:
    """A folder-like place: a store plus a key prefix ('' for the root)."""

    store: Store
    prefix: str

    def key(self, name: str) -> str:
        """The full key of `name` (a `/`-separated relative path) under this location."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key

    @property
    def url(self) -> str:
        return self.store.url(self.prefix)

    def list(self) -> Iterator[ObjectInfo]:
        """Every object under this location, as if it were a folder (siblings like `prefix2/` excluded).

        Leases (LEASE_NAME, at any depth) are not listed: they are the writing run's, not the model's."""
        return (
            info
            for info in self.store.list(f"{self.prefix}/" if self.prefix else "")
            if info.key.rpartition("/")[2] != LEASE_NAME
        )
