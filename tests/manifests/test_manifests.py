"""streamctl.dest.manifests: DEST's manifests written byte-for-byte as before the types (golden/ holds the bytes the
code before them wrote for the inputs in manifest_inputs.py), one reader for both (missing, wrong-typed and
extra keys, oversize files) and one completeness rule for both commands."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, cast

import manifest_inputs as inputs
import pytest

import streamctl.dest.manifests as manifests
from streamctl.checkpoint.files import MANIFEST_NAME, SHARD_MANIFEST_NAME
from streamctl.dest.manifests import (
    MAX_MANIFEST_BYTES,
    DestManifests,
    FileEntry,
    ShardManifest,
    TransferManifest,
    Workers,
    is_complete,
    manifest_body,
    parse_manifest,
    read_dest_manifests,
)
from streamctl.dest.ownership import manifest_paths, written_by_streamctl
from streamctl.dest.shares import ShareFields, Worker, manifest_incomplete, record_share
from streamctl.dest.uploads import SHA256_KEY
from streamctl.shard.result import completed_manifest, started_manifest, write_incomplete_manifest
from streamctl.storage import open_location
from streamctl.transfer import FilePlan, TransferPlan, transfer_manifest

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(autouse=True)
def fixed_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clock and version the golden files were written with."""
    monkeypatch.setattr(manifests, "datetime", inputs.FixedClock)
    monkeypatch.setattr(manifests, "__version__", inputs.VERSION)


def golden(name: str) -> bytes:
    return (GOLDEN / f"{name}.json").read_bytes()


def _plan(commit: str | None) -> TransferPlan:
    files = tuple(FilePlan(f.path, f.size, None, None, "copy", "") for f in inputs.COPIED)
    return TransferPlan(inputs.TRANSFER_SOURCE, "s3://bucket/dest", commit, files, (), inputs.CLEANUP)


# -- byte for byte ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("label", "commit"), [("transfer", inputs.TRANSFER_COMMIT), ("transfer-no-commit", None)])
def test_a_whole_transfer_writes_the_bytes_it_wrote_before(label: str, commit: str | None) -> None:
    assert manifest_body(transfer_manifest(_plan(commit), inputs.COPIED)) == golden(label)


def test_transfer_workers_write_the_bytes_they_wrote_before(tmp_path: Path) -> None:
    """Through record_share, into a real (local) DEST: the first share (incomplete, naming every planned
    path), then the last (complete), each with the sha256 of its bytes as metadata."""
    dest = open_location(str(tmp_path / "dest"))
    for index, share in enumerate(inputs.WORKER_SHARES):
        files = tuple(FileEntry(f.path, f.size, f.sha256) for f in share)
        cleanup = inputs.CLEANUP
        fields = ShareFields(
            inputs.TRANSFER_SOURCE, inputs.TRANSFER_COMMIT, files, cleanup.older_files, cleanup.to_remove,
            inputs.WORKER_PLAN,
        )  # fmt: skip
        record = record_share(dest, fields, Worker(index, 2), inputs.WORKER_DIGEST)
        assert record.complete is (index == 1)
        written = (tmp_path / "dest" / MANIFEST_NAME).read_bytes()
        assert written == golden(f"transfer-worker-{index}-of-2")
        info = dest.store.stat(dest.key(MANIFEST_NAME))
        assert info.metadata.get(SHA256_KEY) in (None, hashlib.sha256(written).hexdigest())


def test_a_shard_run_writes_the_started_manifest_it_wrote_before(tmp_path: Path) -> None:
    assert manifest_body(started_manifest(**inputs.SHARD_STARTED)) == golden("shard-started")  # type: ignore[arg-type]
    dest = open_location(str(tmp_path))
    write_incomplete_manifest(dest, started_manifest(**inputs.SHARD_STARTED))  # type: ignore[arg-type]
    assert (tmp_path / SHARD_MANIFEST_NAME).read_bytes() == golden("shard-started")


@pytest.mark.parametrize("label", ["offline", "vllm-cpu"])
def test_a_shard_run_writes_the_completed_manifest_it_wrote_before(label: str) -> None:
    result = inputs.shard_results()[label]
    assert manifest_body(completed_manifest(cast(Any, result))) == golden(f"shard-{label}")


