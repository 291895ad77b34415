"""`shard --worker K/N`: N runs write one run's files between them, byte for byte, each its share of the
parts; the manifest is `"complete": false` until the last share is in, and the one completing it runs the
whole set's checks. Re-running a worker is harmless; workers of different splits or plans never mix."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from split_helpers import assert_same_as_one_run, contents, manifest_of, run_together, shard_manifest
from streamctl.dest.shares import Worker
from streamctl.errors import UsageError
from streamctl.shard.plan import ShardOptions, ShardPlan
from streamctl.shard.run import shard_checkpoint
from streamctl.shard.shares import take_share
from streamctl.storage import open_location
from streamctl.storage.base import Location
from streamctl.verify.report import SHARD_INCOMPLETE_CODE
from streamctl.verify.run import verify_checkpoint
from tiny_models import write_tiny_checkpoint

# Small parts, so that three workers each get some: 4 parts of both TP ranks for the tiny Llama.
OPTIONS = ShardOptions(tensor_parallel_size=2, max_part_size=40_000, engine="offline")


@pytest.fixture
def source(tmp_path: Path) -> Location:
    return open_location(str(write_tiny_checkpoint(tmp_path / "hf", "llama-gqa", files=2)))


@pytest.fixture
def whole(source: Location, tmp_path: Path) -> dict[str, bytes]:
    """One run's files."""
    dest = open_location(str(tmp_path / "one"))
    assert shard_checkpoint(source, dest, OPTIONS).ok
    return contents(dest)


def worker_options(index: int, count: int, **changes: Any) -> ShardOptions:
    return replace(OPTIONS, worker=Worker(index, count), **changes)


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("backend", ["local", "s3", "gs"])
def test_n_workers_write_one_runs_files_and_the_last_completes_the_manifest(
    source: Location, whole: dict[str, bytes], count: int, backend: str, request: pytest.FixtureRequest
) -> None:
    dest = open_location(request.getfixturevalue(f"{backend}_root"))
    order = list(reversed(range(count)))  # any order: the split does not depend on it
    written: set[str] = set()
    for step, index in enumerate(order):
        result = shard_checkpoint(source, dest, worker_options(index, count))
        assert result.ok and result.share is not None and result.worker == Worker(index, count)
        assert result.plan.share  # a share of several parts each: every worker does part of the work
        mine = {file.path for file in result.files}
        assert mine and not mine & written  # nothing is written twice
        written |= mine
        manifest = shard_manifest(dest)
        last = step == count - 1
        assert manifest.complete is last
        assert manifest.workers is not None and manifest.workers.finished == tuple(sorted(order[: step + 1]))
        assert (result.verify is not None) is last  # verify-index --sharded: the worker completing the set
        assert result.reconstruction is not None and result.reconstruction.ok  # each checks its own parts
        if not last and backend == "local":
            incomplete = [f for f in verify_checkpoint(dest).findings if f.code == SHARD_INCOMPLETE_CODE]
            assert incomplete and "still to run: --worker" in incomplete[0].message  # refused meanwhile
    assert_same_as_one_run(contents(dest), whole)
    assert len(written) == sum(1 for name in whole if name.startswith("model-rank-"))


def test_the_split_is_balanced_by_bytes_and_holds_every_part_once(source: Location, tmp_path: Path) -> None:
    from streamctl.shard.planning import plan_shard

    plan = plan_shard(source, open_location(str(tmp_path / "x")), OPTIONS)
    for count in (2, 3, 5):
        shares = take_share(plan, Worker(0, count))[1].shares
        parts = [part for share in shares for part in share]
        assert sorted(parts) == sorted({(file.pp_rank, file.part) for file in plan.files()})
        assert all(shares) or count > len(parts)  # an empty share only with more workers than parts
        # every worker computes the same split
        assert all(take_share(plan, Worker(index, count))[1].shares == shares for index in range(count))
        sizes = [sum(file.size for file in plan.files() if (file.pp_rank, file.part) in share) for share in shares]
        largest_part = max(sum(f.size for f in plan.files() if (f.pp_rank, f.part) == part) for part in parts)
        assert max(sizes) - min(sizes) <= largest_part


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_three_worker_processes_at_once_write_one_runs_files(
    source: Location, whole: dict[str, bytes], backend: str, request: pytest.FixtureRequest
) -> None:
    root = request.getfixturevalue(f"{backend}_root")
    env = request.getfixturevalue("storage_env") if backend != "local" else None
    common = ["shard", source.url, root, "-tp", "2", "--max-part-size", "40000", "--engine", "offline", "--json"]
    documents = run_together([[*common, "--worker", f"{index}/3"] for index in range(3)], env)
    assert sorted(document["worker"]["index"] for document in documents) == [0, 1, 2]
    assert [document["worker"]["complete"] for document in documents].count(True) == 1  # exactly one completed it
    completer = next(document for document in documents if document["worker"]["complete"])
    assert completer["checks"]["verify"]["ok"] is True
    dest = open_location(root)
    assert_same_as_one_run(contents(dest), whole)


def test_more_workers_than_parts_leave_the_extra_shares_nothing_to_do(
    source: Location, whole: dict[str, bytes], local_root: str
) -> None:
    dest = open_location(local_root)
    count = 10  # the tiny model has 4 parts
    busy = [index for index in range(count) if take_share(_plan(source), Worker(index, count))[1].parts]
    assert len(busy) == 4
    for index in busy:  # the empty shares need not run: they count as finished from the start
        shard_checkpoint(source, dest, worker_options(index, count))
    assert shard_manifest(dest).complete is True
    assert_same_as_one_run(contents(dest), whole)
    idle = shard_checkpoint(source, dest, worker_options(9, count))  # and running one is harmless
    assert idle.ok and idle.files == () and idle.share is not None and idle.share.complete


