"""What the operating system refuses, as the user's error: one rule from errno to a `streamctl.errors` class.

Every local file access (the local store, the lease, manifests, shard's writer, config reads, the vLLM
environment's cache folder) fails through `from_os_error`, so a read-only mount, a full disk or a 300-byte
name reads the same wherever it happens: one line naming the path and what went wrong, a hint naming the
fix, and an exit code a script can act on. `user_error` is the last-resort net app.py asks before calling
anything a bug: an OSError of a known errno (or exhausted memory or threads) that escaped a site.

The classes, by what the user does about them:
- permission (EACCES, EPERM): access denied, exit 4; a read-only file system (EROFS) also exit 4, with its
  own code and words (remount, or choose another place: no chmod helps);
- the name or the shape of the tree (ENAMETOOLONG, ENOTDIR, EISDIR, EEXIST, ELOOP, EXDEV, ETXTBSY...):
  bad input, exit 2;
- a missing path (ENOENT): not found, exit 3;
- the machine out of something (ENOSPC, EDQUOT, EFBIG, EMFILE, ENFILE, ENOMEM, EAGAIN; MemoryError, a
  thread that cannot start): OutOfResources, exit 6 as a full disk always was, not retried (waiting frees
  no disk) and, as for a lost link, a transfer's sound parts kept to resume: free the space, run again;
- the device failing (EIO, ESTALE, anything unknown): a remote-style failure, exit 6.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from streamctl.errors import (
    AccessDeniedError,
    NotFoundError,
    OutOfResources,
    RemoteError,
    StreamctlError,
    UsageError,
)


@dataclass(frozen=True)
class _Meaning:
    error: type[StreamctlError]
    words: str  # what happened to the path, after "PATH: "
    hint: str | None = None
    code: str | None = None  # more precise than the class's own, where a script may want to tell it apart


_PERMISSION_HINT = "check the owner and mode of this path and of the folders above it, or choose another location"
_SPACE_HINT = "free disk space, or choose a location on another file system"
_FILES_HINT = "raise the open-file limit (ulimit -n) or lower --concurrency"
_NAME_HINT = "rename it (some file systems refuse characters such as ':' or '\\'), or choose another location"
_SHAPE_HINT = "a file stands where a folder is needed, or a folder where a file is: rename it or choose another path"

_MEANINGS: dict[int, _Meaning] = {
    errno.EACCES: _Meaning(AccessDeniedError, "permission denied", _PERMISSION_HINT),
    errno.EPERM: _Meaning(AccessDeniedError, "operation not permitted", _PERMISSION_HINT),
    errno.EROFS: _Meaning(
        AccessDeniedError,
        "read-only file system",
        "remount it read-write, or choose a location on a writable file system",
        "read-only-file-system",
    ),
    errno.ENOENT: _Meaning(NotFoundError, "no such file or folder", "check the path: every folder above it must exist"),
    errno.ENAMETOOLONG: _Meaning(
        UsageError,
        "name too long for this file system",
        "most file systems allow 255 bytes per name and 4096 per path: rename the file, or choose a shorter location",
    ),
    errno.EILSEQ: _Meaning(UsageError, "name not valid on this file system", _NAME_HINT),
    errno.EINVAL: _Meaning(UsageError, "name or request not valid on this file system", _NAME_HINT),
    errno.ELOOP: _Meaning(UsageError, "too many levels of symbolic links", "remove the looping link"),
    errno.ENOTDIR: _Meaning(UsageError, "a path segment is not a folder", _SHAPE_HINT),
    errno.EISDIR: _Meaning(UsageError, "is a folder, not a file", _SHAPE_HINT),
    errno.ENOTEMPTY: _Meaning(UsageError, "is a folder, not a file", _SHAPE_HINT),
    errno.EEXIST: _Meaning(UsageError, "exists and is not a folder", _SHAPE_HINT),
    errno.ENXIO: _Meaning(
        UsageError,
        "not a regular file (a socket or a device without a reader)",
        "streamctl reads and writes only regular files: replace it with the file itself",
    ),
    errno.EXDEV: _Meaning(
        UsageError, "crosses file systems (a mount point inside it?)", "choose a location within one file system"
    ),
    errno.ETXTBSY: _Meaning(
        UsageError, "in use by a running program (text file busy)", "stop the program, or choose another path"
    ),
    errno.EBUSY: _Meaning(UsageError, "busy (a mount point, or in use)", "choose another path"),
    errno.ENOSPC: _Meaning(OutOfResources, "no space left on device", _SPACE_HINT),
    errno.EDQUOT: _Meaning(
        OutOfResources, "disk quota exceeded", "free space within your quota, or choose another location"
    ),
    errno.EFBIG: _Meaning(
        OutOfResources,
        "file too large (for this file system, or the process's file-size limit: ulimit -f)",
        "raise the file-size limit, or choose a file system that holds files this large",
    ),
    errno.EMFILE: _Meaning(OutOfResources, "too many open files in this process", _FILES_HINT),
    errno.ENFILE: _Meaning(OutOfResources, "too many open files on this machine", _FILES_HINT),
    errno.ENOMEM: _Meaning(
        OutOfResources, "out of memory", "free memory, raise the limit (ulimit -v), or lower --concurrency"
    ),
    errno.EAGAIN: _Meaning(
        OutOfResources,
        "resource temporarily unavailable (a limit on processes, threads or locked memory)",
        "raise the limit (ulimit -u) or lower --concurrency",
    ),
    errno.EIO: _Meaning(
        RemoteError, "input/output error (the disk or network file system failed)", "check the device, then retry"
    ),
    errno.ESTALE: _Meaning(RemoteError, "stale file handle (a network file system)", "remount it, then retry"),
}


def _shown(path: object) -> str:
    if isinstance(path, bytes):
        return os.fsdecode(path)
    return str(path)


def _name_bytes(path: str) -> int:
    return max((len(part.encode(errors="surrogateescape")) for part in Path(path).parts), default=0)


def from_os_error(error: OSError, path: object | None = None) -> StreamctlError:
    """The one error to raise for `error` on `path` (by default the path the system named, if it did)."""
    where = _shown(path if path is not None else (error.filename if error.filename is not None else ""))
    meaning = _MEANINGS.get(error.errno or 0)
    if meaning is None:
        return RemoteError(f"{where}: {error.strerror or error}" if where else str(error.strerror or error))
    words = meaning.words
    if error.errno == errno.ENAMETOOLONG and where:
        words = f"{words} ({_name_bytes(where):,} bytes in the longest name, {len(where.encode(errors='surrogateescape')):,} in all)"
    message = f"{where}: {words}" if where else words
    return meaning.error(message, meaning.hint, code=meaning.code)


_THREAD_LIMIT_HINT = "raise the limits (ulimit -u, ulimit -v) or lower --concurrency"


def user_error(error: BaseException) -> StreamctlError | None:
    """What the machine refused, however it reached the top: the StreamctlError to report, or None for a
    bug. An OSError of a known errno as above; memory and threads exhausted (`ulimit -v`, `ulimit -u`), a
    library that cannot be mapped into memory: OutOfResources."""
    if isinstance(error, OSError) and error.errno in _MEANINGS:  # another errno (EBADF...) is more likely a bug
        return from_os_error(error)
    if isinstance(error, MemoryError):
        return OutOfResources("out of memory", "free memory, raise the limit (ulimit -v), or lower --concurrency")
    if isinstance(error, RuntimeError) and "can't start new thread" in str(error):
        return OutOfResources("cannot start a thread (a limit on threads, processes or memory)", _THREAD_LIMIT_HINT)
    if isinstance(error, ImportError) and any(words in str(error) for words in _NO_MEMORY_TO_LOAD):
        # numpy under `ulimit -v`: its C extension cannot be mapped, and numpy re-raises that as ImportError
        return OutOfResources(
            f"out of memory loading {error.name or 'a library'} (cannot map it into memory)",
            "free memory or raise the limit (ulimit -v)",
        )
    return None


# What the dynamic loader says when a library does not fit in the address space left (glibc's words).
_NO_MEMORY_TO_LOAD = ("failed to map segment from shared object", "cannot allocate memory")


@contextmanager
def mapped(path: object, other_way: str | None = None) -> Iterator[None]:
    """Re-raise an OSError from the block as its StreamctlError, naming the path the system named, else
    `path` (the folder the block works in); `other_way` (a way round the path altogether) ends the hint."""
    try:
        yield
    except OSError as error:
        refused = from_os_error(error, error.filename if error.filename is not None else path)
        if other_way:
            refused.hint = f"{refused.hint}; or {other_way}" if refused.hint else other_way
        raise refused from error
