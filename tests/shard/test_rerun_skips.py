"""A `shard` re-run into its own completed output skips the rank files that are already right, as `transfer` does: same plan, unchanged source files, and each DEST file's size and stored sha256
equal to what the manifest recorded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from streamctl.errors import UsageError
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from streamctl.storage.base import Location
from tiny_models import write_tiny_checkpoint

OPTIONS = ShardOptions(tensor_parallel_size=2, max_part_size=40_000)


def rank_files(location: Location) -> dict[str, str | None]:
    """rank file -> etag (what changes when an object is written again)."""
    return {
        location.relative(info.key): location.store.stat(info.key).etag
        for info in location.list()
        if location.relative(info.key).startswith("model-rank-")
    }


@pytest.fixture
def source(tmp_path: Path) -> Location:
    return open_location(str(write_tiny_checkpoint(tmp_path / "hf", "llama-gqa")))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_rerun_skips_every_unchanged_rank_file(source: Location, backend: str, request: pytest.FixtureRequest) -> None:
    dest = open_location(request.getfixturevalue(f"{backend}_root"))
    first = shard_checkpoint(source, dest, OPTIONS)
    assert first.skipped == () and first.bytes_written > 0
    before = rank_files(dest)
    assert len(before) >= 4  # several parts per rank, so a partial rewrite is visible below
    again = shard_checkpoint(source, dest, OPTIONS)
    assert again.ok and again.bytes_written == 0
    assert sorted(again.skipped) == sorted(before)
    assert rank_files(dest) == before  # nothing was written again
    assert {file.path: file.sha256 for file in again.files} == {file.path: file.sha256 for file in first.files}


def test_rerun_rewrites_only_the_part_that_changed(source: Location, local_root: str) -> None:
    dest = open_location(local_root)
    first = shard_checkpoint(source, dest, OPTIONS)
    damaged = "model-rank-1-part-1.safetensors"
    path = Path(local_root) / damaged
    size = path.stat().st_size
    path.unlink()
    path.write_bytes(b"\0" * size)  # same size, no stored sha256: not right
    again = shard_checkpoint(source, dest, OPTIONS)
    assert again.ok
    rewritten = {"model-rank-0-part-1.safetensors", damaged}  # one part: both TP ranks come from the same reads
    assert set(again.skipped) == {file.path for file in first.files} - rewritten
    assert 0 < again.bytes_written < first.bytes_written
    assert path.read_bytes() != b"\0" * size


def test_a_changed_source_or_plan_is_not_a_rerun(source: Location, local_root: str, tmp_path: Path) -> None:
    dest = open_location(local_root)
    shard_checkpoint(source, dest, OPTIONS)
    with pytest.raises(UsageError, match="already holds"):
        shard_checkpoint(source, dest, ShardOptions(tensor_parallel_size=1, max_part_size=40_000))
    weights = tmp_path / "hf" / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10_000_000_000))  # rewritten in place
    with pytest.raises(UsageError, match="already holds"):
        shard_checkpoint(source, dest, OPTIONS)
    assert shard_checkpoint(source, dest, ShardOptions(**{**OPTIONS.__dict__, "force": True})).skipped == ()
