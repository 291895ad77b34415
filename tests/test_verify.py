"""verify_checkpoint: one case per index, serving-readiness, --expect and sharded rule, with exact codes.

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
from checkpoints import (
    INDEX_NAME,
    TensorSpec,
    counting,
    delete_object,
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
from streamctl.verify import run as verify_module
from streamctl.errors import AccessDeniedError, NotFoundError, RemoteError, UsageError
from streamctl.checkpoint.sharded_names import (
    DEFAULT_PATTERN,
    DEFAULT_PP_PATTERN,
    format_name,
    match_sharded,
    rank_loading,
    validate_pattern,
)
from streamctl.storage import open_location
from streamctl.storage.base import Location, ObjectInfo
from streamctl.verify.run import (
    FINDINGS_PER_CODE_AND_FILE,
    Expectation,
    VerifyOptions,
    VerifyReport,
    parse_expectation,
    verify_checkpoint,
)

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"


@pytest.fixture
def location(local_root: str) -> Location:
    return open_location(local_root)


@pytest.fixture
def remote_or_local(any_root: str) -> Location:
    return open_location(any_root)


def run(location: Location, **options: Any) -> VerifyReport:
    return verify_checkpoint(location, VerifyOptions(**options))


def error_codes(report: VerifyReport) -> list[str]:
    return sorted({finding.code for finding in report.errors})


def warning_codes(report: VerifyReport) -> list[str]:
    return sorted({finding.code for finding in report.warnings})


def findings_of(report: VerifyReport, code: str) -> list[tuple[str | None, str | None]]:
    return sorted((finding.file, finding.tensor) for finding in report.findings if finding.code == code)


def edit_index(location: Location, change: Any) -> None:
    index = json.loads(read_object(location, INDEX_NAME))
    change(index)
    put_json(location, INDEX_NAME, index)


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
    assert set(document) == {"ok", "checkpoint", "layout", "findings", "stats"}
    assert document["ok"] is False and document["layout"] == "indexed"
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
    """Wraps a store; read_range of the keys in `fail` raises the mapped error."""

    inner: Any
    fail: dict[str, Exception] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if key in self.fail:
            raise self.fail[key]
        return self.inner.read_range(key, start, length)


def test_an_object_gone_between_listing_and_reading_is_a_finding(location: Location) -> None:
    write_hf_checkpoint(location)
    flaky = FlakyStore(
        location.store, {location.key(SHARD_2): NotFoundError("gone"), location.key(INDEX_NAME): NotFoundError("gone")}
    )
    report = verify_checkpoint(Location(flaky, location.prefix))  # type: ignore[arg-type]
    assert findings_of(report, "object-vanished") == [(SHARD_2, None), (INDEX_NAME, None)]
    assert error_codes(report) == ["object-vanished"]


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
# Index rules


def test_unparseable_index(location: Location) -> None:
    write_hf_checkpoint(location)
    put_bytes(location, INDEX_NAME, b'{"weight_map": {"a": "b"')
    assert error_codes(run(location)) == ["index-invalid"]


@pytest.mark.parametrize("document", [[], {"metadata": {}}, {"weight_map": {"a": 1}}, {"weight_map": []}])
def test_index_without_a_weight_map_of_strings(location: Location, document: Any) -> None:
    write_hf_checkpoint(location)
    put_json(location, INDEX_NAME, document)
    assert error_codes(run(location)) == ["index-invalid"]


def test_missing_shard(remote_or_local: Location) -> None:
    write_hf_checkpoint(remote_or_local)
    delete_object(remote_or_local, SHARD_2)
    report = run(remote_or_local)
    assert error_codes(report) == ["missing-shard"]
    assert findings_of(report, "missing-shard") == [(SHARD_2, None)]


def test_index_tensor_absent_from_its_shard(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"model.layers.9.mlp.up_proj.weight": SHARD_1}))
    report = run(location)
    assert findings_of(report, "index-tensor-missing") == [(SHARD_1, "model.layers.9.mlp.up_proj.weight")]
    assert error_codes(report) == ["index-tensor-missing"]


def test_header_tensor_absent_from_the_index(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].pop("lm_head.weight"))
    report = run(location)
    assert findings_of(report, "tensor-not-in-index") == [(SHARD_2, "lm_head.weight")]
    assert error_codes(report) == ["tensor-not-in-index"]


def test_tensor_mapped_to_the_wrong_shard(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"lm_head.weight": SHARD_1}))
    report = run(location)
    assert findings_of(report, "index-wrong-shard") == [(SHARD_1, "lm_head.weight")]
    assert error_codes(report) == ["index-wrong-shard"]


def test_tensor_in_two_shards(location: Location) -> None:
    checkpoint = write_hf_checkpoint(location)
    write_tensor_file(
        location,
        SHARD_2,
        [*checkpoint.tensors_by_file[SHARD_2], TensorSpec("model.embed_tokens.weight", "BF16", (32, 8))],
    )
    report = run(location)
    assert findings_of(report, "tensor-in-two-shards") == [(SHARD_2, "model.embed_tokens.weight")]
    assert error_codes(report) == ["tensor-in-two-shards"]
    assert warning_codes(report) == ["total-size-mismatch"]  # the headers now hold more bytes


def test_a_tensor_twice_in_the_weight_map(location: Location) -> None:
    write_hf_checkpoint(location)
    text = read_object(location, INDEX_NAME).decode()
    put_bytes(
        location,
        INDEX_NAME,
        text.replace('"weight_map": {', f'"weight_map": {{\n    "lm_head.weight": "{SHARD_2}",', 1).encode(),
    )
    report = run(location)
    assert findings_of(report, "index-duplicate-tensor") == [(INDEX_NAME, "lm_head.weight")]
    assert error_codes(report) == ["index-duplicate-tensor"]


@pytest.mark.parametrize(
    "shard",
    [
        "../model-00001-of-00002.safetensors",
        "/abs/model.safetensors",
        "sub\\model.safetensors",
        "original/model.safetensors",
        "",
    ],
)
def test_unsafe_shard_names_in_the_index(location: Location, shard: str) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"extra.weight": shard}))
    report = run(location)
    assert error_codes(report) == ["unsafe-shard-name"]
    assert findings_of(report, "unsafe-shard-name") == [(shard, None)]


def test_index_shard_that_is_not_safetensors(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"extra.weight": "pytorch_model.bin"}))
    assert error_codes(run(location)) == ["shard-not-safetensors"]


def test_total_size_mismatch_is_only_a_warning(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["metadata"].update(total_size=1))
    report = run(location)
    assert report.ok and warning_codes(report) == ["total-size-mismatch"]


def test_a_named_index_that_does_not_exist(location: Location) -> None:
    write_hf_checkpoint(location)
    report = run(location, index_name="other.safetensors.index.json")
    assert (report.layout, error_codes(report)) == ("indexed", ["index-missing"])


def test_an_oversized_index_is_not_read(location: Location, monkeypatch: pytest.MonkeyPatch) -> None:
    write_hf_checkpoint(location)
    monkeypatch.setattr(verify_module, "MAX_INDEX_BYTES", 100)
    report = run(location)
    assert error_codes(report) == ["index-too-large"]
    assert report.stats.requests == 2 + 1  # shards and config only


def test_several_files_without_an_index_warn(location: Location) -> None:
    write_hf_checkpoint(location, index=False)
    report = run(location)
    assert (report.layout, report.ok, warning_codes(report)) == ("single", True, ["no-index"])


# ---------------------------------------------------------------------------------------------------
# Serving readiness


def test_a_stray_top_level_safetensors_is_an_error_on_any_store(remote_or_local: Location) -> None:
    write_hf_checkpoint(remote_or_local)
    write_tensor_file(remote_or_local, "model-00003-of-00003.safetensors", [TensorSpec("old.weight", "F16", (4,))])
    report = run(remote_or_local)
    assert findings_of(report, "unindexed-safetensors") == [("model-00003-of-00003.safetensors", None)]
    assert error_codes(report) == ["unindexed-safetensors"]


def test_a_leftover_single_file_duplicates_every_tensor(location: Location) -> None:
    write_hf_checkpoint(location)
    write_tensor_file(location, "model.safetensors", llama_tensors(2))
    report = run(location)
    assert error_codes(report) == ["tensor-in-two-shards", "unindexed-safetensors"]


def test_consolidated_next_to_hf_shards(location: Location) -> None:
    write_hf_checkpoint(location)
    write_tensor_file(
        location, "consolidated.safetensors", [TensorSpec("layers.0.attention.wq.weight", "BF16", (8, 8))]
    )
    report = run(location)
    assert error_codes(report) == ["consolidated-mixed", "unindexed-safetensors"]
    assert findings_of(report, "consolidated-mixed") == [("consolidated.safetensors", None)]


def test_missing_config(location: Location) -> None:
    write_hf_checkpoint(location, config=False)
    assert error_codes(run(location)) == ["config-missing"]


def test_invalid_config(location: Location) -> None:
    write_hf_checkpoint(location)
    put_bytes(location, "config.json", b"{'not': json}")
    assert error_codes(run(location)) == ["config-invalid"]


def test_missing_tokenizer_is_a_warning(location: Location) -> None:
    write_hf_checkpoint(location, tokenizer=False)
    report = run(location)
    assert report.ok and warning_codes(report) == ["tokenizer-missing"]


def test_vocab_and_merges_count_as_a_tokenizer(location: Location) -> None:
    write_hf_checkpoint(location, tokenizer=False)
    put_json(location, "vocab.json", {"a": 0})
    assert warning_codes(run(location)) == ["tokenizer-missing"]  # vocab.json alone is not enough
    put_bytes(location, "merges.txt", b"#version: 0.2\n")
    assert warning_codes(run(location)) == []


def test_auto_map_without_its_code(location: Location) -> None:
    auto_map = {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        "AutoTokenizer": ["other/repo--tokenization_tiny.TinyTokenizer", None],
    }
    write_hf_checkpoint(location, extra_config={"auto_map": auto_map})
    put_bytes(location, "configuration_tiny.py", b"class TinyConfig: ...\n")
    report = run(location)
    assert report.ok and findings_of(report, "remote-code-missing") == [("modeling_tiny.py", None)]


def test_sub_folders_are_pulled_at_start_up(remote_or_local: Location) -> None:
    write_hf_checkpoint(remote_or_local)
    put_bytes(remote_or_local, "original/consolidated.00.pth", b"x" * 10)
    put_bytes(remote_or_local, ".git/HEAD", b"ref: refs/heads/main\n")
    report = run(remote_or_local)
    assert report.ok and findings_of(report, "subfolder-pulled") == [(".git/", None), ("original/", None)]


# ---------------------------------------------------------------------------------------------------
# --expect


def test_parse_expectation() -> None:
    assert parse_expectation("model.layers.0.*=a.safetensors, b.safetensors") == Expectation(
        "model.layers.0.*", ("a.safetensors", "b.safetensors")
    )
    for bad in ["no-equals", "=a.safetensors", "glob=", "glob=a,,b"]:
        with pytest.raises(UsageError):
            parse_expectation(bad)


def test_expectation_met(location: Location) -> None:
    write_hf_checkpoint(location)
    report = run(location, expectations=(parse_expectation(f"model.layers.0.*={SHARD_1}"),))
    assert report.findings == ()


def test_tensor_outside_its_expected_files(location: Location) -> None:
    write_hf_checkpoint(location)
    report = run(location, expectations=(parse_expectation(f"lm_head.*={SHARD_1}"),))
    assert findings_of(report, "expect-violated") == [(SHARD_2, "lm_head.weight")]
    assert error_codes(report) == ["expect-violated"]


def test_expectation_checks_the_index_placement_too(location: Location) -> None:
    write_hf_checkpoint(location)
    edit_index(location, lambda index: index["weight_map"].update({"model.layers.0.mlp.up_proj.weight": SHARD_2}))
    report = run(location, expectations=(parse_expectation(f"model.layers.0.*={SHARD_1}"),))
    assert findings_of(report, "expect-violated") == [(SHARD_2, "model.layers.0.mlp.up_proj.weight")]
    assert error_codes(report) == ["expect-violated", "index-wrong-shard"]


@pytest.mark.parametrize("glob", ["engram.*", "MODEL.layers.*"], ids=["absent", "case-sensitive"])
def test_expectation_matching_nothing(location: Location, glob: str) -> None:
    write_hf_checkpoint(location)
    report = run(location, expectations=(parse_expectation(f"{glob}={SHARD_1}"),))
    assert error_codes(report) == ["expect-no-match"]


# ---------------------------------------------------------------------------------------------------
# Sharded state


def test_clean_sharded_layouts_verify_on_any_store(remote_or_local: Location) -> None:
    checkpoint = write_sharded_checkpoint(remote_or_local, tp=2, pp=2, parts=2)
    report = run(remote_or_local)
    assert (report.layout, report.findings) == ("sharded", ())
    assert report.stats.files == len(checkpoint.files) == 8


@pytest.mark.parametrize("tp, pp, parts", [(1, 1, 1), (4, 1, 3), (2, 3, 1)])
def test_sharded_layouts_are_detected_and_verify(location: Location, tp: int, pp: int, parts: int) -> None:
    write_sharded_checkpoint(location, tp=tp, pp=pp, parts=parts, layers=3)
    report = run(location)
    assert (report.layout, report.findings) == ("sharded", ())


def test_missing_tp_rank_given_the_size(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2)
    for part in range(2):
        delete_object(location, f"model-rank-1-part-{part}.safetensors")
    assert error_codes(run(location)) == []  # TP inferred as 1: nothing to miss
    report = run(location, tensor_parallel_size=2)
    assert findings_of(report, "sharded-rank-missing") == [("model-rank-1-part-*.safetensors", None)]


def test_missing_middle_rank_is_found_by_inference(location: Location) -> None:
    write_sharded_checkpoint(location, tp=4, parts=1)
    delete_object(location, "model-rank-2-part-0.safetensors")
    assert error_codes(run(location)) == ["sharded-rank-missing"]


def test_missing_pipeline_stage(location: Location) -> None:
    write_sharded_checkpoint(location, tp=1, pp=2, parts=1)
    report = run(location, pipeline_parallel_size=3)
    assert findings_of(report, "sharded-rank-missing") == [("model-pp-2-tp-0-part-*.safetensors", None)]


def test_ranks_beyond_the_given_size(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2)
    report = run(location, tensor_parallel_size=1)
    assert error_codes(report) == ["sharded-rank-unexpected"]


def test_hole_in_part_numbers(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2, parts=3)
    delete_object(location, "model-rank-0-part-1.safetensors")
    report = run(location)
    assert findings_of(report, "sharded-part-missing") == [("model-rank-0-part-*.safetensors", None)]
    assert error_codes(report) == ["sharded-part-missing", "sharded-rank-mismatch"]


def test_part_number_twice(location: Location) -> None:
    write_sharded_checkpoint(location, tp=1, parts=2)
    put_bytes(location, "model-rank-0-part-01.safetensors", read_object(location, "model-rank-0-part-1.safetensors"))
    report = run(location)
    assert error_codes(report) == ["sharded-duplicate-tensor", "sharded-part-duplicate"]


def test_empty_part_file(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2, parts=2)
    write_tensor_file(location, "model-rank-0-part-2.safetensors", [])
    report = run(location)
    assert findings_of(report, "empty-shard") == [("model-rank-0-part-2.safetensors", None)]
    assert error_codes(report) == [] and warning_codes(report) == ["empty-shard"]


def test_tensor_twice_within_one_rank(location: Location) -> None:
    checkpoint = write_sharded_checkpoint(location, tp=1, parts=2)
    part0, part1 = (
        checkpoint.tensors_by_file["model-rank-0-part-0.safetensors"],
        checkpoint.tensors_by_file["model-rank-0-part-1.safetensors"],
    )
    write_tensor_file(location, "model-rank-0-part-1.safetensors", [*part1, part0[0]])
    report = run(location)
    assert findings_of(report, "sharded-duplicate-tensor") == [("model-rank-0-part-1.safetensors", part0[0].name)]
    assert error_codes(report) == ["sharded-duplicate-tensor"]


def test_tp_ranks_with_different_tensor_names(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2, parts=1, layers=1)
    rewrite_header(
        location,
        "model-rank-1-part-0.safetensors",
        lambda header: header.update(
            {"model.layers.0.self_attn.attn._k_scale_renamed": header.pop("model.layers.0.self_attn.attn._k_scale")}
        ),
    )
    report = run(location)
    assert findings_of(report, "sharded-rank-mismatch") == [
        ("model-rank-0-part-*.safetensors", "model.layers.0.self_attn.attn._k_scale_renamed"),
        ("model-rank-1-part-*.safetensors", "model.layers.0.self_attn.attn._k_scale"),
    ]


def test_tp_ranks_with_different_dtypes_warn(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2, parts=1, layers=1)
    rewrite_header(
        location,
        "model-rank-1-part-0.safetensors",
        lambda header: header["model.layers.0.self_attn.attn._k_scale"].update(dtype="I32"),
    )
    report = run(location)
    assert report.ok and findings_of(report, "sharded-dtype-mismatch") == [
        ("model-rank-0-part-*.safetensors", "model.layers.0.self_attn.attn._k_scale")
    ]


def test_a_file_vllm_would_load_for_a_rank_but_does_not_fit_the_pattern(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2)
    put_bytes(location, "model-rank-0-part-0.old.safetensors", read_object(location, "model-rank-0-part-0.safetensors"))
    report = run(location)
    assert findings_of(report, "sharded-unexpected-file") == [("model-rank-0-part-0.old.safetensors", None)]
    assert error_codes(report) == ["sharded-unexpected-file"]


def test_unused_files_and_a_stale_index_in_a_sharded_layout_warn(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2)
    write_tensor_file(location, "extra.safetensors", [TensorSpec("x", "U8", (1,))])
    put_json(location, INDEX_NAME, {"weight_map": {"x": "extra.safetensors"}})
    report = run(location)
    assert report.ok and warning_codes(report) == ["sharded-unused-file", "stale-index"]


def test_pp_pattern_with_a_single_stage_breaks_vllm_rules(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2, pp=1, pattern=DEFAULT_PP_PATTERN)
    assert error_codes(run(location)) == ["sharded-pattern-invalid"]


def test_custom_pattern(location: Location) -> None:
    pattern = "weights-tp{tp_rank}-p{part}.safetensors"
    write_sharded_checkpoint(location, tp=2, pattern=pattern)
    assert run(location).layout == "single"  # not a default name: not detected
    report = run(location, pattern=pattern)
    assert (report.layout, report.findings) == ("sharded", ())


def test_custom_pattern_syntax_errors_are_usage_errors(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2)
    for pattern in ["model-{rank}-{shard}.safetensors", "{rank}{part}", "sub/{rank}-{part}"]:
        with pytest.raises(UsageError):
            run(location, pattern=pattern)


def test_absurd_rank_and_part_numbers_are_reported_without_walking_them(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2, parts=1)
    spare = read_object(location, "model-rank-1-part-0.safetensors")
    put_bytes(location, "model-rank-999999999-part-0.safetensors", spare)
    put_bytes(location, "model-rank-1-part-99999999999.safetensors", spare)
    report = run(location)  # would take hours if ranks or parts were enumerated
    assert findings_of(report, "sharded-rank-missing") == [(None, None)]
    assert "1,000,000,000 ranks; 3 have files" in next(
        f.message for f in report.findings if f.code == "sharded-rank-missing"
    )
    assert findings_of(report, "sharded-part-missing") == [("model-rank-1-part-*.safetensors", None)]
    assert "99,999,999,998 missing: 1, 2, 3" in next(
        f.message for f in report.findings if f.code == "sharded-part-missing"
    )


@pytest.mark.parametrize(
    "pattern, tp, pp, allowed",
    [
        ("model-rank-{rank}-part-{part}.safetensors", 8, 1, True),
        ("model-tp-{tp_rank}-part-{part}.safetensors", 2, 1, True),
        ("single-{part}.safetensors", 1, 1, True),  # TP = 1 needs no rank field
        ("single-{part}.safetensors", 2, 1, False),
        ("model-rank-{rank}.safetensors", 1, 1, False),  # {part} is required
        ("model-rank-{rank}-part-{part}.safetensors", 2, 2, False),  # PP > 1 needs {pp_rank}
        ("model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors", 2, 1, False),  # and PP = 1 rejects it
        ("model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors", 2, 4, True),
        ("model-{stage}-{part}.safetensors", 1, 1, False),
    ],
)
def test_vllm_pattern_rules(pattern: str, tp: int, pp: int, allowed: bool) -> None:
    if allowed:
        validate_pattern(pattern, tp, pp)
    else:
        with pytest.raises(UsageError):
            validate_pattern(pattern, tp, pp)


def test_sharded_names_round_trip_and_parse_back() -> None:
    names = [
        format_name(DEFAULT_PP_PATTERN, tp_rank=t, pp_rank=p, part=k)
        for p in range(2)
        for t in range(3)
        for k in range(2)
    ]
    assert names[0] == "model-pp-0-tp-0-part-0.safetensors"
    assert match_sharded(DEFAULT_PP_PATTERN, [*names, "model-pp-0-tp-01-part-0.safetensors", "other.safetensors"]) == {
        (p, t): [0, 1] for p in range(2) for t in range(3)
    }
    assert rank_loading(DEFAULT_PATTERN, "model-rank-3-part-0.bak.safetensors") == (0, 3)
    assert rank_loading(DEFAULT_PATTERN, "model-rank-03-part-0.safetensors") is None  # vLLM formats 3 as "3"


def test_not_sharded_overrides_detection(location: Location) -> None:
    write_sharded_checkpoint(location, tp=2, parts=1)
    report = run(location, sharded=False)
    assert report.layout == "single" and "tensor-in-two-shards" in error_codes(report)


def test_sharded_forced_without_matching_files(location: Location) -> None:
    write_single_file_checkpoint(location)
    report = run(location, sharded=True)
    assert report.layout == "sharded"
    assert error_codes(report) == ["sharded-rank-missing"] and warning_codes(report) == ["sharded-unused-file"]


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


@dataclass
class RecordingProgress:
    events: list[tuple[str, Any]] = field(default_factory=list)

    def task(self, description: str, total: int | None) -> int:
        self.events.append(("task", total))
        return 7

    def advance(self, task_id: int, amount: int) -> None:
        self.events.append(("advance", (task_id, amount)))

    def done(self, task_id: int) -> None:
        self.events.append(("done", task_id))

    def log(self, message: str) -> None:
        self.events.append(("log", message))


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
