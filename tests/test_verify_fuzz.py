"""Property tests: whatever a header or an index holds, verification returns findings or raises a
streamctl error, never another exception, and every finding code is one the verify docstring documents."""

from __future__ import annotations

import copy
import json
import re
import struct
from typing import Any

import pytest
from checkpoints import INDEX_NAME, LLAMA_CONFIG, put_bytes, write_serving_files
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from streamctl.verify import run as verify_module
from streamctl.errors import StreamctlError
from streamctl.checkpoint.safetensors import parse_safetensors_bytes, safetensors_bytes
from streamctl.checkpoint.sharded_names import DEFAULT_PATTERN, DEFAULT_PP_PATTERN, match_sharded
from streamctl.storage import open_location
from streamctl.storage.base import Location
from streamctl.verify.run import VerifyOptions, VerifyReport, verify_checkpoint

DOCUMENTED_CODES = frozenset(re.findall(r"^\| `([a-z0-9-]+)` \|", verify_module.__doc__ or "", re.MULTILINE))
BASE_TENSORS: list[tuple[str, str, list[int], bytes]] = [
    ("model.embed_tokens.weight", "BF16", [4, 2], bytes(range(16))),
    ("model.norm.weight", "F32", [2], bytes(8)),
    ("lm_head.weight", "F16", [], b"\x00\x3c"),
    ("model.layers.0.mlp.experts.packed", "F4", [6], bytes(3)),
]
BASE_FILE = safetensors_bytes(BASE_TENSORS, {"format": "pt"})
BASE_LENGTH = struct.unpack("<Q", BASE_FILE[:8])[0]
BASE_HEADER: dict[str, Any] = json.loads(BASE_FILE[8 : 8 + BASE_LENGTH])
BASE_DATA = BASE_FILE[8 + BASE_LENGTH :]
TENSOR_NAMES = [name for name, _, _, _ in BASE_TENSORS]

EDGE_INTS = st.sampled_from(
    [0, 1, 2, 7, 8, 16, 2**31, 2**32, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 10**40, -1, -(2**63), 100_000_001]
)
INTS = EDGE_INTS | st.integers(min_value=-100, max_value=200)
JSON_SCALARS = st.none() | st.booleans() | INTS | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=16,
)
INVALID_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82"])


def encode(header: Any) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