def _plan(source: Location) -> ShardPlan:
    from streamctl.shard.planning import plan_shard

    return plan_shard(source, open_location("/nonexistent-dest"), OPTIONS)


def test_rerunning_a_worker_is_harmless(source: Location, whole: dict[str, bytes], local_root: str) -> None:
    dest = open_location(local_root)
    first = shard_checkpoint(source, dest, worker_options(1, 3))
    again = shard_checkpoint(source, dest, worker_options(1, 3))  # before the others: its share is recorded
    assert again.ok and again.bytes_written == 0 and sorted(again.skipped) == sorted(f.path for f in first.files)
    assert shard_manifest(dest).workers.finished == (1,)  # type: ignore[union-attr]
    shard_checkpoint(source, dest, worker_options(0, 3))
    shard_checkpoint(source, dest, worker_options(2, 3))
    done = contents(dest)
    assert_same_as_one_run(done, whole)
    for index in range(3):  # after the set is complete: nothing is written, the manifest stays complete
        rerun = shard_checkpoint(source, dest, worker_options(index, 3))
        assert rerun.ok and rerun.bytes_written == 0 and rerun.share is not None and rerun.share.complete
    assert contents(dest) == done
    # A damaged file of share 2: its re-run rewrites its own share only, and completes the set again.
    damaged = sorted(shard_checkpoint(source, dest, worker_options(2, 3)).skipped)[0]
    path = Path(local_root) / damaged
    size = path.stat().st_size
    path.unlink()
    path.write_bytes(b"\0" * size)
    repaired = shard_checkpoint(source, dest, worker_options(2, 3))
    assert repaired.ok and repaired.share is not None and repaired.share.complete
    assert repaired.bytes_written > 0 and damaged not in repaired.skipped
    assert_same_as_one_run(contents(dest), whole)


def test_workers_of_another_split_or_plan_start_the_record_again(
    source: Location, whole: dict[str, bytes], local_root: str
) -> None:
    dest = open_location(local_root)
    shard_checkpoint(source, dest, worker_options(0, 2))
    other = shard_checkpoint(source, dest, worker_options(1, 3))  # another count: its record starts afresh
    assert other.share is not None and other.share.restarted and 1 in other.share.finished
    # ...keeping as finished the shares of 3 whose files 0/2 wrote right for this very plan (sha256 checked)
    first = {file.path for file in shard_checkpoint(source, dest, worker_options(0, 2)).files}
    for index in other.share.finished:
        parts = take_share(other.plan, Worker(index, 3))[1].shares[index]
        names = {file.name for file in other.plan.files() if (file.pp_rank, file.part) in parts}
        assert index == 1 or names <= first
    # another plan (its parts differ) with the same count: afresh again, never mixed with 1/3's files
    changed = shard_checkpoint(source, dest, worker_options(0, 3, max_part_size=60_000, force=True))
    assert changed.share is not None and changed.share.restarted and changed.share.finished == (0,)
    for index in range(3):
        shard_checkpoint(source, dest, worker_options(index, 3, force=True))
    assert shard_manifest(dest).complete is True
    assert_same_as_one_run(contents(dest), whole)


def test_a_whole_run_finishes_what_a_split_began(source: Location, whole: dict[str, bytes], local_root: str) -> None:
    dest = open_location(local_root)
    share = shard_checkpoint(source, dest, worker_options(0, 2))
    result = shard_checkpoint(source, dest, OPTIONS)  # no --force needed, and share 0's files are kept
    assert result.ok and set(result.skipped) == {file.path for file in share.files}
    assert manifest_of(contents(dest)) == manifest_of(whole)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--worker", "3/3"], "the index must be from 0 to 2"),
        (["--worker", "0/0"], "the number of workers must be from 1"),
        (["--worker", "one/3"], "expected K/N"),
        (["--worker", "0/2", "--engine", "vllm-gpu"], "cannot be split between workers"),
        (["--parallelism", "2"], "--parallelism applies only with --k8s-job"),
    ],
)
def test_a_wrong_worker_is_exit_2_with_one_line(extra: list[str], message: str, tmp_path: Path) -> None:
    source = write_tiny_checkpoint(tmp_path / "hf", "llama-gqa")
    result = run_cli("shard", str(source), str(tmp_path / "out"), "-tp", "2", *extra)
    assert result.exit_code == 2, result.stderr
    assert message in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    as_json = run_cli("shard", str(source), str(tmp_path / "out"), "-tp", "2", *extra, "--json")
    assert as_json.exit_code == 2 and json.loads(as_json.stdout)["error"]


def test_vllm_gpu_is_refused_for_a_split_by_the_library_too(source: Location, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot be split between workers"):
        shard_checkpoint(source, open_location(str(tmp_path / "out")), worker_options(0, 2, engine="vllm-gpu"))


def test_a_whole_run_and_workers_of_another_count_wait_for_a_live_worker(source: Location, local_root: str) -> None:
    from streamctl.dest.lease import hold_lease
    from streamctl.errors import DestinationBusy
    from streamctl.progress import NULL_PROGRESS

    dest = open_location(local_root)
    with hold_lease(dest, "streamctl shard SOURCE --worker 0/2", NULL_PROGRESS, worker=Worker(0, 2)):
        for options in (OPTIONS, worker_options(0, 3), worker_options(0, 2)):
            with pytest.raises(DestinationBusy):
                shard_checkpoint(source, dest, options)
        assert shard_checkpoint(source, dest, worker_options(1, 2)).ok  # another share of the same split runs
