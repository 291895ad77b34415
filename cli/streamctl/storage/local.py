"""Local folders as a store: the folder is the bucket, keys are `/`-separated relative paths.

Writes go to a temporary file under a `.streamctl-tmp/TOKEN/` folder beside the final name (the one
temporary form of storage/base.py) and are renamed into place when complete, so a final name never holds a
partial file. User metadata is kept in extended attributes where the file system supports them (elsewhere it
is dropped and callers fall back to hashing the file).

Only regular files are listed or read: a FIFO, socket or device under a file's name would block a reader
forever (or feed it endless bytes), so listings leave them out and report them (`skipped`), and every read
opens with O_NONBLOCK and checks fstat before reading a byte. Symbolic links are followed only while they
resolve inside the folder named, unless the store was opened with `follow_symlinks`; the others are left
out and reported. Writes never go through a link below the folder named: each parent folder is opened with
O_NOFOLLOW from the one above it (openat-style), and the final rename replaces a link rather than follow it.

The upload itself (`LocalMultipartUpload`) is storage/local_uploads.py; the file-system helpers both use
(extended attributes, entry kinds, opening a folder without following a link) are storage/local_fs.py.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import os
import stat as stat_mode
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from streamctl.errors import NotFoundError, PreconditionFailed, RemoteError, UsageError
from streamctl.oserrors import from_os_error
from streamctl.storage.base import (
    TEMPORARY_FOLDER,
    ListingNote,
    ObjectInfo,
    StorageOptions,
    TemporaryName,
    UnfinishedUpload,
    content_type_for,
    new_temporary_token,
    parse_temporary_key,
    temporary_key,
    unsafe_path_reason,
)
from streamctl.storage.local_fs import (
    FOLDER_FLAGS,
    KIND_WORDS,
    entry_kind,
    not_regular,
    open_folder,
    read_metadata,
    write_metadata,
)
from streamctl.storage.local_uploads import (
    TEMPORARY_FOLDER_ATTEMPTS,
    LocalMultipartUpload,
    create_temporary,
    remove_upload_folder,
)
from streamctl.storage.url import ParsedURL

# ------------------------------------------------------------------------------------ what may be read


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _outside_reason(target: str, root: Path) -> str:
    return f"a symbolic link to {target}, outside {root}: not followed (pass --follow-symlinks to read it)"


@dataclass(frozen=True)
class _Listed:
    key: str
    target: str  # the path to read: the entry itself, or where its links lead
    stat: os.stat_result


@dataclass(frozen=True)
class _Scan:
    files: list[_Listed] = field(default_factory=list)
    temporary: list[tuple[TemporaryName, _Listed]] = field(default_factory=list)
    notes: list[ListingNote] = field(default_factory=list)


# ------------------------------------------------------------------------------------------- writing


def _version(stat: os.stat_result, data: bytes) -> str:
    """Inode and mtime tell one file from its replacement; the content hash covers an inode number reused
    within the same mtime tick."""
    return f"{stat.st_ino:x}.{stat.st_mtime_ns:x}.{hashlib.sha256(data).hexdigest()[:16]}"


def _write_new_file(path: Path, data: bytes, metadata: Mapping[str, str] | None) -> os.stat_result:
    """A new file holding `data`, on disk (fsync) before it is linked or renamed anywhere."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        stat = os.fstat(fd)
    finally:
        os.close(fd)
    write_metadata(path, metadata)
    return stat


