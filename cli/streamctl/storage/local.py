"""Local folders as a store: the folder is the bucket, keys are `/`-separated relative paths.

Writes go to a hidden temporary file in the same folder and are renamed into place when complete, so
a final name never holds a partial file. User metadata is kept in extended attributes where the file
system supports them (elsewhere it is dropped and callers fall back to hashing the file).
"""

from __future__ import annotations

import errno
import os
import re
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from streamctl._libc import start_writeback
from streamctl.errors import AccessDeniedError, NotFoundError, RemoteError, StreamctlError, UsageError
from streamctl.storage.base import ObjectInfo, StorageOptions, UnfinishedUpload, content_type_for
from streamctl.storage.url import ParsedURL

PARTIAL_SUFFIX = ".streamctl-partial"
# Where files keep their Content-Type: the freedesktop.org shared-mime-info attribute (file managers read it).
MIME_TYPE_XATTR = "user.mime_type"
_XATTR_PREFIX = "user.streamctl."


def _map_os_error(error: OSError, path: Path) -> StreamctlError:
    if isinstance(error, FileNotFoundError) or error.errno == errno.ENOENT:
        return NotFoundError(f"{path}: no such file or folder")
    if isinstance(error, PermissionError) or error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return AccessDeniedError(f"{path}: permission denied", hint="check the folder's owner and mode")
    if isinstance(error, IsADirectoryError) or isinstance(error, NotADirectoryError):
        return UsageError(f"{path}: {error.strerror}")
    if error.errno == errno.ENOSPC:
        return RemoteError(f"{path}: no space left on device", hint="free disk space or choose another folder")
    return RemoteError(f"{path}: {error.strerror or error}")


def _read_metadata(path: Path) -> dict[str, str]:
    try:
        names = os.listxattr(path)
    except (OSError, AttributeError):
        return {}
    metadata = {}
    for name in names:
        if name.startswith(_XATTR_PREFIX):
            try:
                metadata[name[len(_XATTR_PREFIX) :]] = os.getxattr(path, name).decode("utf-8", "replace")
            except OSError:
                continue
    return metadata


def _write_metadata(path: Path, metadata: Mapping[str, str] | None, content_type: str | None = None) -> None:
    attributes = {_XATTR_PREFIX + name.lower(): value for name, value in (metadata or {}).items()}
    if content_type:
        attributes[MIME_TYPE_XATTR] = content_type
    for name, value in attributes.items():
        try:
            os.setxattr(path, name, value.encode())
        except (OSError, AttributeError):
            return  # no xattr support here: metadata is an optimisation, not a requirement


def _raise(error: OSError) -> None:
    if not isinstance(error, FileNotFoundError):  # a folder removed while listing is simply gone
        raise error


def _temporary_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}")


_PARTIAL_NAME = re.compile(r"\.(.+)\.[0-9a-f]{12}" + re.escape(PARTIAL_SUFFIX))


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as error:
        raise _map_os_error(error, path) from None