@st.composite
def mutated_files(draw: st.DrawFn) -> bytes:
    """A safetensors file derived from a valid one by one or more kinds of damage."""
    header = copy.deepcopy(BASE_HEADER)
    kind = draw(
        st.sampled_from(
            [
                "field",
                "offsets",
                "shift",
                "gap",
                "bools",
                "shape",
                "metadata",
                "random-json",
                "random-bytes",
                "invalid-utf8",
                "deep",
                "flip",
                "surrogate",
                "duplicate",
                "whitespace",
            ]
        )
    )
    raw: bytes
    padding = b""
    if kind == "gap":  # a gap before the last tensor, the data grown to match: only rule 8 is broken
        last = max(TENSOR_NAMES, key=lambda name: header[name]["data_offsets"])
        delta = draw(st.integers(1, 3))
        header[last]["data_offsets"] = [offset + delta for offset in header[last]["data_offsets"]]
        padding = bytes(delta)
        raw = encode(header)
    elif kind == "field":
        name = draw(st.sampled_from(TENSOR_NAMES))
        header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(JSON_VALUES)
        if draw(st.booleans()):
            del header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
        raw = encode(header)
    elif kind == "offsets":
        for name in draw(st.lists(st.sampled_from(TENSOR_NAMES), min_size=1, max_size=4)):
            header[name]["data_offsets"] = draw(st.lists(INTS, min_size=0, max_size=3))
        raw = encode(header)
    elif kind == "shape":
        header[draw(st.sampled_from(TENSOR_NAMES))]["shape"] = draw(st.lists(INTS, max_size=5))
        raw = encode(header)
    elif kind == "shift":  # a gap or an overlap in an otherwise valid file
        name = draw(st.sampled_from(TENSOR_NAMES))
        delta = draw(st.integers(-3, 3))
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [max(0, begin + delta), max(0, end + delta)]
        raw = encode(header)
    elif kind == "bools":  # JSON true/false where integers belong: Python's bool is an int, JSON's is not
        header["lm_head.weight"]["shape"] = draw(st.lists(st.just(True), max_size=2))
        if draw(st.booleans()):
            header["model.embed_tokens.weight"]["data_offsets"][0] = False
        raw = encode(header)
    elif kind == "metadata":
        header["__metadata__"] = draw(JSON_VALUES)
        raw = encode(header)
    elif kind == "random-json":
        raw = json.dumps(draw(JSON_VALUES)).encode()  # NaN/Infinity included: Python writes them, JSON forbids them
    elif kind == "random-bytes":
        raw = draw(st.binary(max_size=300))
    elif kind == "invalid-utf8":
        raw = encode(header)
        position = draw(st.integers(0, len(raw)))
        raw = raw[:position] + draw(INVALID_UTF8) + raw[position:]
    elif kind == "deep":
        depth = draw(st.integers(1, 200_000))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        closed = draw(st.booleans())
        raw = b'{"t":' + opener * depth + b"1" + (closer * depth if closed else b"") + b"}"
    elif kind == "flip":
        flipped = bytearray(encode(header))
        for _ in range(draw(st.integers(1, 8))):
            flipped[draw(st.integers(0, len(flipped) - 1))] = draw(st.integers(0, 255))
        raw = bytes(flipped)
    elif kind == "surrogate":
        raw = (
            encode(header)
            .replace(b'"model.norm.weight"', b'"\\ud800"', 1)
            .replace(b'"pt"', draw(st.sampled_from([b'"\\udfff"', b'"\\ud83d\\ude00"'])), 1)
        )
    elif kind == "duplicate":
        text = encode(header)
        position = text.index(b'"lm_head.weight"')
        raw = text[:position] + text[position : text.index(b"}", position) + 1] + b"," + text[position:]
    else:  # whitespace around the object, and padding the length field does or doesn't cover
        raw = (
            draw(st.sampled_from([b" ", b"\n\t", b""])) + encode(header) + draw(st.sampled_from([b"", b"   ", b"\0\0"]))
        )

    length = len(raw)
    if draw(st.integers(0, 4)) == 0:
        length = draw(EDGE_INTS.filter(lambda value: 0 <= value < 2**64) | st.integers(0, 2**64 - 1))
    data = BASE_DATA + padding
    change = draw(st.integers(-4, 4)) if draw(st.integers(0, 3)) == 0 else 0  # mostly keep the size right
    if change < 0:
        data = data[:change]
    elif change > 0:
        data = data + bytes(change)
    whole = struct.pack("<Q", length) + raw + data
    if draw(st.integers(0, 9)) == 0:
        whole = whole[: draw(st.integers(0, len(whole)))]  # truncated anywhere, even inside the length
    return whole


class _Invalid(Exception):
    pass


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Invalid("duplicate key")
    return dict(pairs)


def _no_constants(name: str) -> Any:
    raise _Invalid(f"{name} is not JSON")


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:  # iterative: the fuzzer nests far deeper than Python's recursion limit
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**64


def oracle_accepts(data: bytes) -> bool:
    """Rules 1-9 written out plainly, independently of streamctl.checkpoint.safetensors (the parser under test).

    Stricter than the reference reader in the same places streamctl is on purpose: duplicate keys,
    lone surrogates, and JSON nested deeper than 64 levels are invalid.
    """
    try:
        if len(data) < 8:
            raise _Invalid
        length = int.from_bytes(data[:8], "little")
        if length > 100_000_000 or 8 + length > len(data):
            raise _Invalid
        try:
            text = data[8 : 8 + length].decode("utf-8")
            header = json.loads(text, object_pairs_hook=_strict_object, parse_constant=_no_constants)
        except (ValueError, RecursionError) as error:
            raise _Invalid from error
        if not isinstance(header, dict) or _depth(header) > 64:
            raise _Invalid
        spans = []
        for name, entry in header.items():
            name.encode("utf-8")  # UnicodeEncodeError (a ValueError) on lone surrogates
            if name == "__metadata__":
                if entry is not None and not (
                    isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())
                ):
                    raise _Invalid
                for key, item in (entry or {}).items():
                    key.encode("utf-8"), item.encode("utf-8")
                continue
            if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
                raise _Invalid
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            bits = (
                {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}.get(dtype)
                or (
                    8
                    if dtype in ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
                    else 16
                    if dtype in ("I16", "U16", "F16", "BF16")
                    else 32
                    if dtype in ("I32", "U32", "F32")
                    else 64
                    if dtype in ("I64", "U64", "F64", "C64")
                    else 0
                )
                if isinstance(dtype, str)
                else 0
            )
            if not bits or not isinstance(shape, list) or not all(map(_u64, shape)):
                raise _Invalid
            if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_u64, offsets)):
                raise _Invalid
            elements = 1
            for dim in shape:
                elements *= dim
                if elements >= 2**64:
                    raise _Invalid
            if elements * bits >= 2**64 or elements * bits % 8 or offsets[1] - offsets[0] != elements * bits // 8:
                raise _Invalid
            spans.append((offsets[0], offsets[1]))
        position = 0
        for begin, end in sorted(spans):
            if begin != position:
                raise _Invalid
            position = end
        return 8 + length + position == len(data)
    except (_Invalid, UnicodeError):
        return False


