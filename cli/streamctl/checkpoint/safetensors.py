"""The safetensors format: check a header against the format's rules, and write small files.

Pure functions, no numpy. The only I/O is `read_header` and `write_safetensors`, through a `Store`.
The rules are numbered as in `docs/specs/safetensors-and-index.md`; every check needs only the object
size and the first 8 + N bytes, so tensor data is never read.

A header is untrusted input: nothing is allocated from its length field before that length has been
checked against the object size and the 100,000,000-byte cap, JSON nesting is bounded before parsing,
and problems come back as values (`HeaderProblem`) instead of exceptions.

Memory: `parse_header` scans the raw bytes entry by entry (`_Scanner`) and keeps only compact results
(a slotted `TensorInfo` per tensor, shared shape tuples, at most PROBLEMS_KEPT_PER_CODE problems per code),
so a header costs about 2-3 bytes of memory per byte on top of its own bytes, whatever it holds: measured
2.8x for 1,000,000 tensors (100 MB, ~4 s) where `json.loads` into dicts took 8.9x and 15-37 s, and
1.3x for 8,000,000 keys of empty arrays (31x before). Integers are read as serde_json (the reference
reader) reads them: `-0`, `1.0`, `1e3` and anything past 2**64-1 are not integers.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from streamctl.errors import NotFoundError, UsageError
from streamctl.limits import shown_number
from streamctl.storage.base import ObjectInfo, Store

Severity = Literal["error", "warning"]

HEADER_LENGTH_BYTES = 8
# Rule 2: the reference reader and the Run:ai streamer refuse larger headers; huggingface_hub refuses
# headers above 25,000,000 bytes, so those only get a warning.
MAX_HEADER_BYTES = 100_000_000
HF_MAX_HEADER_BYTES = 25_000_000
DEFAULT_SPECULATIVE_BYTES = 100_000  # what huggingface_hub reads first ("97% of headers are smaller")
U64_MAX = 2**64 - 1  # the reference reader stores shapes and offsets as usize (64-bit)
# Each dimension must also fit a signed 64-bit integer: the reference reader's numpy and torch back ends,
# vLLM and the Run:ai streamer build the tensor with it and fail past 2**63-1 ("Overflow when unpacking
# long long", numpy's "Maximum allowed dimension exceeded"), even when the tensor holds no element.
MAX_DIM = 2**63 - 1
# A valid header nests three levels deep (object -> tensor entry -> shape list); anything far deeper is
# an attack or garbage, and must be refused before the recursive JSON parser sees it.
MAX_JSON_DEPTH = 64
# The smallest possible tensor entry (`"":{"dtype":"U8","shape":[],"data_offsets":[0,0]}`) is 47 bytes
# for 3 containers, so a valid header never has more than one container per 15 bytes. Many more means a
# JSON bomb such as `[[],[],...]` that would cost ~60 bytes of memory per 2 bytes of input.
_MIN_BYTES_PER_CONTAINER = 8
_FLOOD_CHECK_FROM_CHARS = 1_000_000

# Rule 7: bits per element.
DTYPE_BITS: Mapping[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F4": 4,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}

METADATA_KEY = "__metadata__"
TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
_JSON_WHITESPACE = " \t\n\r"


@dataclass(frozen=True, slots=True)  # slots: a header may hold a million of them
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data buffer, which starts at 8 + N
    end: int  # exclusive

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class HeaderProblem:
    code: str
    tensor: str | None
    message: str
    severity: Severity = "error"

    def describe(self) -> str:
        """The message with the tensor it is about, for a one-line error outside a findings table."""
        return self.message if self.tensor is None else f"tensor {self.tensor}: {self.message}"


@dataclass(frozen=True)
class ParsedHeader:
    """What a header says, and every rule it breaks. `tensors` holds only well-formed entries."""

    header_length: int  # N
    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str] | None
    problems: tuple[HeaderProblem, ...]
    # True when the JSON parsed and every tensor entry was well-formed, so `tensors` lists all of them.
    complete: bool = False
    # Problems not kept in `problems` (PROBLEMS_KEPT_PER_CODE per code), counted by code.
    dropped: Mapping[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(problem.severity == "error" for problem in self.problems)

    @property
    def data_bytes(self) -> int:
        return max((tensor.end for tensor in self.tensors), default=0)


class DuplicateKey(NamedTuple):
    """A key seen again in one JSON object. Python's json, serde_json maps and the readers keep the last
    value; `earlier` is the value it replaced."""

    owner: Mapping[str, Any]  # the dict that holds the key (callers tell the root from a nested map by `is`)
    key: str
    earlier: Any


@dataclass(frozen=True)
class JsonDocument:
    """The result of `decode_json_strictly`: a value, or the reason there is none."""

    value: Any
    error: HeaderProblem | None
    # Every key that appeared twice in one object (see DuplicateKey).
    duplicate_keys: tuple[DuplicateKey, ...] = ()


@dataclass(frozen=True)
class HeaderRead:
    """The outcome of `read_header`: the N header bytes, or the problem that stopped the read."""

    header_json: bytes | None
    problem: HeaderProblem | None
    requests: int
    bytes_read: int


def _error(code: str, message: str, tensor: str | None = None) -> HeaderProblem:
    return HeaderProblem(code, tensor, message, "error")


def _warning(code: str, message: str, tensor: str | None = None) -> HeaderProblem:
    return HeaderProblem(code, tensor, message, "warning")


def printable(text: str) -> str:
    """`text` with lone surrogates escaped, so it can be printed and encoded as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ---------------------------------------------------------------------------------------------------
