"""Rules 4 and 6 of a safetensors header: JSON decoded as strictly as the reference reader (serde_json) does.

A header is untrusted input: nesting depth and container floods are bounded before the recursive parser
sees the text, NaN/Infinity are refused, integers are read as serde_json reads them (`-0`, `1.0`, `1e3` and
anything past 2**64-1 are not integers), duplicate keys are recorded, and every failure comes back as a
`HeaderProblem`, never an exception. Other JSON documents of a checkpoint (config.json, the index) are
decoded by the same rule (`decode_json_strictly`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from streamctl.checkpoint.header_types import HeaderProblem, header_error

# A valid header nests three levels deep (object -> tensor entry -> shape list); anything far deeper is
# an attack or garbage, and must be refused before the recursive JSON parser sees it.
MAX_JSON_DEPTH = 64
# The smallest possible tensor entry (`"":{"dtype":"U8","shape":[],"data_offsets":[0,0]}`) is 47 bytes
# for 3 containers, so a valid header never has more than one container per 15 bytes. Many more means a
# JSON bomb such as `[[],[],...]` that would cost ~60 bytes of memory per 2 bytes of input.
_MIN_BYTES_PER_CONTAINER = 8
_FLOOD_CHECK_FROM_CHARS = 1_000_000


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


# A JSON string, or one bracket. Scanned on the raw UTF-8 bytes: quotes, backslashes and brackets are
# ASCII, and no byte of a multi-byte UTF-8 sequence can be mistaken for one of them.
JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
QUOTE, OPENERS = ord('"'), (ord("["), ord("{"))


def json_complexity_problem(data: bytes, max_depth: int, what: str) -> HeaderProblem | None:
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
    for match in JSON_TOKEN.finditer(data):
        token = data[match.start()]
        if token == QUOTE:
            continue  # brackets inside strings are text, not structure
        if token in OPENERS:
            depth += 1
            containers += 1
            if depth > max_depth:
                return header_error("header-too-complex", f"{what} JSON is nested deeper than {max_depth} levels")
            if flood_limit is not None and containers > flood_limit:
                return header_error(
                    "header-too-complex", f"{what} JSON has over {flood_limit:,} arrays/objects in {len(data):,} bytes"
                )
        else:
            depth -= 1
    return None


class _RejectedConstant(ValueError):
    pass


def reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON (and serde_json in the reference reader) does not.
    raise _RejectedConstant(f"{name} is not valid JSON")


def parse_int(digits: str) -> int | float:
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
            None, header_error("header-not-utf8", f"{what} is not UTF-8 ({error.reason} at byte {error.start})")
        )
    complexity = json_complexity_problem(data, max_depth, what)
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
        value = json.loads(text, object_pairs_hook=collect_pairs, parse_constant=reject_constant, parse_int=parse_int)
    except RecursionError:
        return JsonDocument(None, header_error("header-too-complex", f"{what} JSON is nested too deeply"))
    except ValueError as error:  # JSONDecodeError, NaN/Infinity
        return JsonDocument(None, header_error("header-invalid-json", f"{what} is not valid JSON: {error}"))
    return JsonDocument(value, None, tuple(duplicates))


_UTF8_CHUNK = 1 << 20


def utf8_problem(data: bytes, what: str = "header") -> HeaderProblem | None:
    """Validate UTF-8 in chunks, so no str copy of the whole header exists at once."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    for offset in range(0, len(data), _UTF8_CHUNK):
        try:
            decoder.decode(data[offset : offset + _UTF8_CHUNK], final=offset + _UTF8_CHUNK >= len(data))
        except UnicodeDecodeError as error:
            return header_error(
                "header-not-utf8", f"{what} is not UTF-8 ({error.reason} near byte {offset + error.start})"
            )
    return None
