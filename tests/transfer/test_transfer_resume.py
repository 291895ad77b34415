"""`streamctl transfer` resumes inside a file: a run killed after k parts leaves them at DEST (S3 multipart
parts, GCS part objects, Azure uncommitted blocks, a local partial file) and the next run of the same plan
sends only the parts DEST lacks, while still reading and hashing every byte of the source; a held part
whose bytes differ from the source's is sent again, and an upload of another source version is discarded.

"Killed after k parts" is a store wrapper whose (k+1)-th part never leaves the process and whose abort does
nothing, as for a process killed outright (kill -9, an evicted pod); one test kills a real subprocess. What
the next run sends is counted by a wrapper around DEST's store (every byte handed to the store to upload).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from progress_helpers import RecordingProgress
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.errors import RemoteError
from streamctl.retry import RetryPolicy
from streamctl.storage import open_location
from streamctl.storage.base import Location, MultipartUpload, part_digest
from streamctl.storage.url import source_identity
from streamctl.transfer import TransferOptions, TransferResult, execute_transfer, plan_transfer

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

    def start_multipart(
        self, key: str, part_size: int, metadata: Any = None, content_type: Any = None, resume: Any = None
    ) -> Any:
        upload = self.inner.start_multipart(key, part_size, metadata, content_type, resume)
        limit = self.parts

        class Upload:
            def __getattr__(self, name: str) -> Any:
                return getattr(upload, name)

            def upload_part(self, index: int, data: bytes) -> None:
                if index >= limit:
                    raise Killed()
                upload.upload_part(index, data)

            def kernel_copier(self) -> None:
                return None  # parts carry the bytes, so the process dies exactly at part k

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

    def start_multipart(
        self, key: str, part_size: int, metadata: Any = None, content_type: Any = None, resume: Any = None
    ) -> Any:
        upload: MultipartUpload = self.inner.start_multipart(key, part_size, metadata, content_type, resume)
        count = self._count

        class Upload:
            def __getattr__(self, name: str) -> Any:
                return getattr(upload, name)

            def upload_part(self, index: int, data: bytes) -> None:
                count(key, len(data))
                upload.upload_part(index, data)

            def kernel_copier(self) -> Any:
                copy = upload.kernel_copier()
                if copy is None:
                    return None

                def counted(source_fd: int, offset: int, length: int) -> int:
                    copied = copy(source_fd, offset, length)
                    count(key, copied)
                    return copied

                return counted

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


def assert_object(dest_url: str, data: bytes, others: tuple[str, ...] = ()) -> None:
    dest = open_location(dest_url)
    info = dest.store.stat(dest.key(NAME))
    assert info.size == len(data)
    assert dest.store.read_range(dest.key(NAME), 0, info.size) == data
    assert info.metadata["sha256"] == hashlib.sha256(data).hexdigest()
    assert dest.store.unfinished_uploads(dest.key("")) == []
    assert sorted(dest.relative(item.key) for item in dest.list()) == sorted([MANIFEST_NAME, NAME, *others])


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
        part_object = f"{dest.prefix}/.streamctl-tmp/{upload.resume}/{NAME}/{index:05d}"
        store._bucket.blob(part_object).upload_from_string(garbage)
    elif dest_url.startswith("az://"):
        from streamctl.storage.azure import block_id

        store._blob(key).stage_block(
            block_id(upload.resume, index, part_digest("crc32", garbage)), garbage, length=part
        )
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


def test_a_subprocess_killed_with_sigkill_after_some_parts_resumes(
    s3_root: str, tmp_path: Path, storage_env: dict[str, str]
) -> None:
    """A real kill -9 once DEST holds two parts: the re-run (same plan) sends only the rest."""
    import boto3

    part = 5 * MiB
    data = random.Random(11).randbytes(9 * part + 123)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / NAME).write_bytes(data)
    dest = open_location(s3_root)
    bucket, key = s3_root.split("/")[2], dest.key(NAME)
    client = boto3.client("s3", endpoint_url=storage_env["AWS_ENDPOINT_URL"])
    arguments = [str(tmp_path / "src"), s3_root, "--all-files", "-j", "1", "--part-size", "5MiB"]
    arguments += ["--max-buffer", "5MiB"]

    def parts_held() -> int:
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
        if not uploads:
            return 0
        return len(client.list_parts(Bucket=bucket, Key=key, UploadId=uploads[0]["UploadId"]).get("Parts", []))

    process = subprocess.Popen(
        [sys.executable, "-m", "streamctl", "transfer", *arguments, "--no-verify"],
        env={**os.environ, **storage_env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while parts_held() < 2:
        assert process.poll() is None, "the transfer ended before it could be killed"
        assert time.monotonic() < deadline, "timed out waiting for two parts"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    held = parts_held()
    assert 2 <= held < 10, "the transfer finished before it could be killed"

    rerun = run_cli("transfer", *arguments, "--no-verify", "--json", env=storage_env)
    assert rerun.exit_code == 0, rerun.stderr
    document = rerun.json()
    assert document["discarded_uploads"] == []
    assert document["bytes_resumed"] >= held * part - part  # the last part listed may be one cut short
    assert document["bytes_resumed"] + document["bytes_copied"] == len(data)
    assert_object(s3_root, data)


# --------------------------------------------------------------------------------- part size limits


def test_a_part_size_below_the_destination_s_smallest_part_exits_2_naming_it(
    s3_root: str, tmp_path: Path, storage_env: dict[str, str]
) -> None:
    write_source(tmp_path / "src", MiB, seed=1)
    result = run_cli("transfer", str(tmp_path / "src"), s3_root, "--all-files", "--part-size", "1MiB", env=storage_env)
    assert result.exit_code == 2, result.stderr
    assert "S3's smallest part, 5 MiB" in result.stderr and "Traceback" not in result.stderr
    assert "--part-size 5 MiB" in result.stderr  # the hint says what to pass
    document = run_cli(
        "transfer", str(tmp_path / "src"), s3_root, "--all-files", "--part-size", "4MiB", "--json", env=storage_env
    )
    assert document.exit_code == 2 and "5 MiB" in document.json()["error"]["message"]
    assert list(open_location(s3_root).list()) == []  # refused before anything was written


def test_a_part_size_above_the_destination_s_largest_part_exits_2_naming_it(
    az_root: str, tmp_path: Path, storage_env: dict[str, str]
) -> None:
    write_source(tmp_path / "src", MiB, seed=1)
    arguments = ["--part-size", "4001MiB", "--max-buffer", "5GiB"]
    result = run_cli("transfer", str(tmp_path / "src"), az_root, "--all-files", *arguments, env=storage_env)
    assert result.exit_code == 2, result.stderr
    assert "Azure Blob's largest part, 4,000 MiB" in result.stderr


def test_a_file_that_needs_more_parts_than_the_destination_allows_gets_larger_parts(
    any_root: str, tmp_path: Path
) -> None:
    """S3 allows 10,000 parts, Azure 50,000 blocks, GCS 1,024 components (composed 32 at a time, in rounds):
    here the limit is lowered to 3 so that a small file passes it."""
    part = part_size_of(any_root)
    data = write_source(tmp_path / "src", part, seed=8)  # four parts of --part-size
    dest = open_location(any_root)
    dest.store.max_parts = 3  # type: ignore[misc]
    counting = CountingStore(dest.store)
    parts: list[int] = []
    original = counting.start_multipart

    def start(*arguments: Any, **keywords: Any) -> Any:
        upload = original(*arguments, **keywords)
        parts.append(upload.part_size)
        return upload

    counting.start_multipart = start  # type: ignore[method-assign]
    progress = RecordingProgress()
    source = open_location(str(tmp_path / "src"))
    options = options_for(any_root)
    plan = plan_transfer(source, Location(counting, dest.prefix), source_identity(source), options)
    execute_transfer(plan, source, Location(counting, dest.prefix), options, progress)
    assert parts == [2 * part if part == MiB else 6 * MiB]  # whole MiB, so that 3 parts hold the file
    logs = [message for kind, message in progress.events if kind == "log"]
    assert any("limit of 3 parts; using parts of" in line for line in logs), logs
    dest.store.max_parts = 10_000  # type: ignore[misc]
    assert_object(any_root, data)


def test_a_file_too_large_for_the_destination_is_refused_before_anything_is_written(
    s3_root: str, tmp_path: Path
) -> None:
    from streamctl.errors import UsageError

    write_source(tmp_path / "src", 5 * MiB, seed=1)  # 16.7 MiB
    dest = open_location(s3_root)
    dest.store.max_parts, dest.store.max_part_size = 2, 6 * MiB  # type: ignore[misc]
    source = open_location(str(tmp_path / "src"))
    with pytest.raises(UsageError, match=r"too large for S3: at most 2 parts of at most 6 MiB"):
        plan_transfer(source, dest, source_identity(source), options_for(s3_root))
    assert list(dest.list()) == []


class LinkLostAfterParts(KilledAfterParts):
    """DEST's store, whose link is lost for good as part `k` goes up (past every retry); aborts do work."""

    def start_multipart(
        self, key: str, part_size: int, metadata: Any = None, content_type: Any = None, resume: Any = None
    ) -> Any:
        upload = self.inner.start_multipart(key, part_size, metadata, content_type, resume)
        limit = self.parts

        class Upload:
            def __getattr__(self, name: str) -> Any:
                return getattr(upload, name)

            def upload_part(self, index: int, data: bytes) -> None:
                if index >= limit:
                    raise RemoteError("connection reset by peer (injected)")
                upload.upload_part(index, data)

            def kernel_copier(self) -> None:
                return None  # parts carry the bytes, so the link is lost exactly at part k

        return Upload()


