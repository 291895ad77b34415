"""`streamctl transfer` resumes inside a file: a run killed after k parts leaves them at DEST (S3 multipart
parts, GCS part objects, Azure uncommitted blocks, a local partial file) and the next run of the same plan
sends only the parts DEST lacks, while still reading and hashing every byte of the source; a held part
whose bytes differ from the source's is sent again, and an upload of another source version is discarded.

"Killed after k parts" is a store wrapper whose (k+1)-th part never leaves the process and whose abort does
nothing, as for a process killed outright (kill -9, an evicted pod); one test kills a real subprocess. What
the next run sends is counted by a wrapper around DEST's store (every byte handed to the store to upload).
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from progress_helpers import RecordingProgress
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.retry import RetryPolicy
from streamctl.storage import open_location
from streamctl.storage.base import Location, MultipartUpload, parse_temporary_key
from streamctl.transfer import TransferOptions, TransferResult, execute_transfer, plan_transfer
from streamctl.storage.url import source_identity

MiB = 1024 * 1024
FAST_RETRY = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)
NAME = "weights.bin"


class Killed(BaseException):
    """The process is gone: nothing after this point runs (no abort, no clean-up of the upload)."""


class KilledAfterParts:
    """DEST's store, in a process that dies as it starts sending part `k` (0-based): parts 0..k-1 are at
    DEST, and nobody aborts the upload."""

    def __init__(self, inner: Any, parts: int) -> None:
        self.inner, self.parts = inner, parts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start_multipart(self, key: str, part_size: int, metadata: Any = None, content_type: Any = None, resume: Any = None) -> Any:
        upload = self.inner.start_multipart(key, part_size, metadata, content_type, resume)
        limit = self.parts

        class Upload:
            def __getattr__(self, name: str) -> Any:
                return getattr(upload, name)

            def upload_part(self, index: int, data: bytes) -> None:
                if index >= limit:
                    raise Killed()
                upload.upload_part(index, data)

            def abort(self) -> None:
                pass  # a killed process aborts nothing

        return Upload()


class CountingStore:
    """DEST's store, counting every byte handed to it to upload (parts and whole objects)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, key: str, amount: int) -> None:
        self.sent[key] = self.sent.get(key, 0) + amount

    def put(self, key: str, data: bytes, metadata: Any = None, content_type: Any = None) -> Any:
        self._count(key, len(data))
        return self.inner.put(key, data, metadata, content_type)

    def start_multipart(self, key: str, part_size: int, metadata: Any = None, content_type: Any = None, resume: Any = None) -> Any:
        upload: MultipartUpload = self.inner.start_multipart(key, part_size, metadata, content_type, resume)
        count = self._count

        class Upload:
            def __getattr__(self, name: str) -> Any:
                return getattr(upload, name)

            def upload_part(self, index: int, data: bytes) -> None:
                count(key, len(data))
                upload.upload_part(index, data)

        return Upload()


def part_size_of(dest_url: str) -> int:
    return 5 * MiB if dest_url.startswith("s3://") else MiB  # S3's smallest part; elsewhere, quicker tests


def options_for(dest_url: str) -> TransferOptions:
    part = part_size_of(dest_url)
    return TransferOptions(all_files=True, part_size=part, max_buffer=2 * part, concurrency=2, retry=FAST_RETRY)


