"""`streamctl transfer` between local folders: the sha256 computed in flight and stored when the file
completes, with no hashing pass before the copy, at every part boundary, both ways the bytes move (copied
inside the kernel while a reader hashes the source beside it; through part buffers, the way of a resumed
upload and of every other source); a source file that changes while it is copied is refused with nothing
committed."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from progress_helpers import RecordingProgress
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.errors import IntegrityError, OutOfResources, StreamctlError
from streamctl.storage import open_location
from streamctl.storage.base import Location
from streamctl.storage.url import source_identity
from streamctl.transfer import TransferOptions, TransferResult, execute_transfer, plan_transfer

PART = 64 * 1024
OPTIONS = TransferOptions(all_files=True, part_size=PART, max_buffer=4 * PART, concurrency=4)
# Around the part size: empty, one byte, just under / at / just over one part, whole parts, a short last part.
SIZES = {"empty.bin": 0, "one.bin": 1, "under.bin": PART - 1, "one-part.bin": PART, "over.bin": PART + 1,
         "four-parts.bin": 4 * PART, "short-last.bin": 3 * PART + PART // 3}  # fmt: skip


class CountingReads:
    """SOURCE's store, counting the bytes read from each file (ranged reads into new or given buffers) and the
    files opened for a copy inside the kernel; `kernel=False` hides that capability, so parts carry the bytes."""

    def __init__(self, inner: Any, kernel: bool = True) -> None:
        self.inner, self.kernel = inner, kernel
        self.read: dict[str, int] = {}
        self.opened: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name == "open_file" and not self.kernel:
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def open_file(self) -> Any:
        if not self.kernel or not hasattr(self.inner, "open_file"):
            raise AttributeError("open_file")
        return self._open_file

    def _open_file(self, key: str) -> int:
        self.opened.append(key)
        fd: int = self.inner.open_file(key)
        self.opened_now(key)
        return fd

    def opened_now(self, key: str) -> None:
        """What happens to the file once it is open for the kernel's copy (nothing here)."""

    def read_range(self, key: str, start: int, length: int) -> bytes:
        data: bytes = self.inner.read_range(key, start, length)
        self.read[key] = self.read.get(key, 0) + len(data)
        return data

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        count: int = self.inner.read_range_into(key, start, buffer)
        self.read[key] = self.read.get(key, 0) + count
        return count


