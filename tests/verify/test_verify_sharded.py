"""verify_checkpoint on vLLM sharded-state layouts: pattern, ranks, parts and tensors per rank."""

from __future__ import annotations

import pytest
from verify_helpers import error_codes, findings_of, run, warning_codes

from checkpoints import (
    INDEX_NAME,
    TensorSpec,
    delete_object,
    put_bytes,
    put_json,
    read_object,
    rewrite_header,
    write_sharded_checkpoint,
    write_single_file_checkpoint,
    write_tensor_file,
)
from streamctl.checkpoint.sharded_names import (
    DEFAULT_PATTERN,
    DEFAULT_PP_PATTERN,
    format_name,
    match_sharded,
    rank_loading,
    validate_pattern,
)
from streamctl.errors import UsageError
from streamctl.storage.base import Location

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
