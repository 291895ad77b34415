"""`streamctl transfer` between local folders: every byte of the source read once (the sha256 is computed in
flight and stored when the file completes, with no hashing pass before the copy), at every part boundary,
and a source file that changes while it is copied is refused with nothing committed."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from progress_helpers import RecordingProgress
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.errors import IntegrityError
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
    """SOURCE's store, counting the bytes read from each file (ranged reads into new or given buffers)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.read: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

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

    def __init__(self, inner: Any, path: Path, how: str) -> None:
        super().__init__(inner)
        self.path, self.how, self.done = path, how, False

    def read_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        count = super().read_range_into(key, start, buffer)
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
        return count


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


def test_every_byte_of_a_local_source_is_read_once_and_hashed_at_every_part_boundary(tmp_path: Path) -> None:
    files = write_sources(tmp_path / "src")
    source = open_location(str(tmp_path / "src"))
    counting = CountingReads(source.store)
    dest = open_location(str(tmp_path / "dest"))
    result = run(Location(counting, source.prefix), dest)

    expected = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    assert {file.path: file.sha256 for file in result.files} == expected
    for name, data in files.items():
        assert (tmp_path / "dest" / name).read_bytes() == data
        assert dest.store.stat(name).metadata["sha256"] == expected[name]  # stored at completion
        assert counting.read.get(source.key(name), 0) == len(data), name  # once: no hashing pass first
    manifest = json.loads((tmp_path / "dest" / MANIFEST_NAME).read_text())
    assert {entry["path"]: entry["sha256"] for entry in manifest["files"]} == expected
    assert dest.store.unfinished_uploads("") == []


@pytest.mark.parametrize("how", ["grows", "shrinks", "rewritten"])
def test_a_source_file_changed_during_the_copy_is_refused(tmp_path: Path, how: str) -> None:
    write_sources(tmp_path / "src")
    changing = tmp_path / "src" / "short-last.bin"
    source = open_location(str(tmp_path / "src"))
    dest = open_location(str(tmp_path / "dest"))
    with pytest.raises(IntegrityError) as raised:
        run(Location(ChangedWhileRead(source.store, changing, how), source.prefix), dest)

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
