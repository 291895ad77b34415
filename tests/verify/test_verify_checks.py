"""verify_checkpoint on clean checkpoints, store trouble, per-shard rules, cost and options, with exact codes.

Most cases run on a local folder; a representative subset also runs against S3, GCS and Azure test servers
(`any_root`), since the same checkpoint builders write through any Location.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from verify_helpers import SHARD_1, SHARD_2, error_codes, findings_of, run, warning_codes

from checkpoints import (
    INDEX_NAME,
    counting,
    llama_tensors,
    put_bytes,
    put_json,
    read_object,
    rewrite_header,
    set_header_length,
    truncate_object,
    write_hf_checkpoint,
    write_index,
    write_serving_files,
    write_sharded_checkpoint,
    write_single_file_checkpoint,
    write_tensor_file,
)
from progress_helpers import RecordingProgress
from streamctl.errors import AccessDeniedError, NotFoundError, RemoteError, UsageError
from streamctl.storage.base import Location, ObjectInfo
from streamctl.verify.report import FINDINGS_PER_CODE_AND_FILE, VerifyOptions
from streamctl.verify.run import verify_checkpoint

# ---------------------------------------------------------------------------------------------------
# Clean checkpoints, on every store


def test_a_clean_hf_checkpoint_verifies_on_any_store(remote_or_local: Location) -> None:
    checkpoint = write_hf_checkpoint(remote_or_local)
    report = run(remote_or_local)
    assert report.ok and report.findings == () and report.layout == "indexed"
    assert report.stats.files == 2 and report.stats.tensors == checkpoint.tensor_count == 21
    assert report.stats.requests == 2 + 1 + 1  # one per shard, the index, config.json


def test_a_single_model_safetensors_without_index_verifies(location: Location) -> None:
    write_single_file_checkpoint(location)
    report = run(location)
    assert (report.ok, report.layout, report.findings) == (True, "single", ())


def test_a_mistral_consolidated_index_is_picked_up(location: Location) -> None:
    specs = llama_tensors(1)
    for position, name in enumerate(
        ["consolidated-00001-of-00002.safetensors", "consolidated-00002-of-00002.safetensors"]
    ):
        write_tensor_file(location, name, specs[position::2])
    weight_map = {
        spec.name: f"consolidated-0000{1 + position % 2}-of-00002.safetensors" for position, spec in enumerate(specs)
    }
    write_index(location, weight_map, sum(spec.nbytes for spec in specs), name="consolidated.safetensors.index.json")
    put_json(location, "params.json", {"dim": 8, "n_layers": 1})  # Mistral format: params.json, no config.json
    put_json(location, "tekken.json", {"config": {}})
    report = run(location)
    assert (report.layout, report.findings) == ("indexed", ())


def test_report_json_has_the_documented_shape(location: Location) -> None:
    write_hf_checkpoint(location, config=False)
    document = run(location).to_json()
    assert set(document) == {"ok", "checkpoint", "layout", "findings", "omitted", "stats"}
    assert document["ok"] is False and document["layout"] == "indexed" and document["omitted"] == {}
    assert document["findings"] == [
        {
            "severity": "error",
            "code": "config-missing",
            "file": None,
            "tensor": None,
            "message": document["findings"][0]["message"],
        }
    ]
    assert set(document["stats"]) == {"files", "tensors", "total_bytes", "bytes_read", "requests", "seconds"}
    json.dumps(document)  # serializable as is


# ---------------------------------------------------------------------------------------------------
# What the store holds: nothing, no weights, vanished objects, store errors


def test_an_empty_location_is_not_found(remote_or_local: Location) -> None:
    with pytest.raises(NotFoundError):
        run(remote_or_local)


def test_a_location_without_safetensors_is_not_found_with_a_hint(location: Location) -> None:
    write_serving_files(location)
    write_tensor_file(location, "original/model.safetensors", llama_tensors(1))
    with pytest.raises(NotFoundError) as caught:
        run(location)
    assert caught.value.hint is not None and "original/" in caught.value.hint


@dataclass
class FlakyStore:
    """Wraps a store; read_range of the keys in `fail` raises the mapped error, of those in `shortened` comes
    back one byte short (an object rewritten between the listing and the read)."""

    inner: Any
    fail: dict[str, Exception] = field(default_factory=dict)
    shortened: set[str] = field(default_factory=set)  # read_range of these keys returns one byte too few

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if key in self.fail:
            raise self.fail[key]
        data: bytes = self.inner.read_range(key, start, length)
        return data[:-1] if key in self.shortened else data


def test_an_object_gone_between_listing_and_reading_is_a_finding(location: Location) -> None:
    write_hf_checkpoint(location)
    flaky = FlakyStore(
        location.store, {location.key(SHARD_2): NotFoundError("gone"), location.key(INDEX_NAME): NotFoundError("gone")}
    )
    report = verify_checkpoint(Location(flaky, location.prefix))  # type: ignore[arg-type]
    assert findings_of(report, "object-vanished") == [(SHARD_2, None), (INDEX_NAME, None)]
    assert error_codes(report) == ["object-vanished"]


def test_a_small_object_shorter_than_listed_is_a_finding(location: Location) -> None:
    write_hf_checkpoint(location)
    flaky = FlakyStore(location.store, shortened={location.key(INDEX_NAME), location.key("config.json")})
    report = verify_checkpoint(Location(flaky, location.prefix))  # type: ignore[arg-type]
    assert findings_of(report, "object-changed") == [("config.json", None), (INDEX_NAME, None)]
    assert error_codes(report) == ["object-changed"]
    assert report.stats.requests == 2 + 1 + 1  # the short reads count as requests, as whole ones do


@pytest.mark.parametrize("error", [AccessDeniedError("denied"), RemoteError("down")])
def test_store_errors_propagate(location: Location, error: Exception) -> None:
    write_hf_checkpoint(location)
    flaky = FlakyStore(location.store, {location.key(SHARD_1): error})
    with pytest.raises(type(error)):
        verify_checkpoint(Location(flaky, location.prefix))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# Per-shard rules surface with the shard's name


def test_a_broken_header_is_reported_against_its_shard_on_any_store(remote_or_local: Location) -> None:
    write_hf_checkpoint(remote_or_local)
    set_header_length(remote_or_local, SHARD_2, 2**63)
    report = run(remote_or_local)
    assert error_codes(report) == ["header-too-large"]  # its index entries are not reported again
    assert findings_of(report, "header-too-large") == [(SHARD_2, None)]


@pytest.mark.parametrize(
    "corrupt, code",
    [
        (lambda loc: truncate_object(loc, SHARD_1, 2), "file-truncated"),
        (lambda loc: put_bytes(loc, SHARD_1, read_object(loc, SHARD_1) + b"\0"), "file-trailing-bytes"),
        (
            lambda loc: rewrite_header(
                loc,
                SHARD_1,
                lambda h: h["lm_head.weight" if "lm_head.weight" in h else "model.embed_tokens.weight"].update(
                    dtype="F99"
                ),
            ),
            "unknown-dtype",
        ),
        (lambda loc: put_bytes(loc, SHARD_1, b"12345"), "file-too-small"),
    ],
    ids=["truncated", "trailing", "dtype", "tiny"],
)
def test_shard_rules_become_findings(location: Location, corrupt: Any, code: str) -> None:
    write_hf_checkpoint(location)
    corrupt(location)
    report = run(location)
    assert error_codes(report) == [code]
    assert {finding.file for finding in report.errors} == {SHARD_1}


def test_a_shard_without_tensors_is_a_warning(location: Location) -> None:
    write_hf_checkpoint(location)
    write_tensor_file(location, "model-00003-of-00002.safetensors", [])
    report = run(location)
    assert findings_of(report, "empty-shard") == [("model-00003-of-00002.safetensors", None)]
    assert "empty-shard" in warning_codes(report) and "empty-shard" not in error_codes(report)


def test_repeated_findings_are_capped_per_code_and_file(location: Location) -> None:
    write_single_file_checkpoint(location, layers=4)

    def unknown_dtypes(header: dict[str, Any]) -> None:
        for key, value in header.items():
            if key != "__metadata__":
                value["dtype"] = "X"

    rewrite_header(location, "model.safetensors", unknown_dtypes)
    report = run(location)
    dtype_findings = [finding for finding in report.findings if finding.code == "unknown-dtype"]
    assert len(dtype_findings) == FINDINGS_PER_CODE_AND_FILE + 1
    assert sum(finding.tensor is None for finding in dtype_findings) == 1  # the summary
    assert "and 14 more" in next(finding.message for finding in dtype_findings if finding.tensor is None)


# ---------------------------------------------------------------------------------------------------
# Cost: headers only, counted exactly


def test_bytes_read_stay_tiny_and_requests_are_counted_exactly(remote_or_local: Location) -> None:
    # MLP tensors of 32 KiB each make every shard ~100x larger than its header.
    checkpoint = write_hf_checkpoint(remote_or_local, layers=4, shards=3, intermediate=2048)
    location, store = counting(remote_or_local)
    report = run(location, speculative_bytes=4096)
    assert report.findings == ()
    assert report.stats.requests == len(store.reads) == 3 + 1 + 1  # shards, index, config.json
    assert report.stats.bytes_read == store.bytes_read
    small_files = sum(len(read_object(remote_or_local, name)) for name in (INDEX_NAME, "config.json"))
    assert report.stats.bytes_read == 3 * 4096 + small_files
    assert report.stats.bytes_read * 20 < report.stats.total_bytes
    for name in checkpoint.files:
        ((_, start, length),) = store.reads_of(location.key(name))
        header_end = 8 + struct.unpack("<Q", read_object(remote_or_local, name)[:8])[0]
        assert start == 0 and header_end <= length == 4096  # the header, and not a byte of the rest


def test_a_header_longer_than_the_speculative_read_costs_exactly_two_requests(location: Location) -> None:
    checkpoint = write_hf_checkpoint(location)
    counted, store = counting(location)
    report = run(counted, speculative_bytes=64)
    for name in checkpoint.files:
        assert len(store.reads_of(location.key(name))) == 2
    assert report.stats.requests == 2 * 2 + 1 + 1 and report.findings == ()


def test_default_speculative_read_is_one_request_per_shard(location: Location) -> None:
    checkpoint = write_hf_checkpoint(location)
    counted, store = counting(location)
    report = run(counted)
    assert all(len(store.reads_of(location.key(name))) == 1 for name in checkpoint.files)
    assert report.stats.requests <= 2 * len(checkpoint.files) + 1 + 1


def test_progress_has_one_task_advanced_per_shard(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2, parts=2)
    progress = RecordingProgress()
    verify_checkpoint(location, VerifyOptions(concurrency=3), progress)
    assert progress.events[0] == ("task", 4)
    assert sorted(event for event in progress.events[1:-1]) == [("advance", (7, 1))] * 4
    assert progress.events[-1] == ("done", 7)


def test_bad_options_are_usage_errors(location: Location) -> None:
    write_single_file_checkpoint(location)
    bad: list[dict[str, Any]] = [{"concurrency": 0}, {"tensor_parallel_size": 0}, {"index_name": " "}]
    for options in bad:
        with pytest.raises(UsageError):
            run(location, **options)