class ChangedWhileRead(CountingReads):
    """SOURCE's store, where `change(path)` happens to the file right after its first part is read."""

    def __init__(self, inner: Any, path: Path, how: str, kernel: bool) -> None:
        super().__init__(inner, kernel)
        self.path, self.how, self.done = path, how, False

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        count = super().read_range_into(key, start, buffer)
        self.change(key)
        return count

    def opened_now(self, key: str) -> None:
        self.change(key)  # the kernel's copy and the hashing reader start on the changed file

    def change(self, key: str) -> None:
        if key.endswith(self.path.name) and not self.done:
            self.done = True
            stat = self.path.stat()
            if self.how == "grows":
                with open(self.path, "ab") as handle:
                    handle.write(b"more")
            elif self.how == "shrinks":
                os.truncate(self.path, stat.st_size - PART)
            else:  # rewritten in place at the same size, as a writer that has not finished would leave it
                with open(self.path, "r+b") as handle:
                    handle.seek(stat.st_size - 10)
                    handle.write(b"x" * 10)
            os.utime(self.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def write_sources(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    generator = random.Random(7)
    files = {name: generator.randbytes(size) for name, size in SIZES.items()}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def run(source: Location, dest: Location) -> TransferResult:
    plan = plan_transfer(source, dest, source_identity(source), OPTIONS)
    return execute_transfer(plan, source, dest, OPTIONS, RecordingProgress())


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel-copy", "parts"])
def test_every_byte_of_a_local_source_is_read_once_and_hashed_at_every_part_boundary(
    tmp_path: Path, kernel: bool
) -> None:
    files = write_sources(tmp_path / "src")
    source = open_location(str(tmp_path / "src"))
    counting = CountingReads(source.store, kernel)
    dest = open_location(str(tmp_path / "dest"))
    result = run(Location(counting, source.prefix), dest)

    expected = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    assert {file.path: file.sha256 for file in result.files} == expected
    for name, data in files.items():
        assert (tmp_path / "dest" / name).read_bytes() == data
        assert dest.store.stat(name).metadata["sha256"] == expected[name]  # stored at completion
        if kernel and len(data) > PART:  # no byte through the store's reads; opened once, for copy and hash
            assert counting.read.get(source.key(name), 0) == 0, name
            assert counting.opened.count(source.key(name)) == 1, name
        else:  # a file of one part is one read and one write either way
            assert counting.read.get(source.key(name), 0) == len(data), name  # once: no hashing pass first
    manifest = json.loads((tmp_path / "dest" / MANIFEST_NAME).read_text())
    assert {entry["path"]: entry["sha256"] for entry in manifest["files"]} == expected
    assert dest.store.unfinished_uploads("") == []


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel-copy", "parts"])
@pytest.mark.parametrize("how", ["grows", "shrinks", "rewritten"])
def test_a_source_file_changed_during_the_copy_is_refused(tmp_path: Path, how: str, kernel: bool) -> None:
    write_sources(tmp_path / "src")
    changing = tmp_path / "src" / "short-last.bin"
    source = open_location(str(tmp_path / "src"))
    dest = open_location(str(tmp_path / "dest"))
    with pytest.raises(IntegrityError) as raised:
        run(Location(ChangedWhileRead(source.store, changing, how, kernel), source.prefix), dest)

    assert str(changing) in raised.value.message
    assert "changed during the copy" in raised.value.message
    assert not (tmp_path / "dest" / "short-last.bin").exists()  # no final name holds the mixed bytes
    assert not (tmp_path / "dest" / MANIFEST_NAME).exists()
    assert dest.store.unfinished_uploads("") == []  # its temporary file is gone too


class FlippedByte(CountingReads):
    """SOURCE's store serving one wrong byte in every read of a part (a hub that serves other bytes)."""

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        count = super().read_range_into(key, start, buffer)
        if count:
            buffer[0] ^= 0xFF
        return count


def test_a_hub_file_outside_lfs_is_read_once_and_checked_by_its_git_sha1(fake_hub: Any, tmp_path: Path) -> None:
    """A hub file with no LFS sha256 (a git file of several parts) into a local folder: read once, and its
    git blob sha1 checks the bytes in flight; bytes that do not match it are refused (exit 5)."""
    data = random.Random(9).randbytes(3 * PART + 5)
    fake_hub.add_repo("org/git-file", {"notes.txt": data, "config.json": b"{}"}, lfs_suffixes=(), lfs_threshold=1 << 30)
    source = open_location("hf://org/git-file")
    counting = CountingReads(source.store)
    result = run(Location(counting, source.prefix), open_location(str(tmp_path / "dest")))
    assert {file.path: file.sha256 for file in result.files}["notes.txt"] == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "dest" / "notes.txt").read_bytes() == data
    assert counting.read[source.key("notes.txt")] == len(data)

    with pytest.raises(IntegrityError) as raised:
        run(Location(FlippedByte(source.store), source.prefix), open_location(str(tmp_path / "other")))
    assert "git blob sha1" in raised.value.message and "notes.txt" in raised.value.message
    assert not (tmp_path / "other" / "notes.txt").exists()


class Killed(BaseException):
    """The process is gone: nothing after this point runs (no abort, no clean-up of the upload)."""


class KilledInKernelCopy:
    """DEST's store, in a process that dies once the kernel's copy of a file reaches `limit` bytes."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner, self.limit = inner, limit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start_multipart(self, *args: Any, **kwargs: Any) -> Any:
        upload = self.inner.start_multipart(*args, **kwargs)
        limit = self.limit

        class Upload:
            def __getattr__(self, name: str) -> Any:
                return getattr(upload, name)

            def kernel_copier(self) -> Any:
                copy = upload.kernel_copier()

                def dying(source_fd: int, offset: int, length: int) -> int:
                    if offset + length > limit:
                        raise Killed()
                    return int(copy(source_fd, offset, length))

                return dying

            def abort(self) -> None:
                pass  # a killed process aborts nothing

        return Upload()


def test_a_kernel_copy_killed_midway_is_resumed_by_the_next_run(tmp_path: Path) -> None:
    """The kernel's copy leaves its parts in the temporary file like any upload: the next run of the same plan
    reads them back, keeps those that match the source and sends the rest; the result is the source's bytes
    and sha256."""
    files = write_sources(tmp_path / "src")
    source = open_location(str(tmp_path / "src"))
    dest = open_location(str(tmp_path / "dest"))
    with pytest.raises(Killed):
        run(source, Location(KilledInKernelCopy(dest.store, 2 * PART), dest.prefix))
    assert dest.store.unfinished_uploads("") != []  # the parts copied so far wait for the next run

    result = run(source, dest)
    assert result.bytes_resumed % PART == 0 and result.bytes_resumed >= PART  # whole parts kept, not re-sent
    for name, data in files.items():
        assert (tmp_path / "dest" / name).read_bytes() == data
        assert dest.store.stat(name).metadata["sha256"] == hashlib.sha256(data).hexdigest()
    assert dest.store.unfinished_uploads("") == []


@pytest.mark.parametrize("refusal", [errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_where_the_kernel_cannot_copy_the_bytes_go_through_user_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: int
) -> None:
    """copy_file_range refused between two files (another file system, one without it, a sandbox): the same
    bytes are read and written instead, and the copy is the source's."""
    files = write_sources(tmp_path / "src")
    calls: list[int] = []

    def refused(*args: Any) -> int:
        calls.append(refusal)
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(os, "copy_file_range", refused)
    run(open_location(str(tmp_path / "src")), open_location(str(tmp_path / "dest")))
    assert calls  # the kernel was asked first
    for name, data in files.items():
        assert (tmp_path / "dest" / name).read_bytes() == data


def test_a_full_disk_during_a_kernel_copy_is_one_error_naming_dest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_sources(tmp_path / "src")

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "copy_file_range", full)
    dest = open_location(str(tmp_path / "dest"))
    with pytest.raises(StreamctlError) as raised:
        run(open_location(str(tmp_path / "src")), dest)
    assert "No space left on device" in raised.value.message or "space" in raised.value.message.lower()
    assert str(tmp_path / "dest") in raised.value.message
    assert isinstance(raised.value, OutOfResources) and raised.value.exit_code == 6
    big = [name for name, size in SIZES.items() if size > PART]  # the kernel copies files of more than one part
    assert not any((tmp_path / "dest" / name).exists() for name in big)  # no final name holds a partial file
