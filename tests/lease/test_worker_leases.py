"""Leases of `transfer --worker K/N` runs (streamctl.dest.lease): N workers write one DEST together, each under its
own lease; a whole-DEST run and worker runs exclude each other, as do two runs of one share and workers of
different counts; stale worker leases exclude nobody; the leases never show in a listing."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.dest.lease import Holder, LeaseSettings, acquire, lease_name
from streamctl.dest.shares import Worker
from streamctl.errors import DestinationBusy
from streamctl.progress import NullProgress
from streamctl.storage import open_location
from streamctl.storage.base import LEASE_NAME, Location

SETTINGS = LeaseSettings(ttl_s=30, heartbeat_s=10)
BUSY = 7


def _dest(root: str, tmp_path: Path, request: pytest.FixtureRequest) -> Location:
    url = str(tmp_path / "dest") if root == "local" else f"{request.getfixturevalue(root)}/model"
    return open_location(url)


@pytest.mark.parametrize("root", ["local", "s3_root", "gs_root", "az_root"])
def test_workers_of_one_split_hold_their_leases_together(
    root: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    dest = _dest(root, tmp_path, request)
    leases = [acquire(dest, "w", NullProgress(), SETTINGS, Worker(index, 3)) for index in range(3)]
    try:
        assert sorted(lease.name for lease in leases) == [f"{LEASE_NAME}.worker-{k}-of-3" for k in range(3)]
        assert list(dest.list()) == []  # leases are the runs', never the model's: hidden from every listing
        with pytest.raises(DestinationBusy, match="being written by another streamctl run"):
            acquire(dest, "whole", NullProgress(), SETTINGS)  # a whole-DEST run while workers write
        with pytest.raises(DestinationBusy):
            acquire(dest, "again", NullProgress(), SETTINGS, Worker(1, 3))  # the same share twice
        with pytest.raises(DestinationBusy):
            acquire(dest, "other split", NullProgress(), SETTINGS, Worker(0, 4))  # shares of another split
    finally:
        for lease in leases:
            lease.release()
    assert not [info for info in dest.store.list(dest.key("")) if LEASE_NAME in info.key]  # all released
    whole = acquire(dest, "whole", NullProgress(), SETTINGS)  # free again
    whole.release()


@pytest.mark.parametrize("root", ["local", "s3_root", "gs_root", "az_root"])
def test_a_whole_dest_run_keeps_workers_out_and_they_leave_no_lease(
    root: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    dest = _dest(root, tmp_path, request)
    whole = acquire(dest, "streamctl transfer whole", NullProgress(), SETTINGS)
    try:
        for worker in (Worker(0, 3), Worker(2, 3), Worker(0, 1)):
            with pytest.raises(DestinationBusy, match="streamctl transfer whole"):
                acquire(dest, "w", NullProgress(), SETTINGS, worker)
        names = sorted(info.key.rpartition("/")[2] for info in dest.store.list(dest.key("")))
        assert names == [LEASE_NAME]  # a refused worker removed its own lease again
    finally:
        whole.release()


def test_a_stale_worker_lease_excludes_nobody(tmp_path: Path) -> None:
    dest = open_location(str(tmp_path))
    past = datetime.now(UTC) - timedelta(hours=1)
    gone = Holder(
        "y" * 32, "evicted-pod", 1, "streamctl transfer --worker 1/3", past, past, past + timedelta(minutes=2)
    )
    dest.store.create_if_absent(dest.key(lease_name(Worker(1, 3))), gone.to_bytes())
    whole = acquire(dest, "whole", NullProgress(), SETTINGS)
    whole.release()
    other_split = acquire(dest, "w", NullProgress(), SETTINGS, Worker(0, 2))
    other_split.release()
    retried = acquire(dest, "w", NullProgress(), SETTINGS, Worker(1, 3))  # its own share: taken over
    assert retried.taken_over is not None and retried.taken_over.host == "evicted-pod"
    retried.release()


def test_lease_names_are_reserved_only_in_their_exact_shapes(tmp_path: Path) -> None:
    (tmp_path / f"{LEASE_NAME}.worker-0-of-2").write_text("{}")
    for data in (f"{LEASE_NAME}.notes", f"{LEASE_NAME}.worker-x-of-2", f"{LEASE_NAME}-worker-0-of-2"):
        (tmp_path / data).write_text("mine")
    listed = sorted(info.key for info in open_location(str(tmp_path)).list())
    assert listed == sorted([f"{LEASE_NAME}-worker-0-of-2", f"{LEASE_NAME}.notes", f"{LEASE_NAME}.worker-x-of-2"])


def test_a_plain_transfer_is_refused_while_a_worker_writes(tmp_path: Path) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "llama"}))
    dest = open_location(str(tmp_path / "dest"))
    worker = acquire(dest, "streamctl transfer model --worker 1/2", NullProgress(), SETTINGS, Worker(1, 2))
    try:
        refused = run_cli("transfer", str(source), str(tmp_path / "dest"), "--no-verify")
        assert refused.exit_code == BUSY, refused.stderr
        assert "--worker 1/2" in refused.stderr
        same_share = run_cli("transfer", str(source), str(tmp_path / "dest"), "--no-verify", "--worker", "1/2")
        assert same_share.exit_code == BUSY, same_share.stderr
        other_share = run_cli("transfer", str(source), str(tmp_path / "dest"), "--no-verify", "--worker", "0/2")
        assert other_share.exit_code == 0, other_share.stderr  # the other share runs beside it
    finally:
        worker.release()
    assert sorted(path.name for path in (tmp_path / "dest").iterdir()) == ["config.json", "streamctl-manifest.json"]