# Rules 1-3: the length field


def decode_header_length(prefix: bytes) -> int:
    """Rule 1: N, the unsigned 64-bit little-endian integer in bytes 0..8. `prefix` must hold 8 bytes."""
    if len(prefix) < HEADER_LENGTH_BYTES:
        raise ValueError("need 8 bytes to decode a safetensors header length")
    return int.from_bytes(prefix[:HEADER_LENGTH_BYTES], "little")


def check_header_length(header_length: int, object_size: int) -> HeaderProblem | None:
    """Rules 2 and 3 as errors; None when N may be read. (The 25 MB warning comes with the parse.)"""
    if header_length > MAX_HEADER_BYTES:
        return _error(
            "header-too-large",
            f"header length {header_length:,} exceeds the {MAX_HEADER_BYTES:,}-byte limit of the safetensors "
            "reader and the Run:ai streamer",
        )
    if HEADER_LENGTH_BYTES + header_length > object_size:
        return _error(
            "header-exceeds-file",
            f"header length {header_length:,} needs {HEADER_LENGTH_BYTES + header_length:,} bytes but the "
            f"object has {object_size:,}",
        )
    return None


def _file_too_small(object_size: int) -> HeaderProblem:
    return _error("file-too-small", f"{object_size} bytes: a safetensors file starts with an 8-byte header length")


# ---------------------------------------------------------------------------------------------------
# Rule 4 and 6: strict JSON


# A JSON string, or one bracket. Scanned on the raw UTF-8 bytes: quotes, backslashes and brackets are
# ASCII, and no byte of a multi-byte UTF-8 sequence can be mistaken for one of them.
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_QUOTE, _OPENERS = ord('"'), (ord("["), ord("{"))


def _json_complexity_problem(data: bytes, max_depth: int, what: str) -> HeaderProblem | None:
    """Refuse deep nesting and container floods before `json.loads` recurses or allocates for them.

    Streams over tokens with O(1) memory and stops at the first excess; skipped entirely when a plain
    count of brackets (an upper bound, as some may sit inside strings) proves neither can happen.
    """
    openings = data.count(b"[") + data.count(b"{")
    # Only large documents can cost much memory; small ones (config.json) may legitimately be dense.
    flood_limit = len(data) // _MIN_BYTES_PER_CONTAINER if len(data) > _FLOOD_CHECK_FROM_CHARS else None
    if openings <= max_depth and (flood_limit is None or openings <= flood_limit):
        return None
    depth = 0
    containers = 0
    for match in _JSON_TOKEN.finditer(data):
        token = data[match.start()]
        if token == _QUOTE:
            continue  # brackets inside strings are text, not structure
        if token in _OPENERS:
            depth += 1
            containers += 1
            if depth > max_depth:
                return _error("header-too-complex", f"{what} JSON is nested deeper than {max_depth} levels")
            if flood_limit is not None and containers > flood_limit:
                return _error(
                    "header-too-complex", f"{what} JSON has over {flood_limit:,} arrays/objects in {len(data):,} bytes"
                )
        else:
            depth -= 1
    return None