def test_a_run_that_loses_its_link_keeps_the_parts_sent_for_the_next_run(any_root: str, tmp_path: Path) -> None:
    part = part_size_of(any_root)
    data = write_source(tmp_path / "src", part, seed=21)
    dest = open_location(any_root)
    progress = RecordingProgress()
    source = open_location(str(tmp_path / "src"))
    options = options_for(any_root)
    failing = Location(LinkLostAfterParts(dest.store, 2), dest.prefix)
    plan = plan_transfer(source, failing, source_identity(source), options)
    with pytest.raises(RemoteError):
        execute_transfer(plan, source, failing, options, progress)
    assert any("for the next run to resume: weights.bin" in m for kind, m in progress.events if kind == "log")
    assert [dest.relative(upload.key) for upload in dest.store.unfinished_uploads(dest.key(""))] == [NAME]
    result, sent = resume(str(tmp_path / "src"), any_root)
    assert result.bytes_resumed == 2 * part and sent == len(data) - 2 * part
    assert_object(any_root, data)


def test_each_backend_s_part_count_limit_raises_the_part_size(tmp_path: Path) -> None:
    """S3: 10,000 parts; Azure: 50,000 blocks; GCS: 1,024 components (compose takes 32 sources a call, and
    the GCS backend composes in rounds, so the component count is the limit); parts grow in whole MiB."""
    from streamctl.dest.uploads import part_size_for
    from streamctl.storage.azure import AzureAuth, AzureStore
    from streamctl.storage.gcs import GCSStore
    from streamctl.storage.local import LocalStore
    from streamctl.storage.s3 import S3Settings, S3Store

    s3 = S3Store("b", S3Settings(None, "auto", 1))
    azure = AzureStore("c", AzureAuth("connection string", "a"))
    gcs, local = GCSStore("b"), LocalStore(tmp_path)
    size = 100 * 1024 * MiB
    assert part_size_for(size, MiB, s3) == 11 * MiB  # 102,400 MiB / 10,000 parts, and 5 MiB at least
    assert part_size_for(size, MiB, azure) == 3 * MiB  # / 50,000 blocks
    assert part_size_for(size, MiB, gcs) == 100 * MiB  # / 1,024 components
    assert part_size_for(size, MiB, local) == MiB
    assert part_size_for(MiB, MiB, s3) == 5 * MiB  # the smallest part S3 takes (a small file: one part)
    assert part_size_for(size, 64 * MiB, s3) == 64 * MiB  # already few enough parts


