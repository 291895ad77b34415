"""The storage contract's conditional writes (create_if_absent, read_versioned, replace_if_version,
delete_if_version) and upload start times, on every backend: a local folder, S3 (moto), GCS
(gcp-storage-emulator, patched for ifGenerationMatch: tests/patched_servers.py) and Azure (Azurite).

These are what the DEST lease (streamctl.dest.lease) relies on: of racing writers exactly one wins, and a loser
always gets PreconditionFailed, never a silent overwrite.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from streamctl.dest.uploads import discard_unfinished_uploads
from streamctl.errors import NotFoundError, PreconditionFailed
from streamctl.progress import NULL_PROGRESS
from streamctl.storage import Location, StorageOptions, open_location
from streamctl.storage.base import LEASE_NAME

OPTIONS = StorageOptions(max_attempts=2)


def open_root(url: str) -> Location:
    return open_location(url, OPTIONS)


def test_create_if_absent_refuses_an_existing_object_and_keeps_it(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("lease")
    version = root.store.create_if_absent(key, b"first")
    with pytest.raises(PreconditionFailed):
        root.store.create_if_absent(key, b"second")
    assert root.store.read_versioned(key) == (b"first", version)
    root.store.put(root.key("plain"), b"old")
    with pytest.raises(PreconditionFailed):  # an object written any other way counts too
        root.store.create_if_absent(root.key("plain"), b"new")
    assert root.store.read_range(root.key("plain"), 0, 10) == b"old"


def test_of_racing_creators_exactly_one_wins(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("race")
    barrier = threading.Barrier(8)

    def attempt(index: int) -> str | None:
        barrier.wait()
        try:
            root.store.create_if_absent(key, f"writer {index}".encode())
            return f"writer {index}"
        except PreconditionFailed:
            return None

    with ThreadPoolExecutor(8) as pool:
        winners = [result for result in pool.map(attempt, range(8)) if result]
    assert len(winners) == 1
    assert root.store.read_versioned(key)[0] == winners[0].encode()


def test_replace_if_version_is_compare_and_swap(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("lease")
    first = root.store.create_if_absent(key, b"one")
    second = root.store.replace_if_version(key, b"two", first)
    assert second != first
    assert root.store.read_versioned(key) == (b"two", second)
    with pytest.raises(PreconditionFailed):  # a writer still holding the old version loses
        root.store.replace_if_version(key, b"stale writer", first)
    assert root.store.read_versioned(key) == (b"two", second)
    # The version returned is the one the next conditional call needs (S3's ETag is the bytes' MD5, so the
    # lease makes every body unique with a per-run token and the time).
    third = root.store.replace_if_version(key, b"three", second)
    with pytest.raises(PreconditionFailed):
        root.store.replace_if_version(key, b"stale writer", second)
    assert root.store.read_versioned(key) == (b"three", third)


def test_of_racing_replacers_of_one_version_exactly_one_wins(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("lease")
    version = root.store.create_if_absent(key, b"stale")
    barrier = threading.Barrier(6)

    def attempt(index: int) -> bool:
        barrier.wait()
        try:
            root.store.replace_if_version(key, f"taken by {index}".encode(), version)
            return True
        except PreconditionFailed:
            return False

    with ThreadPoolExecutor(6) as pool:
        assert sum(pool.map(attempt, range(6))) == 1


def test_conditional_calls_on_a_missing_object(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("gone")
    version = root.store.create_if_absent(key, b"x")
    root.store.delete(key)
    with pytest.raises(NotFoundError):
        root.store.read_versioned(key)
    with pytest.raises(PreconditionFailed):
        root.store.replace_if_version(key, b"y", version)
    with pytest.raises(PreconditionFailed):
        root.store.delete_if_version(key, version)
    with pytest.raises(NotFoundError):  # the failed replace did not create it
        root.store.read_versioned(key)


def test_delete_if_version_deletes_only_that_version(any_root: str) -> None:
    root = open_root(any_root)
    key = root.key("lease")
    first = root.store.create_if_absent(key, b"one")
    second = root.store.replace_if_version(key, b"two", first)
    with pytest.raises(PreconditionFailed):
        root.store.delete_if_version(key, first)
    assert root.store.read_versioned(key) == (b"two", second)
    root.store.delete_if_version(key, second)
    with pytest.raises(NotFoundError):
        root.store.read_versioned(key)
    root.store.create_if_absent(key, b"again")  # free again after the delete


def test_lease_objects_are_hidden_from_folder_listings(any_root: str) -> None:
    root = open_root(any_root)
    root.store.put(root.key("config.json"), b"{}")
    root.store.create_if_absent(root.key(LEASE_NAME), b"{}")
    root.store.create_if_absent(root.key(f"sub/{LEASE_NAME}"), b"{}")
    assert [root.relative(info.key) for info in root.list()] == ["config.json"]
    assert LEASE_NAME in [key.rpartition("/")[2] for key in (info.key for info in root.store.list(root.key("")))]


def test_unfinished_uploads_carry_their_start_time_and_recent_ones_are_kept(any_root: str) -> None:
    """An upload begun after the cut-off (a live writer's) is never discarded; an older one is."""
    root = open_root(any_root)
    part = b"p" * max(root.store.min_part_size, 8)
    old = root.store.start_multipart(root.key("old.bin"), len(part))
    old.upload_part(0, part)
    time.sleep(1.5)  # S3 and Azure times have one-second or millisecond resolution
    cutoff = datetime.now(UTC)
    time.sleep(1.5)
    live = root.store.start_multipart(root.key("live.bin"), len(part))
    live.upload_part(0, part)
    uploads = {root.relative(upload.key): upload for upload in root.store.unfinished_uploads(root.key(""))}
    assert set(uploads) == {"old.bin", "live.bin"}
    for upload in uploads.values():
        assert upload.started is not None and upload.started.tzinfo is not None
        assert abs(upload.started - cutoff) < timedelta(minutes=5)  # a real time, not a placeholder
    assert uploads["old.bin"].started < cutoff <= uploads["live.bin"].started

    discarded = discard_unfinished_uploads(root, lambda name: True, NULL_PROGRESS, cutoff)
    assert discarded == ("old.bin",)
    assert [root.relative(upload.key) for upload in root.store.unfinished_uploads(root.key(""))] == ["live.bin"]
    live.complete()  # the live writer finishes undisturbed
    assert root.store.read_range(root.key("live.bin"), 0, 3) == b"ppp"


def test_conditional_writes_survive_the_temporary_folder_vanishing_under_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local conditional write makes `.streamctl-tmp/TOKEN` for its temporary file while other writes'
    clean-ups may remove the emptied `.streamctl-tmp` (seen: six racing `--worker` shares, one failing). A
    write that loses that race makes the folder again, as uploads do. The race is made to happen: another
    clean-up removes `.streamctl-tmp` just before each of the first two attempts to make TOKEN in it (the
    second defeats pathlib's own one retry)."""
    import os

    from streamctl.storage.base import TEMPORARY_FOLDER

    real_mkdir = Path.mkdir
    lost: list[Path] = []

    def mkdir_losing_twice(path: Path, *args: object, **kwargs: object) -> None:
        if path.parent.name == TEMPORARY_FOLDER and len(lost) < 2 and path.parent.exists():
            os.rmdir(path.parent)  # another write's clean-up wins the race
            lost.append(path)
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]

    dest = open_root(str(tmp_path))
    monkeypatch.setattr(Path, "mkdir", mkdir_losing_twice)
    version = dest.store.create_if_absent(dest.key("manifest.json"), b"1")
    assert len(lost) == 2  # the race really happened
    lost.clear()
    dest.store.replace_if_version(dest.key("manifest.json"), b"2", version)
    assert len(lost) == 2
    assert (tmp_path / "manifest.json").read_bytes() == b"2"
    assert not (tmp_path / TEMPORARY_FOLDER).exists()