@dataclass
class LocalMultipartUpload:
    key: str
    part_size: int
    final_path: Path
    temporary_path: Path
    metadata: Mapping[str, str]
    content_type: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _fd: int | None = None

    def __post_init__(self) -> None:
        try:
            self.final_path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.temporary_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as error:
            raise _map_os_error(error, self.final_path) from None

    def upload_part(self, index: int, data: bytes) -> None:
        self.write_at(index * self.part_size, data)

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """Write bytes at any offset, looping on short writes (Linux writes at most ~2 GiB per call).

        Also for writers that stream a file in order (shard): it spares assembling fixed-size parts.
        Writeback of what was written starts at once, so complete()'s fsync does not wait for the whole
        file: measured writing 3.1 GB here, 1.0-1.2 s instead of 2.6-3.2 s (the fsync alone took ~0.9 s)."""
        if self._fd is None:
            raise UsageError(f"upload of {self.key} is already finished")
        view = memoryview(data).cast("B")
        start = offset
        try:
            while view:
                done = os.pwrite(self._fd, view, offset)
                view = view[done:]
                offset += done
            start_writeback(self._fd, start, offset - start)
        except OSError as error:
            raise _map_os_error(error, self.final_path) from None

    def complete(self, metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        if metadata:
            self.metadata = {**self.metadata, **metadata}
        with self._lock:
            if self._fd is None:
                raise UsageError(f"upload of {self.key} is already finished")
            try:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
                _write_metadata(self.temporary_path, self.metadata, self.content_type)
                os.replace(self.temporary_path, self.final_path)
                size = self.final_path.stat().st_size
            except OSError as error:
                raise _map_os_error(error, self.final_path) from None
        # Lower-cased like the stored attributes, so complete() and stat() agree (see ObjectInfo).
        return ObjectInfo(self.key, size, None, {name.lower(): value for name, value in self.metadata.items()})

    def abort(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self.temporary_path.unlink(missing_ok=True)


@dataclass
class LocalStore:
    root: Path
    scheme: str = "file"
    bucket: str = ""
    min_part_size: int = 1
    max_parts: int = 1_000_000

    def url(self, key: str) -> str:
        return str(self.root / key) if key else str(self.root)

    def _path(self, key: str) -> Path:
        parts = [part for part in key.split("/") if part]
        if any(part in ("..", ".") for part in parts) or "\\" in key:
            raise UsageError(f"unsafe path {key!r}")
        return self.root.joinpath(*parts)

    def _info(self, key: str, path: Path) -> ObjectInfo:
        stat = path.stat()
        etag = f"{stat.st_mtime_ns:x}-{stat.st_size:x}"
        return ObjectInfo(key, stat.st_size, etag, _read_metadata(path))

    def _walk(self, prefix: str) -> Iterator[tuple[str, str]]:
        """(key, file name) of every file under the folder `prefix` points into whose key starts with it
        (temporary files' keys included as they are); sorted by key."""
        if not self.root.exists():
            raise NotFoundError(f"{self.root}: no such folder")
        if not self.root.is_dir():
            raise UsageError(f"{self.root} is not a folder")
        # Walk only the folder the prefix points into, then filter by the string prefix.
        base_dir, _, _ = prefix.rpartition("/")
        start = self._path(base_dir)
        if not start.is_dir():
            return
        found: list[tuple[str, str]] = []
        try:
            for folder, dirs, files in os.walk(start, onerror=_raise):  # an unreadable folder must not vanish
                dirs.sort()
                relative_folder = Path(folder).relative_to(self.root).as_posix()
                for name in files:
                    key = name if relative_folder == "." else f"{relative_folder}/{name}"
                    if key.startswith(prefix):
                        found.append((key, name))
        except OSError as error:
            raise _map_os_error(error, start) from None
        yield from sorted(found)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        for key, name in self._walk(prefix):
            if name.endswith(PARTIAL_SUFFIX):
                continue
            try:
                yield self._info(key, self._path(key))
            except FileNotFoundError:
                continue  # removed while listing
            except OSError as error:
                raise _map_os_error(error, self._path(key)) from None

    def unfinished_uploads(self, prefix: str) -> list[UnfinishedUpload]:
        """Temporary files of writes that never completed (their process was killed)."""
        if not self.root.is_dir():
            return []  # nothing was ever written here
        base_dir, _, _ = prefix.rpartition("/")
        unfinished = []
        for key, name in self._walk(base_dir + "/" if base_dir else ""):
            match = _PARTIAL_NAME.fullmatch(name)
            final_key = key[: len(key) - len(name)] + match.group(1) if match else ""
            if match and final_key.startswith(prefix):
                path = self._path(key)
                try:
                    stored: int | None = path.stat().st_size
                except OSError:
                    continue  # gone meanwhile
                unfinished.append(UnfinishedUpload(final_key, stored, partial(_unlink, path)))
        return unfinished

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            if path.is_dir():
                raise NotFoundError(f"{path} is a folder, not a file")
            return self._info(key, path)
        except OSError as error:
            raise _map_os_error(error, path) from None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise UsageError(f"invalid range {start}+{length}")
        path = self._path(key)
        try:
            with open(path, "rb") as handle:
                handle.seek(start)
                return handle.read(length)
        except OSError as error:
            raise _map_os_error(error, path) from None

    def put(
        self, key: str, data: bytes, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> ObjectInfo:
        upload = self.start_multipart(key, max(1, len(data)), metadata, content_type)
        try:
            upload.upload_part(0, data)
            return upload.complete()
        except BaseException:
            upload.abort()
            raise

    def start_multipart(
        self, key: str, part_size: int, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> LocalMultipartUpload:
        final = self._path(key)
        return LocalMultipartUpload(
            key, part_size, final, _temporary_path(final), dict(metadata or {}), content_type or content_type_for(key)
        )

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            raise _map_os_error(error, path) from None


def open_store(parsed: ParsedURL, options: StorageOptions) -> LocalStore:
    return LocalStore(Path(os.path.abspath(os.path.expanduser(parsed.bucket))))
