"""One case per rule of docs/specs/safetensors-and-index.md, plus the writer and the ranged reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from checkpoints import CountingStore
from streamctl.checkpoint.header_types import DTYPE_ALIGNMENT_ORDER, DTYPE_ALIGNMENT_RANK
from streamctl.checkpoint.safetensors import (
    DTYPE_BITS,
    HF_MAX_HEADER_BYTES,
    MAX_HEADER_BYTES,
    check_header_length,
    decode_header_length,
    decode_json_strictly,
    encode_safetensors_header,
    parse_header,
    parse_safetensors_bytes,
    read_header,
    safetensors_bytes,
    write_safetensors,
)
from streamctl.errors import UsageError
from streamctl.storage.local import LocalStore


def file_from_header(header: Any, data: bytes = b"", *, raw: bytes | None = None, length: int | None = None) -> bytes:
    """A file whose header is `header` (JSON-encoded) or `raw` bytes, followed by `data`."""
    encoded = raw if raw is not None else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(encoded) if length is None else length) + encoded + data


def entry(dtype: str, shape: list[Any], begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def codes(data: bytes) -> list[str]:
    return sorted(problem.code for problem in parse_safetensors_bytes(data).problems)


def error_codes(data: bytes) -> list[str]:
    return sorted(problem.code for problem in parse_safetensors_bytes(data).problems if problem.severity == "error")


VALID = file_from_header({"a": entry("F16", [2, 2], 0, 8), "b": entry("I32", [1], 8, 12)}, bytes(12))


def test_a_valid_file_has_no_problems() -> None:
    parsed = parse_safetensors_bytes(VALID)
    assert parsed.ok and parsed.problems == () and parsed.complete
    assert [(tensor.name, tensor.dtype, tensor.shape, tensor.begin, tensor.end) for tensor in parsed.tensors] == [
        ("a", "F16", (2, 2), 0, 8),
        ("b", "I32", (1,), 8, 12),
    ]


def test_the_reference_readers_own_example_is_valid() -> None:
    # From safetensors/src/tensor.rs docs: N = 60 (not padded), one I32 [2, 2] tensor.
    data = b'<\x00\x00\x00\x00\x00\x00\x00{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}' + bytes(16)
    assert codes(data) == []


# --- Rule 1: the length field -----------------------------------------------------------------------


def test_rule1_length_is_unsigned_64_bit_little_endian() -> None:
    assert decode_header_length(bytes([1, 2, 0, 0, 0, 0, 0, 0])) == 0x0201
    assert decode_header_length(b"\xff" * 8) == 2**64 - 1


@pytest.mark.parametrize("size", [0, 1, 7])
def test_rule1_a_file_under_8_bytes_is_invalid(size: int) -> None:
    assert codes(bytes(size)) == ["file-too-small"]


# --- Rule 2: header size caps ------------------------------------------------------------------------


@pytest.mark.parametrize("length", [MAX_HEADER_BYTES + 1, 2**63, 2**64 - 1])
def test_rule2_headers_over_100_million_bytes_are_rejected_before_anything_is_read(length: int) -> None:
    assert codes(file_from_header({}, length=length)) == ["header-too-large"]
    assert check_header_length(length, 10**12).code == "header-too-large"  # type: ignore[union-attr]


def test_rule2_exactly_100_million_is_allowed_by_the_cap() -> None:
    assert check_header_length(MAX_HEADER_BYTES, MAX_HEADER_BYTES + 8) is None


def test_rule2_headers_over_25_million_bytes_only_warn() -> None:
    header = json.dumps({"a": entry("U8", [1], 0, 1)}).encode().ljust(HF_MAX_HEADER_BYTES + 8, b" ")
    parsed = parse_header(header, 8 + len(header) + 1)
    assert [(problem.code, problem.severity) for problem in parsed.problems] == [("header-over-hf-limit", "warning")]
    assert parsed.ok


# --- Rule 3: 8 + N within the object ------------------------------------------------------------------


def test_rule3_header_length_beyond_the_object_is_an_error() -> None:
    data = file_from_header({}, length=100)
    assert codes(data) == ["header-exceeds-file"]
    assert check_header_length(len(data) - 8, len(data)) is None
    assert check_header_length(len(data) - 7, len(data)).code == "header-exceeds-file"  # type: ignore[union-attr]


# --- Rule 4: UTF-8 JSON object, padding ----------------------------------------------------------------


def test_rule4_invalid_utf8_is_an_error() -> None:
    assert codes(file_from_header(None, raw=b'{"\xff\xfe":1}')) == ["header-not-utf8"]


@pytest.mark.parametrize(
    "raw",
    [b"{", b'{"a":}', b"{}x", b'{"a":NaN}', b'{"a":Infinity}', b"\xef\xbb\xbf{}", b'{"a":"\x01"}', b""],
    ids=["unclosed", "missing-value", "trailing-garbage", "nan", "infinity", "bom", "control-char", "empty"],
)
def test_rule4_invalid_json_is_an_error(raw: bytes) -> None:
    assert codes(file_from_header(None, raw=raw)) == ["header-invalid-json"]


@pytest.mark.parametrize("raw", [b"[]", b'"x"', b"3", b"null"])
def test_rule4_json_that_is_not_an_object_is_an_error(raw: bytes) -> None:
    assert codes(file_from_header(None, raw=raw)) == ["header-not-object"]


def test_rule4_trailing_space_padding_is_fine() -> None:
    assert (
        codes(file_from_header(None, raw=b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}  \t\n\r', data=b"x"))
        == []
    )


def test_rule4_leading_whitespace_is_a_warning_not_an_error() -> None:
    parsed = parse_safetensors_bytes(file_from_header(None, raw=b"\n  {}"))
    assert [(problem.code, problem.severity) for problem in parsed.problems] == [
        ("header-leading-whitespace", "warning")
    ]


@pytest.mark.parametrize("depth", [65, 100_000])
def test_rule4_deep_nesting_is_refused_without_recursion_error(depth: int) -> None:
    raw = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
    assert codes(file_from_header(None, raw=raw)) == ["header-too-complex"]


def test_rule4_brackets_inside_strings_are_not_nesting() -> None:
    raw = json.dumps({"__metadata__": {"note": "[" * 1000 + "{" * 1000}}).encode()
    assert codes(file_from_header(None, raw=raw)) == []


def test_rule4_a_container_flood_is_refused_before_parsing() -> None:
    raw = b'{"a":[' + b"[]," * 1_000_000 + b"[]]}"
    assert codes(file_from_header(None, raw=raw)) == ["header-too-complex"]


def test_rule4_absurdly_long_numbers_are_out_of_range_not_a_crash() -> None:
    data = file_from_header(
        None, raw=b'{"a":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}', data=b"x"
    )
    assert codes(data) == ["bad-shape"]


# --- Rule 5: entry structure and __metadata__ ---------------------------------------------------------


def test_rule5_metadata_must_map_strings_to_strings() -> None:
    assert codes(file_from_header({"__metadata__": {"format": "pt"}})) == []
    assert codes(file_from_header({"__metadata__": {"step": 3}})) == ["bad-metadata"]
    assert codes(file_from_header({"__metadata__": ["pt"]})) == ["bad-metadata"]


def test_rule5_null_metadata_is_a_warning() -> None:
    parsed = parse_safetensors_bytes(file_from_header({"__metadata__": None}))
    assert [(problem.code, problem.severity) for problem in parsed.problems] == [("bad-metadata", "warning")]


@pytest.mark.parametrize(
    "value",
    [[1, 2], "F16", {"dtype": "F16", "shape": [1]}, {"shape": [1], "data_offsets": [0, 2]}],
    ids=["list", "string", "no-offsets", "no-dtype"],
)
def test_rule5_malformed_tensor_entries_are_errors(value: Any) -> None:
    parsed = parse_safetensors_bytes(file_from_header({"t": value}, bytes(2)))
    assert [(problem.code, problem.tensor) for problem in parsed.problems] == [("bad-tensor-entry", "t")]
    assert not parsed.complete


def test_rule5_unknown_fields_in_an_entry_warn() -> None:
    parsed = parse_safetensors_bytes(file_from_header({"t": {**entry("U8", [1], 0, 1), "extra": 1}}, b"x"))
    assert [(problem.code, problem.severity) for problem in parsed.problems] == [("unknown-tensor-field", "warning")]


# --- Rule 6: duplicate keys -----------------------------------------------------------------------


def test_rule6_a_tensor_twice_is_a_warning_and_its_last_entry_is_the_one_kept() -> None:
    # Every reader loads the last entry (test_reader_agreement measures it); the layout rules judge that one.
    raw = b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"t":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}}'
    parsed = parse_safetensors_bytes(file_from_header(None, raw=raw, data=b"x"))
    assert [(problem.code, problem.severity, problem.tensor) for problem in parsed.problems] == [
        ("duplicate-tensor", "warning", "t")
    ]
    assert [(tensor.name, tensor.dtype) for tensor in parsed.tensors] == [("t", "I8")] and parsed.complete


def test_rule6_a_field_twice_inside_an_entry_is_an_error_naming_the_tensor() -> None:
    for field in ('"dtype":"U8"', '"shape":[1]', '"data_offsets":[0,1]'):
        raw = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],' + field.encode() + b"}}"
        parsed = parse_safetensors_bytes(file_from_header(None, raw=raw, data=b"x"))
        assert [(problem.code, problem.tensor) for problem in parsed.problems] == [("duplicate-key", "w")], field


def test_rule6_duplicates_are_seen_at_any_depth() -> None:
    document = decode_json_strictly(b'{"a":{"b":1,"b":2},"c":3,"c":4}')
    assert sorted((key, earlier) for _, key, earlier in document.duplicate_keys) == [("b", 1), ("c", 3)]
    assert [key for owner, key, _ in document.duplicate_keys if owner is document.value] == ["c"]


# --- Rule 7: dtypes ---------------------------------------------------------------------------------


def test_rule7_the_dtype_table_matches_the_spec() -> None:
    assert {
        **dict.fromkeys(["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"], 8),
        **dict.fromkeys(["F6_E2M3", "F6_E3M2"], 6),
        "F4": 4,
        **dict.fromkeys(["I16", "U16", "F16", "BF16"], 16),
        **dict.fromkeys(["I32", "U32", "F32"], 32),
        **dict.fromkeys(["I64", "U64", "F64", "C64"], 64),
    } == DTYPE_BITS


@pytest.mark.parametrize(
    "dtype, shape, nbytes", [("F4", [2], 1), ("F6_E2M3", [4], 3), ("C64", [1], 8), ("BOOL", [3], 3)]
)
def test_rule7_each_dtype_uses_its_bit_size(dtype: str, shape: list[int], nbytes: int) -> None:
    assert codes(file_from_header({"t": entry(dtype, shape, 0, nbytes)}, bytes(nbytes))) == []


@pytest.mark.parametrize("dtype", ["F128", "f16", "", 16, None])
def test_rule7_unknown_dtypes_are_errors(dtype: Any) -> None:
    assert codes(file_from_header({"t": entry(dtype, [1], 0, 2)}, bytes(2))) == ["unknown-dtype"]


# --- Rule 8: shapes, offsets, sizes --------------------------------------------------------------------


@pytest.mark.parametrize("shape", [[-1], [True], [1.0], [2**64], "2", [[2]]])
def test_rule8_shape_must_be_64_bit_unsigned_integers(shape: Any) -> None:
    assert codes(file_from_header({"t": entry("U8", shape, 0, 1)}, b"x")) == ["bad-shape"]


@pytest.mark.parametrize("offsets", [[0], [0, 1, 2], [-1, 0], [0, 2**64], [0.0, 1], [False, True], "0,1"])
def test_rule8_data_offsets_must_be_two_64_bit_unsigned_integers(offsets: Any) -> None:
    header = {"t": {"dtype": "U8", "shape": [1], "data_offsets": offsets}}
    assert codes(file_from_header(header, b"x")) == ["bad-offsets"]


def test_rule8_end_before_begin_is_an_error() -> None:
    assert error_codes(file_from_header({"t": entry("U8", [0], 1, 0)}, b"x")) == ["offsets-reversed"]


def test_rule8_a_gap_between_tensors_is_an_error() -> None:
    header = {"a": entry("U8", [1], 0, 1), "b": entry("U8", [1], 2, 3)}
    assert codes(file_from_header(header, bytes(3))) == ["offsets-gap"]


def test_rule8_data_must_start_at_zero() -> None:
    assert codes(file_from_header({"a": entry("U8", [1], 1, 2)}, bytes(2))) == ["offsets-gap"]


def test_rule8_overlapping_tensors_are_an_error() -> None:
    header = {"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 1, 3)}
    assert "offsets-overlap" in codes(file_from_header(header, bytes(3)))


def test_rule8_entries_may_be_listed_in_any_order() -> None:
    header = {"b": entry("U8", [1], 1, 2), "a": entry("U8", [1], 0, 1)}
    assert codes(file_from_header(header, bytes(2))) == []


def test_rule8_an_entry_with_a_bad_dtype_still_counts_for_contiguity() -> None:
    header = {"a": entry("F99", [1], 0, 1), "b": entry("U8", [1], 1, 2)}
    assert codes(file_from_header(header, bytes(2))) == ["unknown-dtype"]


def test_rule8_size_must_match_shape_times_bits() -> None:
    assert codes(file_from_header({"t": entry("F32", [2], 0, 4)}, bytes(4))) == ["size-mismatch"]


def test_rule8_sub_byte_totals_must_be_whole_bytes() -> None:
    assert codes(file_from_header({"t": entry("F4", [3], 0, 2)}, bytes(2))) == ["size-not-whole-bytes"]


def test_rule8_size_arithmetic_is_checked_like_the_reference_reader() -> None:
    # 2**32 * 2**32 overflows usize before the 0 could bring the product back down.
    assert codes(file_from_header({"t": entry("U8", [2**32, 2**32, 0], 0, 0)})) == ["size-overflow"]
    assert codes(file_from_header({"t": entry("U16", [2**62, 4], 0, 2**64 - 1)})) == ["file-truncated", "size-overflow"]


def test_rule8_a_dimension_must_fit_a_signed_64_bit_integer() -> None:
    # numpy, torch and the Run:ai streamer build the tensor with int64 dimensions (test_reader_agreement).
    assert codes(file_from_header({"t": entry("U8", [0, 2**63 - 1], 0, 0)})) == []
    for shape in ([2**63], [0, 2**63], [2**64 - 1, 0], [1, 2**63 + 1, 0]):
        assert codes(file_from_header({"t": entry("U8", shape, 0, 0)})) == ["bad-shape"], shape
    assert codes(file_from_header({"t": entry("U16", [2**63], 0, 2**64 - 1)})) == ["bad-shape", "file-truncated"]


def test_rule8_an_empty_tensor_may_not_span_more_than_2_63_bytes() -> None:
    assert codes(file_from_header({"t": entry("F32", [2**61 - 1, 0], 0, 0)})) == []
    for dtype, shape in (("F32", [0, 2**61]), ("U8", [0, 2**62, 2]), ("F64", [2**40, 0, 2**40])):
        assert codes(file_from_header({"t": entry(dtype, shape, 0, 0)})) == ["bad-shape"], shape


def test_rule8_scalars_and_empty_tensors_are_valid() -> None:
    header = {"scalar": entry("BF16", [], 0, 2), "empty": entry("F32", [4, 0], 2, 2)}
    assert codes(file_from_header(header, bytes(2))) == []


# --- Rule 9: exact object size ----------------------------------------------------------------------


def test_rule9_a_truncated_file_is_an_error() -> None:
    assert codes(VALID[:-1]) == ["file-truncated"]


def test_rule9_trailing_bytes_are_an_error() -> None:
    assert codes(VALID + b"\0") == ["file-trailing-bytes"]


def test_rule9_is_skipped_when_the_layout_is_already_broken() -> None:
    header = {"a": entry("U8", [1], 0, 1), "b": entry("U8", [1], 5, 6)}
    assert codes(file_from_header(header, bytes(2))) == ["offsets-gap"]


# --- The writer -------------------------------------------------------------------------------------


def test_encoded_headers_are_padded_to_8_and_round_trip() -> None:
    prefix, offsets = encode_safetensors_header([("w", "BF16", [3, 5], 30), ("s", "F32", [], 4)], {"format": "pt"})
    assert len(prefix) % 8 == 0 and decode_header_length(prefix) == len(prefix) - 8
    assert offsets == [(0, 30), (30, 34)]
    parsed = parse_header(prefix[8:], len(prefix) + 34)
    assert parsed.problems == () and parsed.metadata == {"format": "pt"}
    assert [(tensor.name, tensor.shape) for tensor in parsed.tensors] == [("w", (3, 5)), ("s", ())]


@pytest.mark.parametrize(
    "tensors",
    [
        [("w", "F16", [2], 3)],
        [("w", "F99", [2], 4)],
        [("w", "U8", [1], 1), ("w", "U8", [1], 1)],
        [("__metadata__", "U8", [1], 1)],
        [("w", "U8", [-1], 0)],
        [("\ud800", "U8", [1], 1)],
    ],
    ids=["wrong-size", "bad-dtype", "duplicate", "reserved-name", "negative-dim", "lone-surrogate"],
)
def test_the_writer_refuses_what_a_reader_would_refuse(tensors: list[Any]) -> None:
    with pytest.raises(UsageError):
        encode_safetensors_header(tensors)


def test_write_safetensors_puts_a_readable_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    info = write_safetensors(store, "m.safetensors", [("a", "U8", [3], b"abc"), ("b", "I16", [1], b"\1\2")])
    data = (tmp_path / "m.safetensors").read_bytes()
    assert info.size == len(data) and data.endswith(b"abc\1\2")
    assert parse_safetensors_bytes(data).problems == ()
    assert data == safetensors_bytes([("a", "U8", [3], b"abc"), ("b", "I16", [1], b"\1\2")])


# --- The ranged reader ------------------------------------------------------------------------------


def stored(tmp_path: Path, data: bytes) -> tuple[CountingStore, int]:
    (tmp_path / "f.safetensors").write_bytes(data)
    return CountingStore(LocalStore(tmp_path)), len(data)


def test_read_header_makes_one_request_when_the_header_fits(tmp_path: Path) -> None:
    store, size = stored(tmp_path, VALID)
    read = read_header(store, "f.safetensors", size, speculative_bytes=1000)  # type: ignore[arg-type]
    assert (read.requests, read.bytes_read, read.problem) == (1, size, None)
    assert parse_header(read.header_json, size).problems == ()  # type: ignore[arg-type]
    assert store.reads == [("f.safetensors", 0, size)]


def test_read_header_reads_the_rest_of_a_long_header_in_a_second_request(tmp_path: Path) -> None:
    data = safetensors_bytes([(f"tensor.{i}", "U8", [4], bytes(4)) for i in range(50)])
    store, size = stored(tmp_path, data)
    header_end = 8 + decode_header_length(data)
    read = read_header(store, "f.safetensors", size, speculative_bytes=100)  # type: ignore[arg-type]
    assert (read.requests, read.bytes_read) == (2, header_end)
    assert store.reads == [("f.safetensors", 0, 100), ("f.safetensors", 100, header_end - 100)]
    assert read.header_json == data[8:header_end]


def test_read_header_never_follows_an_absurd_length(tmp_path: Path) -> None:
    store, size = stored(tmp_path, struct.pack("<Q", 2**63) + b"{}" + bytes(1000))
    read = read_header(store, "f.safetensors", size, speculative_bytes=64)  # type: ignore[arg-type]
    assert read.problem is not None and read.problem.code == "header-too-large"
    assert (read.requests, read.bytes_read) == (1, 64)


def test_read_header_skips_objects_under_8_bytes(tmp_path: Path) -> None:
    store, size = stored(tmp_path, b"1234")
    read = read_header(store, "f.safetensors", size)  # type: ignore[arg-type]
    assert read.problem is not None and read.problem.code == "file-too-small" and read.requests == 0


def test_read_header_reports_an_object_that_vanished_or_shrank(tmp_path: Path) -> None:
    store, size = stored(tmp_path, VALID)
    (tmp_path / "f.safetensors").unlink()
    gone = read_header(store, "f.safetensors", size)  # type: ignore[arg-type]
    assert gone.problem is not None and gone.problem.code == "object-vanished" and gone.requests == 1
    (tmp_path / "f.safetensors").write_bytes(VALID[:20])
    shrunk = read_header(store, "f.safetensors", size, speculative_bytes=10)  # type: ignore[arg-type]
    assert shrunk.problem is not None and shrunk.problem.code == "object-changed"


def test_rule6_a_broken_last_entry_replaces_a_good_first_one() -> None:
    raw = b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"t":{"dtype":"U8","shape":[1]}}'
    parsed = parse_safetensors_bytes(file_from_header(None, raw=raw, data=b"x"))
    assert codes(file_from_header(None, raw=raw, data=b"x")) == ["bad-tensor-entry", "duplicate-tensor"]
    assert parsed.tensors == () and not parsed.complete and not parsed.ok


def test_every_dtype_has_a_place_in_the_alignment_order() -> None:
    """A dtype the reader accepts must have a rank in the writer's layout order, or `shard` would place it
    as if it were the least aligned (the rank's default) and write files unlike safetensors' own."""
    assert set(DTYPE_ALIGNMENT_ORDER) == set(DTYPE_BITS)
    assert len(DTYPE_ALIGNMENT_ORDER) == len(DTYPE_BITS)
    assert DTYPE_ALIGNMENT_RANK["U64"] > DTYPE_ALIGNMENT_RANK["F32"] > DTYPE_ALIGNMENT_RANK["BF16"]
    assert DTYPE_ALIGNMENT_RANK["BOOL"] == 0
