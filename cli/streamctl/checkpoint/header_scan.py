"""The compact header scanner: `parse_header` applies rules 4-9 to the N header bytes.

Memory: `parse_header` scans the raw bytes entry by entry (`_Scanner`) and keeps only compact results
(a slotted `TensorInfo` per tensor, shared shape tuples, at most PROBLEMS_KEPT_PER_CODE problems per code),
so a header costs about 2-3 bytes of memory per byte on top of its own bytes, whatever it holds, where
`json.loads` into dicts took several times more (figures: docs/measurements.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from streamctl.checkpoint.header_json import (
    JSON_TOKEN,
    MAX_JSON_DEPTH,
    OPENERS,
    QUOTE,
    DuplicateKey,
    decode_json_strictly,
    json_complexity_problem,
    parse_int,
    reject_constant,
    utf8_problem,
)
from streamctl.checkpoint.header_rules import (
    BAD_SHAPE,
    Span,
    check_contiguity,
    check_entry,
    check_file_size,
    check_metadata,
    check_sizes,
    entry_duplicates,
    has_lone_surrogate,
    metadata_duplicates,
    shown_shape,
)
from streamctl.checkpoint.header_types import (
    DTYPE_BITS,
    HF_MAX_HEADER_BYTES,
    MAX_DIM,
    METADATA_KEY,
    U64_MAX,
    HeaderProblem,
    ParsedHeader,
    TensorInfo,
    header_error,
    header_warning,
    printable,
)

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


class _HeaderSyntaxError(Exception):
    def __init__(self, problem: HeaderProblem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def _invalid_json(message: str, position: int) -> _HeaderSyntaxError:
    return _HeaderSyntaxError(
        header_error("header-invalid-json", f"header is not valid JSON: {message} at byte {position}")
    )


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
            object_pairs_hook=self._collect_pairs, parse_constant=reject_constant, parse_int=parse_int
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
        for match in JSON_TOKEN.finditer(self.data, position, limit):
            token = self.data[match.start()]
            if token == QUOTE:
                continue
            depth += 1 if token in OPENERS else -1
            if depth == 0:
                return match.end()
        if limit < len(self.data):
            raise _HeaderSyntaxError(
                header_error("header-too-complex", f"a value at byte {position:,} is over {MAX_ENTRY_BYTES:,} bytes")
            )
        raise _invalid_json("unbalanced brackets", position)

    def value(self, position: int) -> tuple[Any, int]:
        end = self.value_end(position)
        # One level less than the whole header's limit: the root object is the first level.
        complexity = json_complexity_problem(self.data[position:end], MAX_JSON_DEPTH - 1, "header")
        if complexity is not None:
            raise _HeaderSyntaxError(complexity)
        text = self.data[position:end].decode("utf-8")
        try:
            value, consumed = self.decoder.raw_decode(text)
        except RecursionError:
            raise _HeaderSyntaxError(header_error("header-too-complex", "header JSON is nested too deeply")) from None
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
            header_warning(
                "header-over-hf-limit",
                f"header is {header_length:,} bytes; huggingface_hub refuses headers over {HF_MAX_HEADER_BYTES:,}",
            )
        )
    utf8 = utf8_problem(header_json)
    if utf8 is not None:
        return ParsedHeader(header_length, (), None, (*log.kept, utf8))
    scanner = _Scanner(header_json)
    start = scanner.skip_ws(0)
    if header_json[start : start + 1] != b"{":
        return ParsedHeader(header_length, (), None, (*log.kept, _not_an_object(header_json)))
    if start:
        log.add(
            header_warning(
                "header-leading-whitespace", "header starts with whitespace; the format says it starts with '{'"
            )
        )
    root = _Root(log)
    try:
        _scan_root(scanner, start, root)
    except _HeaderSyntaxError as failure:
        return ParsedHeader(header_length, (), None, (*log.kept, failure.problem))
    root.apply_later_entries()
    tensors, spans, entries, metadata = root.tensors, root.spans, root.entries, root.metadata
    del root, scanner

    log.extend(check_sizes(tensors))
    # Without every entry's offsets, a "gap" would only be the unreadable entry: skip rules 8-9 layout.
    all_spans = len(tensors) + len(spans) == entries
    if all_spans:
        log.extend(check_contiguity([*tensors, *spans]))
    contiguous = all_spans and not any(code in log.counts for code in _LAYOUT_CODES)
    if object_size is not None and contiguous:
        size_problem = check_file_size([*tensors, *spans], header_length, object_size)
        if size_problem is not None:
            log.add(size_problem)
    complete = len(tensors) == entries
    return ParsedHeader(
        header_length, tuple(tensors), metadata, tuple(log.kept), complete=complete, dropped=log.dropped()
    )


@dataclass
class _Root:
    """What the root object's entries leave behind.

    A name seen twice is loaded from its last entry by every reader (serde_json's map, the streamer):
    the last entry replaces the earlier one here too, so the layout rules judge what is loaded.
    """

    log: _ProblemLog
    tensors: list[TensorInfo] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)  # usable offsets of entries that are not well-formed tensors
    seen: set[str] = field(default_factory=set)  # names of the entries kept (tensors, spans, metadata)
    entries: int = 0
    metadata: Mapping[str, str] | None = None
    last_end: int = 0  # the end offset of the last tensor kept
    # The last entry of each name seen more than once (rare), applied by `apply_later_entries`.
    later: dict[str, tuple[TensorInfo | None, Span | None]] = field(default_factory=dict)

    def entry(self, name: str, result: tuple[TensorInfo | None, Span | None, list[HeaderProblem]]) -> None:
        tensor, span, problems = result
        if problems:
            self.log.extend(problems)
        if name in self.seen:
            self.log.add(
                header_warning(
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
                            header_error(
                                "duplicate-key",
                                f"{METADATA_KEY!r} appears twice; the safetensors reader (and so vLLM) refuses it "
                                "as a duplicate field, while the Run:ai streamer loads the file",
                            )
                        )
                    root.seen.add(METADATA_KEY)
                    seen_duplicates = len(scanner.duplicates)
                    value, position = scanner.value(position)
                    root.metadata, problems = check_metadata(value)
                    root.log.extend(problems)
                    root.log.extend(metadata_duplicates(value, scanner.duplicates[seen_duplicates:]))
                    del scanner.duplicates[seen_duplicates:]
                else:
                    canonical = _CANONICAL_ENTRY.match(data, position)
                    if canonical is not None:
                        root.entry(name, _canonical_entry(name, canonical, root.last_end))
                        position = canonical.end()
                    else:
                        seen_duplicates = len(scanner.duplicates)
                        value, position = scanner.value(position)
                        entry_result = check_entry(name, value)
                        entry_result[2].extend(entry_duplicates(name, value, scanner.duplicates[seen_duplicates:]))
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


def _not_an_object(header_json: bytes) -> HeaderProblem:
    """The problem with a header whose root is not an object: invalid JSON, or JSON of another type."""
    if len(header_json) > MAX_ENTRY_BYTES:
        return header_error("header-not-object", "header is not a JSON object (it does not start with '{')")
    document = decode_json_strictly(header_json)
    if document.error is not None:
        return document.error
    return header_error("header-not-object", f"header is a JSON {type(document.value).__name__}, not an object")


def _canonical_entry(
    name: str, match: re.Match[bytes], previous_end: int = 0
) -> tuple[TensorInfo | None, Span | None, list[HeaderProblem]]:
    """A tensor entry in the canonical form: only the dtype and the 64-bit ranges are left to check.

    A tensor usually begins where the previous one ended: that int object is shared, not made twice.
    """
    if has_lone_surrogate(name):  # only an escaped name (`\ud800`) can hold one
        return (
            None,
            None,
            [header_error("bad-tensor-entry", "tensor name holds a lone UTF-16 surrogate", printable(name))],
        )
    begin, end = int(match.group("begin")), int(match.group("end"))
    if begin == previous_end:
        begin = previous_end
    if begin > U64_MAX or end > U64_MAX:  # 20 digits can still be too many
        message = f"data_offsets must be [begin, end], integers 0..2**64-1, got [{begin}, {end}]"
        return None, None, [header_error("bad-offsets", message, printable(name))]
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
        problems.append(
            header_error("unknown-dtype", f"unknown dtype {match.group('dtype').decode()!r}", printable(name))
        )
    if not shape_ok:
        message = f"{BAD_SHAPE}, got {shown_shape(shape)}"
        problems.append(header_error("bad-shape", message, printable(name)))
    return None, Span(name, begin, end), problems


_METADATA_KEY_BYTES = METADATA_KEY.encode()
_LAYOUT_CODES = ("offsets-reversed", "offsets-gap", "offsets-overlap")
_DTYPE_NAMES: Mapping[bytes, str] = {name.encode(): name for name in DTYPE_BITS}
_shape_cache: dict[bytes, tuple[tuple[int, ...], bool]] = {}