class _FolderLock:
    """An exclusive flock on a folder: serialises compare-and-replace among processes on this host (and on
    NFS, where Linux maps flock to byte-range locks)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.fd: int | None = None

    def __enter__(self) -> None:
        import fcntl

        self.fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None


@dataclass
class LocalStore:
    root: Path
    scheme: str = "file"
    namespace: str = ""  # a folder is told by its real path (streamctl.dest.overlap)
    bucket: str = ""
    min_part_size: int = 1
    max_part_size: int = 1 << 62  # no limit but the file system's
    max_parts: int = 1_000_000
    follow_symlinks: bool = False  # read links that lead outside `root` too (writes never follow links)

    def url(self, key: str) -> str:
        return str(self.root / key) if key else str(self.root)

    def _parts(self, key: str) -> list[str]:
        parts = [part for part in key.split("/") if part]
        if parts and unsafe_path_reason("/".join(parts)) is not None:
            raise UsageError(f"unsafe path {key!r}")
        return parts

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*self._parts(key))

    def _real_root(self) -> str:
        return os.path.realpath(self.root)

    # -------------------------------------------------------------------------------------- listing

    def _scan(self, prefix: str) -> _Scan:
        """Every entry under the folder `prefix` points into whose key starts with `prefix` (a temporary
        file: whose final key does), sorted by key: regular files, temporary files, and what was left out."""
        if not self.root.exists():
            raise NotFoundError(f"{self.root}: no such folder")
        if not self.root.is_dir():
            raise UsageError(f"{self.root} is not a folder")
        root = self._real_root()
        base_dir, _, _ = prefix.rpartition("/")
        start = os.path.realpath(self._path(base_dir))
        scan = _Scan()
        if (not self.follow_symlinks and not _inside(start, root)) or not os.path.isdir(start):
            return scan
        try:
            self._visit(start, base_dir, prefix, root, frozenset({_identity(os.stat(start))}), scan)
        except OSError as error:
            raise from_os_error(error, Path(start)) from None
        scan.files.sort(key=lambda listed: listed.key)
        scan.temporary.sort(key=lambda pair: pair[1].key)
        scan.notes.sort(key=lambda entry: entry.key)
        return scan

    def _visit(
        self, folder: str, folder_key: str, prefix: str, root: str, ancestors: frozenset[tuple[int, int]], scan: _Scan
    ) -> None:
        try:
            with os.scandir(folder) as iterator:
                entries = sorted(iterator, key=lambda entry: entry.name)
        except FileNotFoundError:
            return  # a folder removed while listing is simply gone; any other error must not hide it
        for entry in entries:
            key = f"{folder_key}/{entry.name}" if folder_key else entry.name
            wanted = key.startswith(prefix)
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            target = entry.path
            link: ListingNote | None = None  # for a link that is followed
            if stat_mode.S_ISLNK(info.st_mode):
                target = os.path.realpath(entry.path)
                try:
                    info = os.stat(entry.path)
                except OSError as error:
                    if wanted:
                        scan.notes.append(_broken_link(key, target, error))
                    continue
                inside = _inside(target, root)
                if not inside and not self.follow_symlinks:
                    if wanted:
                        scan.notes.append(
                            ListingNote(key, "symlink-outside", _outside_reason(target, self.root), target=target)
                        )
                    continue
                where = "inside" if inside else "outside (--follow-symlinks)"
                reason = f"a symbolic link to {target}, {where} {self.root}: read through it"
                link = ListingNote(key, "symlink", reason, listed=True, target=target)
            if stat_mode.S_ISDIR(info.st_mode):
                if _identity(info) in ancestors:
                    if wanted:
                        reason = f"a symbolic link to {target}, a folder that holds it: not followed"
                        scan.notes.append(ListingNote(key, "symlink-loop", reason, target=target))
                    continue
                if link is not None and (wanted or prefix.startswith(key + "/")):
                    scan.notes.append(link)
                self._visit(target, key, prefix, root, ancestors | {_identity(info)}, scan)
            elif stat_mode.S_ISREG(info.st_mode):
                listed = _Listed(key, target, info)
                temporary = parse_temporary_key(key)
                if temporary is not None:
                    if temporary.final_key.startswith(prefix):
                        scan.temporary.append((temporary, listed))
                elif wanted:
                    scan.files.append(listed)
                    if link is not None:
                        scan.notes.append(link)
            elif wanted:
                words = KIND_WORDS[entry_kind(info.st_mode)]
                scan.notes.append(ListingNote(key, entry_kind(info.st_mode), f"{words}, not a regular file: skipped"))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        for listed in self._scan(prefix).files:
            etag = f"{listed.stat.st_mtime_ns:x}-{listed.stat.st_size:x}"
            yield ObjectInfo(listed.key, listed.stat.st_size, etag, read_metadata(listed.target))

    def notes(self, prefix: str) -> builtins.list[ListingNote]:
        """What list(prefix) leaves out (special files, links not followed, temporary files of uploads in
        flight or of killed runs) and the links it lists files through."""
        if not self.root.is_dir():
            return []
        scan = self._scan(prefix)
        temporary = [
            ListingNote(
                listed.key, "temporary", "a streamctl temporary file (a run is writing here, or one was killed)"
            )
            for _, listed in scan.temporary
            if listed.key.startswith(prefix)
        ]
        return sorted(scan.notes + temporary, key=lambda note: note.key)

    def unfinished_uploads(self, prefix: str) -> builtins.list[UnfinishedUpload]:
        """Temporary files of writes that never completed (their process was killed)."""
        if not self.root.is_dir():
            return []  # nothing was ever written here
        return [
            UnfinishedUpload(
                temporary.final_key,
                listed.stat.st_size,
                partial(self._discard, temporary),
                datetime.fromtimestamp(listed.stat.st_mtime, UTC),  # a live writer keeps it fresh
                temporary.token,
            )
            for temporary, listed in self._scan(prefix).temporary
        ]

    def _discard(self, temporary: TemporaryName) -> None:
        final = self._path(temporary.final_key)
        try:
            parent_fd, name = self._open_parent(temporary.final_key, create=False)
        except NotFoundError:
            return
        try:
            temporary_fd = open_folder(parent_fd, TEMPORARY_FOLDER, final.parent / TEMPORARY_FOLDER, create=False)
            try:
                token_fd = open_folder(temporary_fd, temporary.token, self._path(temporary.folder), create=False)
            finally:
                os.close(temporary_fd)
            try:
                os.unlink(name, dir_fd=token_fd)
            finally:
                os.close(token_fd)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise from_os_error(error, self._path(temporary_key(temporary.final_key, temporary.token))) from None
        finally:
            remove_upload_folder(parent_fd, temporary.token)
            os.close(parent_fd)

    # -------------------------------------------------------------------------------------- reading

    def _readable(self, key: str) -> tuple[Path, str]:
        """(the path as named, the path to read) of `key`, refusing links that lead outside the root."""
        path = self._path(key)
        target = os.path.realpath(path)
        if not self.follow_symlinks and not _inside(target, self._real_root()):
            raise UsageError(
                f"{path} is a symbolic link to {target}, outside {self.root}",
                hint="pass --follow-symlinks to read links that lead out of the folder",
            )
        return path, target

    def _open_regular(self, key: str) -> tuple[Path, int, os.stat_result]:
        """An open descriptor of `key`'s regular file. O_NONBLOCK: opening a FIFO or a device must never
        wait for a writer; fstat then refuses anything but a regular file before a byte is read."""
        path, target = self._readable(key)
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:
            raise from_os_error(error, path) from None
        try:
            info = os.fstat(fd)
        except OSError as error:
            os.close(fd)
            raise from_os_error(error, path) from None
        if not stat_mode.S_ISREG(info.st_mode):
            os.close(fd)
            if stat_mode.S_ISDIR(info.st_mode):
                raise NotFoundError(f"{path} is a folder, not a file")
            raise not_regular(path, info.st_mode)
        return path, fd, info

    def open_file(self, key: str) -> int:
        """A read-only descriptor of `key`'s regular file, under the rules every read here follows (links out of
        the root refused, no FIFO or device): for a copy inside the kernel (MultipartUpload.kernel_copier).
        The caller closes it."""
        return self._open_regular(key)[1]

    def stat(self, key: str) -> ObjectInfo:
        _, fd, info = self._open_regular(key)
        try:
            etag = f"{info.st_mtime_ns:x}-{info.st_size:x}"
            return ObjectInfo(key, info.st_size, etag, read_metadata(fd))
        finally:
            os.close(fd)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise UsageError(f"invalid range {start}+{length}")
        path, fd, _ = self._open_regular(key)
        try:
            chunks = []
            offset, left = start, length
            while left > 0:
                chunk = os.pread(fd, min(left, 1 << 30), offset)
                if not chunk:
                    break
                chunks.append(chunk)
                offset += len(chunk)
                left -= len(chunk)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        except OSError as error:
            raise from_os_error(error, path) from None
        finally:
            os.close(fd)

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        if start < 0:
            raise UsageError(f"invalid range {start}+{len(buffer)}")
        path, fd, _ = self._open_regular(key)
        view = buffer.cast("B") if buffer.format != "B" else buffer
        filled = 0
        try:
            while filled < len(view):
                count = os.preadv(fd, [view[filled : filled + (1 << 30)]], start + filled)
                if not count:
                    break
                filled += count
            return filled
        except OSError as error:
            raise from_os_error(error, path) from None
        finally:
            os.close(fd)

    # -------------------------------------------------------------------------------------- writing

    def _open_parent(self, key: str, create: bool) -> tuple[int, str]:
        """(descriptor of the folder that holds `key`, the final name), walking down from the root one
        folder at a time without following links (the root itself may be one: the user named it)."""
        parts = self._parts(key)
        if not parts:
            raise UsageError("empty key")
        try:
            if create:
                os.makedirs(self.root, exist_ok=True)
            fd = os.open(self.root, FOLDER_FLAGS)
        except OSError as error:
            raise from_os_error(error, self.root) from None
        try:
            for depth, part in enumerate(parts[:-1], start=1):
                shown = self.root.joinpath(*parts[:depth])
                try:
                    inner = open_folder(fd, part, shown, create)
                except OSError as error:
                    raise from_os_error(error, shown) from None
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

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
        self,
        key: str,
        part_size: int,
        metadata: Mapping[str, str] | None = None,
        content_type: str | None = None,
        resume: str | None = None,
    ) -> LocalMultipartUpload:
        final = self._path(key)
        parent_fd, name = self._open_parent(key, create=True)
        try:
            token, token_fd, fd, found = create_temporary(parent_fd, name, final, resume)
        except BaseException:
            os.close(parent_fd)
            raise
        upload = LocalMultipartUpload(
            key,
            part_size,
            final,
            dict(metadata or {}),
            token,
            parent_fd,
            token_fd,
            fd,
            content_type or content_type_for(key),
        )
        if found:
            try:
                upload._read_back_parts()
            except BaseException:
                upload.abort()
                raise
        return upload

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            parent_fd, name = self._open_parent(key, create=False)
        except NotFoundError:
            return  # nothing there to delete
        try:
            os.unlink(name, dir_fd=parent_fd)  # a link is removed itself, never what it points to
        except FileNotFoundError:
            pass
        except OSError as error:
            raise from_os_error(error, path) from None
        finally:
            os.close(parent_fd)

    def _lease_temporary(self, key: str) -> Path:
        """A path of the one reserved temporary form (see TEMPORARY_FOLDER) for a small conditional write."""
        path = self._path(temporary_key(key, new_temporary_token()))
        for _ in range(TEMPORARY_FOLDER_ATTEMPTS):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                return path
            except FileNotFoundError:
                continue  # another write's clean-up removed the emptied temporary folder meanwhile: again
            except OSError as error:
                raise from_os_error(error, path.parent.parent.parent) from None  # DEST's folder, as the user sees it
        raise RemoteError(
            f"{path.parent.parent}: the temporary folder keeps vanishing", hint="is another program removing it?"
        )

    def create_if_absent(self, key: str, data: bytes, metadata: Mapping[str, str] | None = None) -> str:
        """Written in full to a temporary file, then hard-linked to the final name, which fails when the name
        exists: never a partial file under the name, never an overwrite. Where the file system has no hard
        links, an O_EXCL create of the final name (readers may then briefly see it short)."""
        final = self._path(key)
        temporary = self._lease_temporary(key)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            stat = _write_new_file(temporary, data, metadata)
            try:
                os.link(temporary, final)
            except FileExistsError:
                raise PreconditionFailed(f"{final} already exists") from None
            except OSError as error:
                if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                    raise
                try:
                    stat = _write_new_file(final, data, metadata)
                except FileExistsError:
                    raise PreconditionFailed(f"{final} already exists") from None
            return _version(stat, data)
        except OSError as error:
            raise from_os_error(error, final) from None
        finally:
            _remove_lease_temporary(temporary)

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        path = self._path(key)
        try:
            with open(path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                data = handle.read()
        except OSError as error:
            raise from_os_error(error, path) from None
        return data, _version(stat, data)

    def _check_version(self, key: str, version: str) -> None:
        try:
            _, current = self.read_versioned(key)
        except NotFoundError:
            raise PreconditionFailed(f"{self._path(key)} is gone") from None
        if current != version:
            raise PreconditionFailed(f"{self._path(key)} was changed by another writer")

    def replace_if_version(self, key: str, data: bytes, version: str, metadata: Mapping[str, str] | None = None) -> str:
        final = self._path(key)
        temporary = self._lease_temporary(key)
        try:
            with _FolderLock(final.parent):
                self._check_version(key, version)
                stat = _write_new_file(temporary, data, metadata)
                os.replace(temporary, final)
            return _version(stat, data)
        except OSError as error:
            raise from_os_error(error, final) from None
        finally:
            _remove_lease_temporary(temporary)

    def delete_if_version(self, key: str, version: str) -> None:
        path = self._path(key)
        try:
            with _FolderLock(path.parent):
                self._check_version(key, version)
                path.unlink()
        except FileNotFoundError:
            raise PreconditionFailed(f"{path} is gone") from None
        except OSError as error:
            raise from_os_error(error, path) from None


def _identity(info: os.stat_result) -> tuple[int, int]:
    return (info.st_dev, info.st_ino)


def _broken_link(key: str, target: str, error: OSError) -> ListingNote:
    if error.errno == errno.ELOOP:
        return ListingNote(key, "symlink-loop", "a symbolic link that loops: not followed")
    if error.errno in (errno.ENOENT, errno.ENOTDIR):
        return ListingNote(
            key, "symlink-dangling", f"a symbolic link to {target}, which does not exist: skipped", target=target
        )
    return ListingNote(
        key, "symlink-unreadable", f"a symbolic link to {target}: {error.strerror or error}", target=target
    )


def _remove_lease_temporary(temporary: Path) -> None:
    """The temporary file and its token folder (and the reserved folder, when it is empty); what cannot be
    removed is left for unfinished_uploads() to find."""
    for path in (temporary, temporary.parent, temporary.parent.parent):
        try:
            path.unlink(missing_ok=True) if path is temporary else path.rmdir()
        except OSError:
            return


def open_store(parsed: ParsedURL, options: StorageOptions) -> LocalStore:
    return LocalStore(Path(os.path.abspath(os.path.expanduser(parsed.bucket))), follow_symlinks=options.follow_symlinks)