@pytest.mark.parametrize("name", sorted(path.stem for path in GOLDEN.glob("*.json")))
def test_what_streamctl_wrote_reads_back_and_writes_the_same_bytes(name: str) -> None:
    manifest: TransferManifest | ShardManifest | None
    if name.startswith("shard"):
        manifest = parse_manifest(ShardManifest, golden(name))
    else:
        manifest = parse_manifest(TransferManifest, golden(name))
    assert manifest is not None
    assert manifest_body(manifest) == golden(name)


def test_the_engine_settings_are_read_as_such() -> None:
    manifest = parse_manifest(ShardManifest, golden("shard-vllm-cpu"))
    assert manifest is not None and manifest.extra == {}
    assert manifest.engine_settings["served_dtype"] == "bfloat16" and manifest.engine_settings["quantization"] is None
    assert manifest.vllm_version == "0.33.0" and manifest.ranks[0].files[0].tensors[0].shape == (4, 2)


# -- the reader ------------------------------------------------------------------------------------------------


def test_keys_older_versions_did_not_write_take_their_defaults() -> None:
    transfer = TransferManifest.from_json({"tool": "streamctl", "files": [{"path": "model.safetensors"}]})
    assert transfer == TransferManifest(None, None, (FileEntry("model.safetensors"),), tool="streamctl")
    assert transfer is not None and is_complete(transfer) and transfer.older_files == () and transfer.workers is None
    shard = ShardManifest.from_json({"tool": "streamctl", "complete": False})
    assert shard is not None and shard.source is None and shard.planned is None and not is_complete(shard)
    first = ShardManifest.from_json({"source": "hf://org/m", "ranks": [], "files": []})  # before "complete"
    assert first is not None and first.complete is None and is_complete(first)


@pytest.mark.parametrize(
    "document",
    [
        {"source": 3},
        {"commit": ["a"]},
        {"files": {"path": "a"}},
        {"files": [{"path": 1}]},
        {"files": [{"size": 1}]},
        {"files": ["a"]},
        {"files": [{"path": "a", "size": "1"}]},
        {"files": [{"path": "a", "size": True}]},
        {"older_files": ["a", 2]},
        {"complete": "no"},
        {"complete": 0},
        {"workers": [0, 1]},
        {"workers": {"count": "2"}},
        {"workers": {"count": 2, "finished": [0, "1"]}},
        {"planned": "a"},
        [],
        "manifest",
    ],
)
def test_a_wrong_typed_transfer_manifest_is_unreadable(document: object) -> None:
    assert TransferManifest.from_json(document) is None
    assert parse_manifest(TransferManifest, json.dumps(document).encode()) is None


@pytest.mark.parametrize(
    "document",
    [
        {"complete": "false"},
        {"tensor_parallel_size": 2.0},
        {"tensor_parallel_size": False},
        {"pattern": None, "engine": 1},
        {"max_part_size": "1 GiB"},
        {"source_files": [["a", 1]]},
        {"source_files": [["a", "1", None]]},
        {"source_files": [["a", 1, 5]]},
        {"ranks": [{"pp_rank": 0, "tp_rank": 0, "files": [{"path": "r", "tensors": [{"name": "x"}]}]}]},
        {"ranks": [{"files": [{"path": "r", "tensors": [{"name": "x", "dtype": "F32", "shape": [1.5]}]}]}]},
        {"ranks": [{"files": [{"part": 0}]}]},
        {"ranks": ["r"]},
        {"ranks": [{"tp_rank": "0"}]},
        {"older_files": "a"},
    ],
)
def test_a_wrong_typed_shard_manifest_is_unreadable_and_so_incomplete(document: object) -> None:
    manifest = parse_manifest(ShardManifest, json.dumps(document).encode())
    assert manifest is None and not is_complete(manifest)