def test_the_summary_says_how_much_an_earlier_run_had_sent(local_root: str, tmp_path: Path) -> None:
    data = write_source(tmp_path / "src", MiB, seed=31)
    kill_after(str(tmp_path / "src"), local_root, 2)
    options = ["--all-files", "--part-size", "1MiB", "--max-buffer", "2MiB", "--no-verify"]
    result = run_cli("transfer", str(tmp_path / "src"), local_root, *options)
    assert result.exit_code == 0, result.stderr
    assert "2.0 MiB an earlier run had sent were not sent again" in " ".join(result.stdout.split()), result.stdout
    assert_object(local_root, data)


def test_a_hub_source_resumes_at_its_commit_and_not_at_another(fake_hub: Any, gs_root: str) -> None:
    """A hub file's upload is named by the repo, the commit and the file's LFS sha256: the same revision
    resumes (the held parts are downloaded again to be hashed, not uploaded); a new commit that changed the
    file discards it."""
    part = MiB
    data = random.Random(41).randbytes(3 * part + 77)
    repo = fake_hub.add_repo("org/resume", {NAME: data, "config.json": b"{}"}, lfs_suffixes=(".bin",))
    kill_after("hf://org/resume", gs_root, 2)
    result, sent = resume("hf://org/resume", gs_root)
    assert result.bytes_resumed == 2 * part and sent == len(data) - 2 * part
    assert_object(gs_root, data, ("config.json",))

    again = f"{gs_root}-again"
    kill_after("hf://org/resume", again, 2)
    changed = random.Random(42).randbytes(len(data))
    repo.commit({NAME: changed, "config.json": b"{}"})
    result, sent = resume("hf://org/resume", again)
    assert result.discarded == (NAME,)
    assert result.bytes_resumed == 0 and sent == len(changed)
    assert_object(again, changed, ("config.json",))