class _RejectedConstant(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON (and serde_json in the reference reader) does not.
    raise _RejectedConstant(f"{name} is not valid JSON")


def _parse_int(digits: str) -> int | float:
    """An integer token as serde_json (the reference reader) sees it.

    serde_json reads `-0` as the float -0.0 (and any integer beyond 64 bits as a float), so a u64/usize
    field refuses it: return a float, which every integer check rejects. Python refuses to convert more
    than 4300 digits (ValueError); anything past 40 digits is far out of the 64-bit range anyway.
    """
    if digits == "-0":
        return -0.0
    return int(digits) if len(digits) <= 40 else 10**40


def decode_json_strictly(data: bytes, *, max_depth: int = MAX_JSON_DEPTH, what: str = "header") -> JsonDocument:
    """Decode UTF-8 JSON the way the reference reader would accept it, recording duplicate keys.

    Never raises for bad input: invalid UTF-8, invalid JSON, NaN/Infinity, excessive nesting and
    container floods all come back as `JsonDocument.error` (with `header-*` codes; `what` names the
    document in messages, and callers checking other documents map the code to their own).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        return JsonDocument(
            None, _error("header-not-utf8", f"{what} is not UTF-8 ({error.reason} at byte {error.start})")
        )
    complexity = _json_complexity_problem(data, max_depth, what)
    if complexity is not None:
        return JsonDocument(None, complexity)
    duplicates: list[DuplicateKey] = []

    def collect_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                duplicates.append(DuplicateKey(result, key, result[key]))  # holds the dict: `is` stays valid
            result[key] = value
        return result

    try:
        value = json.loads(text, object_pairs_hook=collect_pairs, parse_constant=_reject_constant, parse_int=_parse_int)
    except RecursionError:
        return JsonDocument(None, _error("header-too-complex", f"{what} JSON is nested too deeply"))
    except ValueError as error:  # JSONDecodeError, NaN/Infinity
        return JsonDocument(None, _error("header-invalid-json", f"{what} is not valid JSON: {error}"))
    return JsonDocument(value, None, tuple(duplicates))


# ---------------------------------------------------------------------------------------------------
# Rules 4-9: the parsed header


def _is_u64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX


def _is_dim(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DIM


_BAD_SHAPE = "shape must be a list of integers 0..2**63-1 (readers build tensors with signed 64-bit dimensions)"


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_metadata(value: Any) -> tuple[Mapping[str, str] | None, list[HeaderProblem]]:
    if value is None:
        # serde reads `null` as "no metadata"; the format says a map.
        return None, [_warning("bad-metadata", "__metadata__ is null; the format expects a map of strings")]
    if not isinstance(value, dict):
        return None, [_error("bad-metadata", f"__metadata__ must be a map of strings, not {type(value).__name__}")]
    bad = [key for key, item in value.items() if not isinstance(item, str)]
    if bad:
        return None, [
            _error(
                "bad-metadata",
                f"__metadata__ values must be strings; {printable(bad[0])!r} is {type(value[bad[0]]).__name__}",
            )
        ]
    if any(_has_lone_surrogate(key) or _has_lone_surrogate(item) for key, item in value.items()):
        return None, [_error("bad-metadata", "__metadata__ holds a lone UTF-16 surrogate, which is not valid UTF-8")]
    return dict(value), []


@dataclass(frozen=True, slots=True)
class _Span:
    name: str
    begin: int
    end: int


def _check_entry(name: str, entry: Any) -> tuple[TensorInfo | None, _Span | None, list[HeaderProblem]]:
    """Rules 5 and 7 for one tensor entry, plus the types rule 8 needs.

    The span (offsets) is returned whenever the offsets are well-typed, even if dtype or shape is not,
    so contiguity can still be checked over every entry.
    """
    shown = printable(name)
    if _has_lone_surrogate(name):
        return None, None, [_error("bad-tensor-entry", "tensor name holds a lone UTF-16 surrogate", shown)]
    if not isinstance(entry, dict):
        return None, None, [_error("bad-tensor-entry", f"entry is {type(entry).__name__}, not an object", shown)]
    missing = [field for field in TENSOR_FIELDS if field not in entry]
    if missing:
        return None, None, [_error("bad-tensor-entry", f"entry lacks {', '.join(missing)}", shown)]
    problems: list[HeaderProblem] = []
    extra = sorted(key for key in entry if key not in TENSOR_FIELDS)
    if extra:
        # The reference reader ignores unknown fields; still worth knowing about.
        problems.append(_warning("unknown-tensor-field", f"unknown fields {', '.join(map(repr, extra))}"[:200], shown))
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    span: _Span | None = None
    if isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(item) for item in offsets):
        span = _Span(name, offsets[0], offsets[1])
    else:
        problems.append(
            _error(
                "bad-offsets", f"data_offsets must be [begin, end], integers 0..2**64-1, got {offsets!r}"[:200], shown
            )
        )
    valid = span is not None
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        problems.append(_error("unknown-dtype", f"unknown dtype {dtype!r}"[:200], shown))
        valid = False
    if not isinstance(shape, list) or not all(_is_dim(dim) for dim in shape):
        problems.append(_error("bad-shape", f"{_BAD_SHAPE}, got {shape!r}"[:300], shown))
        valid = False
    if not valid or span is None:
        return None, span, problems
    return TensorInfo(name, dtype, _shared_shape(tuple(shape)), span.begin, span.end), None, problems


_shared_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}


def _shared_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """One tuple object per distinct shape (of the first 4096): headers repeat a few shapes many times."""
    shared = _shared_shapes.get(shape)
    if shared is not None:
        return shared
    if len(_shared_shapes) < 4096:
        _shared_shapes[shape] = shape
    return shape


def _shape_text(shape: Sequence[int]) -> str:
    text = str(list(shape))
    return text if len(text) <= 100 else text[:97] + "..."  # a hostile shape may have millions of dims


def tensor_nbits(dtype: str, shape: Sequence[int]) -> int | None:
    """prod(shape) * bits with the reference reader's 64-bit checked arithmetic; None on overflow."""
    elements = 1
    for dim in shape:
        elements *= dim
        if elements > U64_MAX:
            return None
    total = elements * DTYPE_BITS[dtype]
    return total if total <= U64_MAX else None


def _empty_extent_problem(tensor: TensorInfo) -> HeaderProblem | None:
    """An empty tensor whose other dimensions span more than 2**63-1 bytes: numpy refuses to build it ("array
    is too big") and torch overflows computing its strides, though it holds no element."""
    extent = math.prod(dim for dim in tensor.shape if dim)
    extent_bytes = -(-extent * DTYPE_BITS[tensor.dtype] // 8)
    if extent_bytes <= MAX_DIM:
        return None
    return _error(
        "bad-shape",
        f"empty {tensor.dtype} tensor of shape {_shape_text(tensor.shape)}: its non-zero dimensions span "
        f"{shown_number(extent_bytes)} bytes, over the 2**63-1 numpy and torch can build (even with no element)",
        printable(tensor.name),
    )


def _check_sizes(tensors: Sequence[TensorInfo]) -> Iterator[HeaderProblem]:
    """Rule 8: prod(shape) * bits / 8 == end - begin, with checked arithmetic."""
    for tensor in tensors:
        if tensor.end < tensor.begin:
            continue  # reported by the contiguity check
        nbits = tensor_nbits(tensor.dtype, tensor.shape)
        empty_extent = _empty_extent_problem(tensor) if nbits == 0 and tensor.shape else None
        if empty_extent is not None:
            yield empty_extent
        elif nbits is None:
            yield (
                _error(
                    "size-overflow",
                    f"shape {_shape_text(tensor.shape)} overflows 64-bit arithmetic",
                    printable(tensor.name),
                )
            )
        elif nbits % 8:
            yield (
                _error(
                    "size-not-whole-bytes",
                    f"{nbits} bits of {tensor.dtype} is not a whole number of bytes",
                    printable(tensor.name),
                )
            )
        elif nbits // 8 != tensor.nbytes:
            yield (
                _error(
                    "size-mismatch",
                    f"{tensor.dtype} {_shape_text(tensor.shape)} needs {nbits // 8:,} bytes "
                    f"but data_offsets span {tensor.nbytes:,}",
                    printable(tensor.name),
                )
            )


def _check_contiguity(spans: Sequence[TensorInfo | _Span]) -> Iterator[HeaderProblem]:
    """Rule 8: end >= begin, and sorted by (begin, end) each tensor starts where the previous ended, from 0."""
    expected_begin = 0
    in_order = all(
        (left.begin, left.end) <= (right.begin, right.end) for left, right in itertools.pairwise(spans)
    )  # as writers lay them out; sorting would allocate a key per tensor
    for span in spans if in_order else sorted(spans, key=lambda item: (item.begin, item.end)):
        if span.end < span.begin:
            yield (
                _error("offsets-reversed", f"data_offsets end {span.end} < begin {span.begin}", printable(span.name))
            )
            continue
        if span.begin > expected_begin:
            yield (
                _error(
                    "offsets-gap",
                    f"data starts at {span.begin:,}; the previous tensor ends at {expected_begin:,}",
                    printable(span.name),
                )
            )
        elif span.begin < expected_begin:
            yield (
                _error(
                    "offsets-overlap",
                    f"data starts at {span.begin:,}, inside the previous tensor (ends {expected_begin:,})",
                    printable(span.name),
                )
            )
        expected_begin = max(expected_begin, span.end)


# Parsing keeps at most this many problems of one code (as many as verify-index shows per code and file)
# and counts the rest, so a header of a million bad entries costs no more memory than a good one.
PROBLEMS_KEPT_PER_CODE = 25
# A value the compact scanner cannot read directly (not a canonical tensor entry) is decoded with the json
# module, which costs up to ~12 bytes of memory per byte of text: only values up to this size are.
# A well-formed tensor entry is a few hundred bytes; the reference reader's own maps stay far smaller.
MAX_ENTRY_BYTES = 1 << 20

# The scanner works on the raw UTF-8 bytes (validated first): no str copy of the header is made.
_WS = rb"[ \t\n\r]*"
_U64_TOKEN = rb"(?:0|[1-9][0-9]{0,19})(?![0-9.eE])"  # JSON integer of at most 20 digits; floats don't match
_CANONICAL_ENTRY = re.compile(
    rb"\{W\"dtype\"W:W\"(?P<dtype>[A-Z0-9_]{1,32})\"W,W\"shape\"W:W\[W(?P<shape>(?:U(?:W,WU)*)?)W\]W,W"
    rb"\"data_offsets\"W:W\[W(?P<begin>U)W,W(?P<end>U)W\]W\}".replace(b"W", _WS).replace(b"U", _U64_TOKEN)
)
_FAST_ENTRY = re.compile(  # a whole canonical root entry with a plain name, and the comma after it
    rb'"([^"\\\x00-\x1f]*)"' + _WS + rb":" + _WS + _CANONICAL_ENTRY.pattern + _WS + rb"(?P<comma>," + _WS + rb'(?="))?'
)
_SIMPLE_STRING = re.compile(rb'"([^"\\\x00-\x1f]*)"')  # no escapes, no control characters
_ANY_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_SCALAR = re.compile(rb"[-+0-9.eEa-zA-Z]{1,4400}")  # a number or literal, judged by the json module
_SKIP_WS = re.compile(_WS)
_UTF8_CHUNK = 1 << 20


class _HeaderSyntaxError(Exception):
    def __init__(self, problem: HeaderProblem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def _invalid_json(message: str, position: int) -> _HeaderSyntaxError:
    return _HeaderSyntaxError(_error("header-invalid-json", f"header is not valid JSON: {message} at byte {position}"))


def _utf8_problem(data: bytes, what: str = "header") -> HeaderProblem | None:
    """Validate UTF-8 in chunks, so no str copy of the whole header exists at once."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    for offset in range(0, len(data), _UTF8_CHUNK):
        try:
            decoder.decode(data[offset : offset + _UTF8_CHUNK], final=offset + _UTF8_CHUNK >= len(data))
        except UnicodeDecodeError as error:
            return _error("header-not-utf8", f"{what} is not UTF-8 ({error.reason} near byte {offset + error.start})")
    return None


@dataclass
class _ProblemLog:
    """Problems in order of appearance, at most PROBLEMS_KEPT_PER_CODE per code; the rest only counted."""

    kept: list[HeaderProblem]
    counts: dict[str, int]

    def add(self, problem: HeaderProblem) -> None:
        count = self.counts.get(problem.code, 0) + 1
        self.counts[problem.code] = count
        if count <= PROBLEMS_KEPT_PER_CODE:
            self.kept.append(problem)

    def extend(self, problems: Iterable[HeaderProblem]) -> None:
        for problem in problems:
            self.add(problem)

    def dropped(self) -> dict[str, int]:
        return {
            code: count - PROBLEMS_KEPT_PER_CODE
            for code, count in self.counts.items()
            if count > PROBLEMS_KEPT_PER_CODE
        }


class _Scanner:
    """Reads the header's root object entry by entry from the bytes, keeping only compact results.

    Canonical tensor entries (the reference writer's and torch's form) are matched by one regular
    expression each; anything else is decoded by the json module, one value of at most MAX_ENTRY_BYTES
    at a time, with the same strictness (`-0`, floats and NaN are not integers, duplicate keys recorded).
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.duplicates: list[DuplicateKey] = []
        self.decoder = json.JSONDecoder(
            object_pairs_hook=self._collect_pairs, parse_constant=_reject_constant, parse_int=_parse_int
        )

    def _collect_pairs(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                self.duplicates.append(DuplicateKey(result, key, result[key]))
            result[key] = value
        return result

    def skip_ws(self, position: int) -> int:
        match = _SKIP_WS.match(self.data, position)
        return match.end() if match else position

    def expect(self, position: int, byte: bytes) -> int:
        if self.data[position : position + 1] != byte:
            found = self.data[position : position + 1]
            raise _invalid_json(
                f"expected {byte.decode()!r}, found {found.decode('latin-1') if found else 'the end'!r}", position
            )
        return position + 1

    def string(self, position: int) -> tuple[str, int]:
        simple = _SIMPLE_STRING.match(self.data, position)
        if simple:
            return simple.group(1).decode("utf-8"), simple.end()
        quoted = _ANY_STRING.match(self.data, position)
        if not quoted:
            raise _invalid_json("unterminated string", position)
        text = quoted.group().decode("utf-8")
        try:
            # Public at run time (the C scanner or its Python fallback), but left out of typeshed's json.decoder.
            value, _ = json.decoder.scanstring(text, 1, True)  # type: ignore[attr-defined]
        except ValueError as error:
            raise _invalid_json(str(error).split(":")[0], position) from None
        return value, quoted.end()

    def value_end(self, position: int) -> int:
        """Where the JSON value at `position` ends, found without decoding it; MAX_ENTRY_BYTES at most."""
        first = self.data[position : position + 1]
        if first == b'"':
            quoted = _ANY_STRING.match(self.data, position)
            if not quoted:
                raise _invalid_json("unterminated string", position)
            return quoted.end()
        if first not in (b"[", b"{"):
            scalar = _SCALAR.match(self.data, position)
            if not scalar:
                raise _invalid_json("expected a value", position)
            return scalar.end()
        limit = min(len(self.data), position + MAX_ENTRY_BYTES)
        depth = 0
        for match in _JSON_TOKEN.finditer(self.data, position, limit):
            token = self.data[match.start()]
            if token == _QUOTE:
                continue
            depth += 1 if token in _OPENERS else -1
            if depth == 0:
                return match.end()
        if limit < len(self.data):
            raise _HeaderSyntaxError(
                _error("header-too-complex", f"a value at byte {position:,} is over {MAX_ENTRY_BYTES:,} bytes")
            )
        raise _invalid_json("unbalanced brackets", position)

    def value(self, position: int) -> tuple[Any, int]:
        end = self.value_end(position)
        # One level less than the whole header's limit: the root object is the first level.
        complexity = _json_complexity_problem(self.data[position:end], MAX_JSON_DEPTH - 1, "header")
        if complexity is not None:
            raise _HeaderSyntaxError(complexity)
        text = self.data[position:end].decode("utf-8")
        try:
            value, consumed = self.decoder.raw_decode(text)
        except RecursionError:
            raise _HeaderSyntaxError(_error("header-too-complex", "header JSON is nested too deeply")) from None
        except ValueError as error:  # JSONDecodeError, NaN/Infinity
            raise _invalid_json(str(error).split(":")[0], position) from None
        if consumed != len(text):
            raise _invalid_json("unexpected characters", position + len(text[:consumed].encode("utf-8")))
        return value, end


def parse_header(header_json: bytes, object_size: int | None = None) -> ParsedHeader:
    """Rules 4-9 for the N header bytes (without the length field). Rule 9 needs `object_size`.

    Memory stays near the size of what is kept (names, shapes, offsets: about 2 bytes per header byte for
    a large header), whatever the header holds; see `_Scanner`.
    """
    header_length = len(header_json)
    log = _ProblemLog([], {})
    if header_length > HF_MAX_HEADER_BYTES:
        log.add(
            _warning(
                "header-over-hf-limit",
                f"header is {header_length:,} bytes; huggingface_hub refuses headers over {HF_MAX_HEADER_BYTES:,}",
            )
        )
    utf8 = _utf8_problem(header_json)
    if utf8 is not None:
        return ParsedHeader(header_length, (), None, (*log.kept, utf8))
    scanner = _Scanner(header_json)
    start = scanner.skip_ws(0)
    if header_json[start : start + 1] != b"{":
        return ParsedHeader(header_length, (), None, (*log.kept, _not_an_object(header_json)))
    if start:
        log.add(
            _warning("header-leading-whitespace", "header starts with whitespace; the format says it starts with '{'")
        )
    root = _Root(log)
    try:
        _scan_root(scanner, start, root)
    except _HeaderSyntaxError as failure:
        return ParsedHeader(header_length, (), None, (*log.kept, failure.problem))
    root.apply_later_entries()
    tensors, spans, entries, metadata = root.tensors, root.spans, root.entries, root.metadata
    del root, scanner

    log.extend(_check_sizes(tensors))
    # Without every entry's offsets, a "gap" would only be the unreadable entry: skip rules 8-9 layout.
    all_spans = len(tensors) + len(spans) == entries
    if all_spans:
        log.extend(_check_contiguity([*tensors, *spans]))
    contiguous = all_spans and not any(code in log.counts for code in _LAYOUT_CODES)
    if object_size is not None and contiguous:
        data_end = max(max((tensor.end for tensor in tensors), default=0), max((span.end for span in spans), default=0))
        expected = HEADER_LENGTH_BYTES + header_length + data_end
        if expected > object_size:
            cut = _first_cut_tensor([*tensors, *spans], object_size - HEADER_LENGTH_BYTES - header_length)
            log.add(
                _error(
                    "file-truncated",
                    f"header and offsets need {expected:,} bytes; the object has {object_size:,}, so this "
                    "tensor's data is cut short (and any after it)",
                    printable(cut.name),
                )
            )
        elif expected < object_size:
            log.add(
                _error(
                    "file-trailing-bytes",
                    f"the object has {object_size - expected:,} bytes after the last tensor "
                    f"({object_size:,} > {expected:,})",
                )
            )
    complete = len(tensors) == entries
    return ParsedHeader(
        header_length, tuple(tensors), metadata, tuple(log.kept), complete=complete, dropped=log.dropped()
    )


def _first_cut_tensor(spans: Sequence[TensorInfo | _Span], data_available: int) -> TensorInfo | _Span:
    """The tensor a reader fails on in a truncated file: the first, in file order, whose data ends past it."""
    return min((span for span in spans if span.end > data_available), key=lambda span: (span.begin, span.end))


@dataclass
class _Root:
    """What the root object's entries leave behind.

    A name seen twice is loaded from its last entry by every reader (serde_json's map, the streamer):
    the last entry replaces the earlier one here too, so the layout rules judge what is loaded.
    """

    log: _ProblemLog
    tensors: list[TensorInfo] = field(default_factory=list)
    spans: list[_Span] = field(default_factory=list)  # usable offsets of entries that are not well-formed tensors
    seen: set[str] = field(default_factory=set)  # names of the entries kept (tensors, spans, metadata)
    entries: int = 0
    metadata: Mapping[str, str] | None = None
    last_end: int = 0  # the end offset of the last tensor kept
    # The last entry of each name seen more than once (rare), applied by `apply_later_entries`.
    later: dict[str, tuple[TensorInfo | None, _Span | None]] = field(default_factory=dict)

    def entry(self, name: str, result: tuple[TensorInfo | None, _Span | None, list[HeaderProblem]]) -> None:
        tensor, span, problems = result
        if problems:
            self.log.extend(problems)
        if name in self.seen:
            self.log.add(
                _warning(
                    "duplicate-tensor",
                    "tensor appears more than once in the header; the safetensors reader, vLLM and the Run:ai "
                    "streamer load its last entry",
                    printable(name),
                )
            )
            self.later[name] = (tensor, span)
            return
        self.entries += 1
        if tensor is not None:
            self.tensors.append(tensor)
            self.last_end = tensor.end
        elif span is not None:
            self.spans.append(span)
        else:
            return  # a broken entry: its name is not kept, so a later duplicate of it goes unnoticed (still an error)
        self.seen.add(name)

    def apply_later_entries(self) -> None:
        """Replace the first entry of each repeated name by its last one (one pass over the entries)."""
        if not self.later:
            return
        self.tensors = [tensor for tensor in self.tensors if tensor.name not in self.later]
        self.spans = [span for span in self.spans if span.name not in self.later]
        for tensor, span in self.later.values():
            if tensor is not None:
                self.tensors.append(tensor)
            elif span is not None:
                self.spans.append(span)
            # else a broken last entry: nothing of that name is usable, and the header is not `complete`
        self.later = {}


def _scan_root(scanner: _Scanner, start: int, root: _Root) -> None:
    """Walk the root object from its '{' at `start`: canonical entries in one match each, the rest in steps."""
    data = scanner.data
    position = scanner.skip_ws(start + 1)
    if data[position : position + 1] == b"}":
        position += 1
    else:
        while True:
            fast = _FAST_ENTRY.match(data, position)
            if fast is not None and fast.group(1) != _METADATA_KEY_BYTES:
                name = fast.group(1).decode("utf-8")
                root.entry(name, _canonical_entry(name, fast, root.last_end))
                position = fast.end()
                if fast.group("comma") is not None:  # another entry follows
                    continue
            else:
                if data[position : position + 1] != b'"':
                    raise _invalid_json("expected a string key", position)
                name, position = scanner.string(position)
                position = scanner.skip_ws(scanner.expect(scanner.skip_ws(position), b":"))
                if name == METADATA_KEY:
                    if METADATA_KEY in root.seen:
                        root.log.add(
                            _error(
                                "duplicate-key",
                                f"{METADATA_KEY!r} appears twice; the safetensors reader (and so vLLM) refuses it "
                                "as a duplicate field, while the Run:ai streamer loads the file",
                            )
                        )
                    root.seen.add(METADATA_KEY)
                    seen_duplicates = len(scanner.duplicates)
                    value, position = scanner.value(position)
                    root.metadata, problems = _check_metadata(value)
                    root.log.extend(problems)
                    root.log.extend(_metadata_duplicates(value, scanner.duplicates[seen_duplicates:]))
                    del scanner.duplicates[seen_duplicates:]
                else:
                    canonical = _CANONICAL_ENTRY.match(data, position)
                    if canonical is not None:
                        root.entry(name, _canonical_entry(name, canonical, root.last_end))
                        position = canonical.end()
                    else:
                        seen_duplicates = len(scanner.duplicates)
                        value, position = scanner.value(position)
                        entry_result = _check_entry(name, value)
                        entry_result[2].extend(_entry_duplicates(name, value, scanner.duplicates[seen_duplicates:]))
                        del scanner.duplicates[seen_duplicates:]
                        root.entry(name, entry_result)
                        del value
                position = scanner.skip_ws(position)
                if data[position : position + 1] == b",":
                    position = scanner.skip_ws(position + 1)
                    continue
            position = scanner.expect(scanner.skip_ws(position), b"}")
            break
    position = scanner.skip_ws(position)
    if position != len(data):
        raise _invalid_json("trailing characters", position)


def _entry_duplicates(name: str, entry: Any, duplicates: Sequence[DuplicateKey]) -> Iterator[HeaderProblem]:
    """A field of the format repeated in one tensor entry: the reference reader refuses it ("duplicate field"),
    the Run:ai streamer takes the last, so the readers disagree. Repeated unknown fields (or keys nested in
    them) are ignored by every reader, as the fields themselves are."""
    for duplicate in duplicates:
        if duplicate.owner is entry and duplicate.key in TENSOR_FIELDS:
            yield _error(
                "duplicate-key",
                f"field {duplicate.key!r} appears twice in the tensor's entry; the safetensors reader (and so vLLM) "
                "refuses it as a duplicate field, while the Run:ai streamer takes the last",
                printable(name),
            )


def _metadata_duplicates(metadata: Any, duplicates: Sequence[DuplicateKey]) -> Iterator[HeaderProblem]:
    """A key repeated in `__metadata__`: every reader keeps the last value, but the reference reader checks
    each value as it comes, so an earlier value that is not a string fails it (and not the streamer)."""
    for duplicate in duplicates:
        if duplicate.owner is not metadata:
            continue  # nested in a value that is not a string: already a bad-metadata error
        shown = printable(duplicate.key)
        if not isinstance(duplicate.earlier, str):
            yield _error(
                "bad-metadata",
                f"__metadata__ values must be strings; the first {shown!r} is {type(duplicate.earlier).__name__} "
                "(the safetensors reader checks every value, even one a later key replaces)",
            )
        else:
            yield _warning(
                "duplicate-metadata-key",
                f"__metadata__ key {shown!r} appears more than once; every reader keeps the last value",
            )


def _not_an_object(header_json: bytes) -> HeaderProblem:
    """The problem with a header whose root is not an object: invalid JSON, or JSON of another type."""
    if len(header_json) > MAX_ENTRY_BYTES:
        return _error("header-not-object", "header is not a JSON object (it does not start with '{')")
    document = decode_json_strictly(header_json)
    if document.error is not None:
        return document.error
    return _error("header-not-object", f"header is a JSON {type(document.value).__name__}, not an object")


def _canonical_entry(
    name: str, match: re.Match[bytes], previous_end: int = 0
) -> tuple[TensorInfo | None, _Span | None, list[HeaderProblem]]:
    """A tensor entry in the canonical form: only the dtype and the 64-bit ranges are left to check.

    A tensor usually begins where the previous one ended: that int object is shared, not made twice.
    """
    if _has_lone_surrogate(name):  # only an escaped name (`\ud800`) can hold one
        return None, None, [_error("bad-tensor-entry", "tensor name holds a lone UTF-16 surrogate", printable(name))]
    begin, end = int(match.group("begin")), int(match.group("end"))
    if begin == previous_end:
        begin = previous_end
    if begin > U64_MAX or end > U64_MAX:  # 20 digits can still be too many
        message = f"data_offsets must be [begin, end], integers 0..2**64-1, got [{begin}, {end}]"
        return None, None, [_error("bad-offsets", message, printable(name))]
    shape_text = match.group("shape")
    cached = _shape_cache.get(shape_text)
    if cached is None:
        parsed = tuple(int(dim) for dim in shape_text.split(b",")) if shape_text.strip() else ()
        cached = parsed, all(dim <= MAX_DIM for dim in parsed)
        if len(_shape_cache) < 4096:  # MoE checkpoints repeat a few shapes a million times: share them
            _shape_cache[shape_text] = cached
    shape, shape_ok = cached
    dtype = _DTYPE_NAMES.get(match.group("dtype"))
    if dtype is not None and shape_ok:
        return TensorInfo(name, dtype, shape, begin, end), None, []
    problems: list[HeaderProblem] = []
    if dtype is None:
        problems.append(_error("unknown-dtype", f"unknown dtype {match.group('dtype').decode()!r}", printable(name)))
    if not shape_ok:
        message = f"{_BAD_SHAPE}, got {_shape_text(shape)}"
        problems.append(_error("bad-shape", message, printable(name)))
    return None, _Span(name, begin, end), problems


_METADATA_KEY_BYTES = METADATA_KEY.encode()
_LAYOUT_CODES = ("offsets-reversed", "offsets-gap", "offsets-overlap")
_DTYPE_NAMES: Mapping[bytes, str] = {name.encode(): name for name in DTYPE_BITS}
_shape_cache: dict[bytes, tuple[tuple[int, ...], bool]] = {}


def parse_safetensors_bytes(data: bytes) -> ParsedHeader:
    """Rules 1-9 for a whole file held in memory (tests, small files)."""
    if len(data) < HEADER_LENGTH_BYTES:
        return ParsedHeader(0, (), None, (_file_too_small(len(data)),))
    header_length = decode_header_length(data)
    problem = check_header_length(header_length, len(data))
    if problem is not None:
        return ParsedHeader(header_length, (), None, (problem,))
    return parse_header(data[HEADER_LENGTH_BYTES : HEADER_LENGTH_BYTES + header_length], len(data))


# ---------------------------------------------------------------------------------------------------
# Reading a header through a Store


def read_header(store: Store, key: str, size: int, speculative_bytes: int = DEFAULT_SPECULATIVE_BYTES) -> HeaderRead:
    """Fetch the N header bytes of `key` (whose listed size is `size`) with one ranged read, or two.

    The first read covers min(size, speculative_bytes) bytes; a second read fetches the rest of the
    header only when 8 + N exceeds it, and only after N has passed rules 2 and 3. An object that is
    gone or shorter than listed becomes a problem; other store errors (access, network) propagate.
    """
    if size < HEADER_LENGTH_BYTES:
        return HeaderRead(None, _file_too_small(size), 0, 0)
    first_length = min(size, max(HEADER_LENGTH_BYTES, speculative_bytes))
    requests = 1
    try:
        head = store.read_range(key, 0, first_length)
    except NotFoundError:
        return HeaderRead(None, _error("object-vanished", "listed, but gone when its header was read"), requests, 0)
    bytes_read = len(head)
    if len(head) < HEADER_LENGTH_BYTES:
        return HeaderRead(None, _changed(size, len(head)), requests, bytes_read)
    header_length = decode_header_length(head)
    problem = check_header_length(header_length, size)
    if problem is not None:
        return HeaderRead(None, problem, requests, bytes_read)
    header_end = HEADER_LENGTH_BYTES + header_length
    if header_end <= len(head):
        return HeaderRead(head[HEADER_LENGTH_BYTES:header_end], None, requests, bytes_read)
    if len(head) < first_length:
        return HeaderRead(None, _changed(size, len(head)), requests, bytes_read)
    requests += 1
    try:
        rest = store.read_range(key, len(head), header_end - len(head))
    except NotFoundError:
        return HeaderRead(
            None, _error("object-vanished", "listed, but gone when its header was read"), requests, bytes_read
        )
    bytes_read += len(rest)
    if len(head) + len(rest) < header_end:
        return HeaderRead(None, _changed(size, len(head) + len(rest)), requests, bytes_read)
    return HeaderRead(head[HEADER_LENGTH_BYTES:] + rest, None, requests, bytes_read)


def _changed(listed_size: int, available: int) -> HeaderProblem:
    return _error("object-changed", f"listed as {listed_size:,} bytes, but only {available:,} could be read")


# ---------------------------------------------------------------------------------------------------
# Writing


TensorLayout = tuple[str, str, Sequence[int], int]  # name, dtype, shape, nbytes
TensorData = tuple[str, str, Sequence[int], bytes]  # name, dtype, shape, data


def encode_safetensors_header(
    tensors: Sequence[TensorLayout], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """The bytes before the data (8-byte length + JSON padded with spaces to a multiple of 8), and the
    (begin, end) offsets of each tensor, laid out in the order given.

    Raises UsageError for anything a reader would refuse, so a writer never produces an invalid file.
    """
    header: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()):
            raise UsageError("safetensors metadata must map strings to strings")
        header[METADATA_KEY] = dict(metadata)
    offsets: list[tuple[int, int]] = []
    position = 0
    for name, dtype, shape, nbytes in tensors:
        if name == METADATA_KEY or name in header:
            raise UsageError(f"tensor name {name!r} is reserved or repeated")
        if dtype not in DTYPE_BITS:
            raise UsageError(f"unknown safetensors dtype {dtype!r} for {name!r}")
        if not all(_is_dim(dim) for dim in shape):
            raise UsageError(f"invalid shape {list(shape)!r} for {name!r}")
        nbits = tensor_nbits(dtype, shape)
        if nbits is None or nbits % 8 or nbits // 8 != nbytes:
            raise UsageError(f"{name!r}: {dtype} {list(shape)} does not take {nbytes} bytes")
        offsets.append((position, position + nbytes))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + nbytes]}
        position += nbytes
    try:
        encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise UsageError(f"tensor or metadata name is not valid UTF-8: {error}") from None
    # Pad with spaces so the data buffer starts 8-aligned, as the reference writer does.
    padded_length = math.ceil(len(encoded) / HEADER_LENGTH_BYTES) * HEADER_LENGTH_BYTES
    if padded_length > MAX_HEADER_BYTES:
        raise UsageError(f"header of {padded_length:,} bytes exceeds the {MAX_HEADER_BYTES:,}-byte limit")
    padded = encoded.ljust(padded_length, b" ")
    return struct.pack("<Q", padded_length) + padded, offsets


def safetensors_bytes(tensors: Sequence[TensorData], metadata: Mapping[str, str] | None = None) -> bytes:
    """A whole safetensors file in memory, tensors laid out in the order given."""
    prefix, _ = encode_safetensors_header(
        [(name, dtype, shape, len(data)) for name, dtype, shape, data in tensors], metadata
    )
    return prefix + b"".join(data for _, _, _, data in tensors)


def write_safetensors(
    store: Store, key: str, tensors: Sequence[TensorData], metadata: Mapping[str, str] | None = None
) -> ObjectInfo:
    """Write a (small) safetensors file to `key` in one put."""
    return store.put(key, safetensors_bytes(tensors, metadata))