def test_unknown_keys_are_kept_and_written_after_the_known_ones() -> None:
    document = {
        "tool": "streamctl", "future": {"a": 1}, "source": "s", "commit": None,
        "files": [{"path": "a", "size": 1, "sha256": "x", "mode": 420}], "older_files": [],
    }  # fmt: skip
    manifest = TransferManifest.from_json(document)
    assert manifest is not None and manifest.extra == {"future": {"a": 1}}
    assert manifest.files[0].extra == {"mode": 420}
    assert list(manifest.to_json()) == ["tool", "source", "commit", "files", "older_files", "future"]
    assert manifest.to_json()["files"] == [{"path": "a", "size": 1, "sha256": "x", "mode": 420}]
    shard = ShardManifest.from_json({"complete": True, "layout": "l", "new_setting": 1, "dtype": "auto", "later": 2})
    assert shard is not None and shard.engine_settings == {"new_setting": 1} and shard.extra == {"later": 2}
    assert list(shard.to_json())[-1] == "later"


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'"x"', b"{" * 100_000, b"\xff\xfe"])
def test_what_is_not_a_json_object_is_unreadable(body: bytes) -> None:
    assert parse_manifest(TransferManifest, body) is None and parse_manifest(ShardManifest, body) is None


def test_an_oversize_manifest_is_unreadable_and_never_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = b'{"complete": true}'
    assert parse_manifest(ShardManifest, body) is not None
    assert parse_manifest(ShardManifest, body + b" " * (MAX_MANIFEST_BYTES - len(body) + 1)) is None
    (tmp_path / SHARD_MANIFEST_NAME).write_bytes(body)
    (tmp_path / MANIFEST_NAME).write_bytes(b'{"source": "s"}')
    dest = open_location(str(tmp_path))
    read = read_dest_manifests(dest, {SHARD_MANIFEST_NAME: len(body), MANIFEST_NAME: 15})
    assert read.shard == ShardManifest(complete=True) and read.transfer is not None and read.transfer.source == "s"
    reads: list[str] = []
    original = dest.store.read_range

    def counted(key: str, *rest: Any) -> bytes:
        reads.append(key)
        return original(key, *rest)

    monkeypatch.setattr(dest.store, "read_range", counted)
    listed = read_dest_manifests(dest, {SHARD_MANIFEST_NAME: MAX_MANIFEST_BYTES + 1, "config.json": 2})
    assert listed == DestManifests(frozenset({SHARD_MANIFEST_NAME})) and reads == []


# -- one completeness rule -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("complete", "expected"), [(None, True), (True, True), (False, False)], ids=["no-key", "true", "false"]
)
def test_one_completeness_rule_for_both_commands(complete: bool | None, expected: bool) -> None:
    document = {} if complete is None else {"complete": complete}
    transfer, shard = TransferManifest.from_json(document), ShardManifest.from_json(document)
    assert is_complete(transfer) is expected and is_complete(shard) is expected
    assert is_complete(None) is False
    assert (manifest_incomplete(transfer) is None) is expected  # type: ignore[arg-type]


def test_the_reason_a_worker_copy_is_incomplete_names_the_shares_still_to_run() -> None:
    manifest = TransferManifest("s", None, complete=False, workers=Workers(4, "p", (0, 2)))
    assert manifest_incomplete(manifest) == "2 of 4 `--worker` shares finished; still to run: --worker 1/4, 3/4"
    assert manifest_incomplete(TransferManifest("s", None, complete=False)) == (
        "a `--worker` copy has not finished every share"
    )


# -- what the manifests name -----------------------------------------------------------------------------------


def test_every_path_a_manifest_names_is_streamctls() -> None:
    shard = parse_manifest(ShardManifest, golden("shard-offline"))
    worker = parse_manifest(TransferManifest, golden("transfer-worker-0-of-2"))
    assert shard is not None and worker is not None
    assert {"model-rank-0-part-1.safetensors", "config.json", "earlier-run.safetensors"} <= manifest_paths(shard)
    assert set(inputs.WORKER_PLAN) <= manifest_paths(worker) and "stale.bin" in manifest_paths(worker)
    unsafe = TransferManifest("s", None, (FileEntry("../outside"), FileEntry("/abs")), ("ok.bin",))
    assert manifest_paths(unsafe) == {"ok.bin"}
    found = DestManifests(
        frozenset({MANIFEST_NAME, SHARD_MANIFEST_NAME}), None, ShardManifest(False, pattern=inputs.PATTERN)
    )
    existing = [MANIFEST_NAME, SHARD_MANIFEST_NAME, "model-rank-3-part-0.safetensors", "mine.txt"]
    assert written_by_streamctl(found, existing) == set(existing) - {"mine.txt"}
