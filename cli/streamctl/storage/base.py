"""The one storage protocol every backend implements, and the types it speaks in.

Keys are full object keys inside the store's bucket or container (for local folders: paths relative to
the store's root folder, with `/` separators). Backends translate every SDK exception into the
`streamctl.errors` tree before it leaves their module.
"""

from __future__ import annotations

import mimetypes
import posixpath
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

MiB = 1024 * 1024
BINARY_CONTENT_TYPE = "application/octet-stream"
# Model-repo suffixes the mimetypes table gets wrong or lacks; the rest come from Python's built-in table
# (not the host's /etc/mime.types, so every machine writes the same type).
_CONTENT_TYPES = {
    ".json": "application/json",
    ".safetensors": BINARY_CONTENT_TYPE,
    ".model": BINARY_CONTENT_TYPE,  # sentencepiece
    ".bin": BINARY_CONTENT_TYPE,
    ".pt": BINARY_CONTENT_TYPE,
    ".pth": BINARY_CONTENT_TYPE,
    ".gguf": BINARY_CONTENT_TYPE,
    ".txt": "text/plain",
    ".jinja": "text/plain",
    ".tiktoken": "text/plain",
    ".vocab": "text/plain",
    ".md": "text/markdown",
    ".py": "text/x-python",
    ".yaml": "application/yaml",
    ".yml": "application/yaml",
}
_BUILTIN_TYPES = mimetypes.MimeTypes(filenames=())


def content_type_for(key: str) -> str:
    """The Content-Type an object named `key` is stored with: by suffix, application/octet-stream if unknown."""
    suffix = posixpath.splitext(key)[1].lower()
    if suffix in _CONTENT_TYPES:
        return _CONTENT_TYPES[suffix]
    guessed, encoding = _BUILTIN_TYPES.guess_type(posixpath.basename(key) or "x", strict=True)
    return guessed if guessed and encoding is None else BINARY_CONTENT_TYPE


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

    def complete(self, metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Make the object visible. `metadata` is added to start_multipart's: what is known only once every
        byte was written (the sha256 a writer computed in flight)."""
        ...

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

    def put(
        self, key: str, data: bytes, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> ObjectInfo:
        """Write a whole object. `content_type` None: `content_type_for(key)` (also for every call below)."""
        ...

    def start_multipart(
        self, key: str, part_size: int, metadata: Mapping[str, str] | None = None, content_type: str | None = None
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
        """Every object under this location, as if it were a folder (siblings like `prefix2/` excluded)."""
        return self.store.list(f"{self.prefix}/" if self.prefix else "")
