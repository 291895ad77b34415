"""The file-system facts the local store stands on: user metadata in extended attributes, what kind of entry a
name holds (only regular files are read), and opening a folder without following a link."""

from __future__ import annotations

import errno
import os
import stat as stat_mode
from collections.abc import Mapping
from pathlib import Path

from streamctl.errors import UsageError

# Where files keep their Content-Type: the freedesktop.org shared-mime-info attribute (file managers read it).
MIME_TYPE_XATTR = "user.mime_type"

_XATTR_PREFIX = "user.streamctl."
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def read_metadata(target: Path | str | int) -> dict[str, str]:
    try:
        names = os.listxattr(target)
    except (OSError, AttributeError):
        return {}
    metadata = {}
    for name in names:
        if name.startswith(_XATTR_PREFIX):
            try:
                metadata[name[len(_XATTR_PREFIX) :]] = os.getxattr(target, name).decode("utf-8", "replace")
            except OSError:
                continue
    return metadata


def write_metadata(target: int | Path, metadata: Mapping[str, str] | None, content_type: str | None = None) -> None:
    attributes = {_XATTR_PREFIX + name.lower(): value for name, value in (metadata or {}).items()}
    if content_type:
        attributes[MIME_TYPE_XATTR] = content_type
    for name, value in attributes.items():
        try:
            os.setxattr(target, name, value.encode())
        except (OSError, AttributeError):
            return  # no xattr support here: metadata is an optimisation, not a requirement


KIND_WORDS = {
    "fifo": "a FIFO (named pipe)",
    "socket": "a unix socket",
    "char-device": "a character device",
    "block-device": "a block device",
    "folder": "a folder",
    "special": "a special file",
}


def entry_kind(mode: int) -> str:
    for test, kind in (
        (stat_mode.S_ISFIFO, "fifo"),
        (stat_mode.S_ISSOCK, "socket"),
        (stat_mode.S_ISCHR, "char-device"),
        (stat_mode.S_ISBLK, "block-device"),
        (stat_mode.S_ISDIR, "folder"),
    ):
        if test(mode):
            return kind
    return "special"


def not_regular(path: Path, mode: int) -> UsageError:
    return UsageError(
        f"{path} is {KIND_WORDS[entry_kind(mode)]}, not a regular file",
        hint="streamctl reads only regular files: replace it with the file itself",
    )


def open_folder(parent_fd: int, name: str, shown: Path, create: bool) -> int:
    """The folder `name` in `parent_fd` as a descriptor, created first if asked; never through a link.
    Raises OSError as the system does, except for a link (UsageError)."""
    if create:
        try:
            os.mkdir(name, 0o777, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, FOLDER_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                is_link = stat_mode.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
            except OSError:
                is_link = False
            if is_link:
                raise UsageError(
                    f"{shown} is a symbolic link; streamctl never writes through links inside DEST",
                    hint="remove the link, or name the folder it points to as DEST",
                ) from None
        raise