def check_report(report: VerifyReport) -> None:
    for finding in report.findings:
        assert finding.severity in ("error", "warning")
        assert finding.code in DOCUMENTED_CODES, f"undocumented finding code {finding.code!r}"
        assert isinstance(finding.message, str) and finding.message
        finding.message.encode("utf-8")  # printable: no lone surrogates leak into messages
        (finding.tensor or "").encode("utf-8")
    json.dumps(report.to_json())


def test_the_docstring_documents_codes() -> None:
    assert {"header-too-large", "missing-shard", "sharded-rank-missing", "expect-violated"} <= DOCUMENTED_CODES


def test_the_unmutated_base_file_is_valid() -> None:
    assert parse_safetensors_bytes(BASE_FILE).problems == ()
    assert oracle_accepts(BASE_FILE) and not oracle_accepts(BASE_FILE + b"\0")


@settings(max_examples=1500, deadline=None)
@given(mutated_files())
def test_parsing_any_file_returns_problems_never_raises(data: bytes) -> None:
    parsed = parse_safetensors_bytes(data)
    for problem in parsed.problems:
        assert problem.severity in ("error", "warning")
        assert problem.code in DOCUMENTED_CODES
    assert parsed.ok == oracle_accepts(data), [problem.code for problem in parsed.problems]
    if parsed.ok:
        assert len(data) == 8 + parsed.header_length + parsed.data_bytes  # rule 9 held


@pytest.fixture(scope="module")
def fuzz_location(tmp_path_factory: pytest.TempPathFactory) -> Location:
    location = open_location(str(tmp_path_factory.mktemp("fuzz")))
    write_serving_files(location)
    return location


def verify_or_streamctl_error(location: Location, options: VerifyOptions | None = None) -> VerifyReport | None:
    try:
        report = verify_checkpoint(location, options or VerifyOptions())
    except StreamctlError:
        return None
    check_report(report)
    return report


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated_files(), speculative=st.sampled_from([8, 64, 100_000]))
def test_verify_returns_findings_for_any_damaged_shard(fuzz_location: Location, data: bytes, speculative: int) -> None:
    put_bytes(fuzz_location, "model.safetensors", data)
    report = verify_or_streamctl_error(fuzz_location, VerifyOptions(speculative_bytes=speculative))
    assert report is not None  # the file is listed, so verification runs to the end
    assert report.stats.requests <= 2 + 1  # the shard (one or two reads) and config.json
    assert report.stats.bytes_read <= len(data) + len(json.dumps(LLAMA_CONFIG, indent=2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    index=st.one_of(
        JSON_VALUES.map(lambda value: json.dumps(value).encode()),
        st.dictionaries(
            st.text(max_size=30),
            st.sampled_from(["model.safetensors", "../x.safetensors", "/x", "a\\b", "", "x.bin"])
            | st.text(max_size=10),
            max_size=6,
        ).map(lambda weight_map: json.dumps({"metadata": {"total_size": 34}, "weight_map": weight_map}).encode()),
        st.binary(max_size=200),
    )
)
def test_verify_returns_findings_for_any_index(fuzz_location: Location, index: bytes) -> None:
    put_bytes(fuzz_location, "model.safetensors", BASE_FILE)
    put_bytes(fuzz_location, INDEX_NAME, index)
    try:
        report = verify_or_streamctl_error(fuzz_location)
    finally:
        fuzz_location.store.delete(fuzz_location.key(INDEX_NAME))
    assert report is not None and report.layout == "indexed"


NAME_TEXT = st.text(alphabet="model-rankpt0123456789.safetensors_{}", max_size=45)


@settings(max_examples=300, deadline=None)
@given(
    names=st.lists(
        NAME_TEXT | st.sampled_from(["model-rank-0-part-0.safetensors", "model-pp-1-tp-0-part-00.safetensors"]),
        max_size=8,
    )
)
def test_sharded_name_matching_never_raises(names: list[str]) -> None:
    for pattern in (DEFAULT_PATTERN, DEFAULT_PP_PATTERN):
        for (pp_rank, tp_rank), parts in match_sharded(pattern, names).items():
            assert pp_rank >= 0 and tp_rank >= 0 and parts == sorted(parts)