def write_source(folder: Path, part: int, seed: int) -> bytes:
    """A source folder holding one file of four parts (the last a third of a part)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = random.Random(seed).randbytes(3 * part + part // 3)
    (folder / NAME).write_bytes(data)
    return data


def run(source_url: str, dest: Location, options: TransferOptions) -> TransferResult:
    source = open_location(source_url)
    plan = plan_transfer(source, dest, source_identity(source), options)
    return execute_transfer(plan, source, dest, options, RecordingProgress())


def kill_after(source_url: str, dest_url: str, parts: int) -> None:
    dest = open_location(dest_url)
    with pytest.raises(Killed):
        run(source_url, Location(KilledAfterParts(dest.store, parts), dest.prefix), options_for(dest_url))


def resume(source_url: str, dest_url: str) -> tuple[TransferResult, int]:
    """The next run: its result and the bytes of NAME it sent to DEST."""
    dest = open_location(dest_url)
    counting = CountingStore(dest.store)
    result = run(source_url, Location(counting, dest.prefix), options_for(dest_url))
    return result, counting.sent.get(dest.key(NAME), 0)


def assert_object(dest_url: str, data: bytes) -> None:
    dest = open_location(dest_url)
    info = dest.store.stat(dest.key(NAME))
    assert info.size == len(data)
    assert dest.store.read_range(dest.key(NAME), 0, info.size) == data
    assert info.metadata["sha256"] == hashlib.sha256(data).hexdigest()
    assert dest.store.unfinished_uploads(dest.key("")) == []
    assert sorted(dest.relative(item.key) for item in dest.list()) == sorted([MANIFEST_NAME, NAME])


@pytest.mark.parametrize("parts_done", [1, 2])
def test_a_killed_run_resumes_without_sending_the_parts_dest_holds(
    any_root: str, tmp_path: Path, parts_done: int
) -> None:
    part = part_size_of(any_root)
    data = write_source(tmp_path / "src", part, seed=parts_done)
    kill_after(str(tmp_path / "src"), any_root, parts_done)
    dest = open_location(any_root)
    left = dest.store.unfinished_uploads(dest.key(""))
    assert [dest.relative(upload.key) for upload in left] == [NAME]
    assert left[0].resume is not None  # the store tells which plan's upload it is

    result, sent = resume(str(tmp_path / "src"), any_root)
    assert sent == len(data) - parts_done * part  # only the parts DEST lacked went up again
    assert result.bytes_resumed == parts_done * part
    assert result.bytes_copied == sent
    assert result.discarded == ()
    assert_object(any_root, data)


def corrupt_part(dest_url: str, index: int, part: int) -> None:
    """Make DEST hold, for part `index` of the killed upload, bytes other than the source's."""
    dest = open_location(dest_url)
    key = dest.key(NAME)
    (upload,) = dest.store.unfinished_uploads(dest.key(""))
    garbage = random.Random(99).randbytes(part)
    store: Any = dest.store
    if dest_url.startswith("s3://"):
        client = store._client
        (item,) = client.list_multipart_uploads(Bucket=store.bucket, Prefix=key)["Uploads"]
        client.upload_part(Bucket=store.bucket, Key=key, UploadId=item["UploadId"], PartNumber=index + 1, Body=garbage)
    elif dest_url.startswith("gs://"):
        store._bucket.blob(f"{dest.prefix}/.streamctl-tmp/{upload.resume}/{NAME}/{index:05d}").upload_from_string(garbage)
    elif dest_url.startswith("az://"):
        from streamctl.storage.azure import block_id

        md5 = hashlib.md5(garbage)
        store._blob(key).stage_block(block_id(upload.resume, index, md5.hexdigest()), garbage, length=part)
    else:
        (partial,) = (Path(dest_url) / ".streamctl-tmp").glob(f"*/{NAME}")
        with open(partial, "r+b") as handle:
            handle.seek(index * part)
            handle.write(garbage)


def test_a_held_part_whose_bytes_differ_from_the_source_is_sent_again(any_root: str, tmp_path: Path) -> None:
    part = part_size_of(any_root)
    data = write_source(tmp_path / "src", part, seed=5)
    kill_after(str(tmp_path / "src"), any_root, 2)
    # Azure keeps one block per id: a foreign block goes in as a part the killed run never sent.
    corrupted = 2 if any_root.startswith("az://") else 0
    corrupt_part(any_root, corrupted, part)
    result, sent = resume(str(tmp_path / "src"), any_root)
    reused = 2 * part - (0 if corrupted == 2 else part)
    assert result.bytes_resumed == reused
    assert sent == len(data) - reused
    assert_object(any_root, data)


def test_a_changed_source_reuses_no_part(any_root: str, tmp_path: Path) -> None:
    """Other bytes of the same size: the killed upload is another version's and is discarded; and with the
    source's version made to look the same (mtime put back), every held part still fails its check."""
    part = part_size_of(any_root)
    source = tmp_path / "src"
    write_source(source, part, seed=1)
    kill_after(str(source), any_root, 2)
    changed = write_source(source, part, seed=2)
    result, sent = resume(str(source), any_root)
    assert result.bytes_resumed == 0 and sent == len(changed)
    assert result.discarded == (NAME,)
    assert_object(any_root, changed)

    other = tmp_path / "other"
    original = write_source(other, part, seed=3)
    mtime = (other / NAME).stat().st_mtime_ns
    dest_url = f"{any_root}-again" if "://" in any_root else str(Path(any_root) / "again")
    kill_after(str(other), dest_url, 2)
    changed = write_source(other, part, seed=4)
    os.utime(other / NAME, ns=(mtime, mtime))  # the listing's version (mtime and size) is the killed run's
    assert changed != original
    result, sent = resume(str(other), dest_url)
    assert result.discarded == ()  # reopened: the upload looks like this plan's ...
    assert result.bytes_resumed == 0 and sent == len(changed)  # ... but no held part matches the source
    assert_object(dest_url, changed)
