"""The safetensors format: check a header against the format's rules, and write small files.

Pure functions, no numpy. The only I/O is `read_header` and `write_safetensors`, through a `Store`.
The rules are numbered as in `docs/specs/safetensors-and-index.md`; every check needs only the object
size and the first 8 + N bytes, so tensor data is never read.

A header is untrusted input: nothing is allocated from its length field before that length has been
checked against the object size and the 100,000,000-byte cap, JSON nesting is bounded before parsing,
and problems come back as values (`HeaderProblem`) instead of exceptions.

This module holds rules 1-3 (the length field), the reader and the writer, and is the package's one door
to the format: the names of the modules below are re-exported here.
- header_types: the limits, the dtypes and the result types (`TensorInfo`, `HeaderProblem`, `ParsedHeader`);
- header_json: rules 4 and 6, strict JSON (`decode_json_strictly`);
- header_rules: rules 5 and 7-9 on the entries;
- header_scan: `parse_header`, the compact scanner that applies them to the N header bytes.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamctl.checkpoint.header_json import MAX_JSON_DEPTH, DuplicateKey, JsonDocument, decode_json_strictly
from streamctl.checkpoint.header_rules import is_dim, tensor_nbits
from streamctl.checkpoint.header_scan import MAX_ENTRY_BYTES, PROBLEMS_KEPT_PER_CODE, parse_header
from streamctl.checkpoint.header_types import (
    DEFAULT_SPECULATIVE_BYTES,
    DTYPE_BITS,
    HEADER_LENGTH_BYTES,
    HF_MAX_HEADER_BYTES,
    MAX_DIM,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    TENSOR_FIELDS,
    U64_MAX,
    HeaderProblem,
    ParsedHeader,
    Severity,
    TensorInfo,
    header_error,
    printable,
)
from streamctl.errors import NotFoundError, UsageError
from streamctl.storage.base import ObjectInfo, Store

__all__ = [
    "DEFAULT_SPECULATIVE_BYTES",
    "DTYPE_BITS",
    "HEADER_LENGTH_BYTES",
    "HF_MAX_HEADER_BYTES",
    "MAX_DIM",
    "MAX_ENTRY_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_JSON_DEPTH",
    "METADATA_KEY",
    "PROBLEMS_KEPT_PER_CODE",
    "TENSOR_FIELDS",
    "U64_MAX",
    "DuplicateKey",
    "HeaderProblem",
    "HeaderRead",
    "JsonDocument",
    "ParsedHeader",
    "Severity",
    "TensorData",
    "TensorInfo",
    "TensorLayout",
    "check_header_length",
    "decode_header_length",
    "decode_json_strictly",
    "encode_safetensors_header",
    "parse_header",
    "parse_safetensors_bytes",
    "printable",
    "read_header",
    "safetensors_bytes",
    "tensor_nbits",
    "write_safetensors",
]


@dataclass(frozen=True)
class HeaderRead:
    """The outcome of `read_header`: the N header bytes, or the problem that stopped the read."""

    header_json: bytes | None
    problem: HeaderProblem | None
    requests: int
    bytes_read: int


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
        return header_error(
            "header-too-large",
            f"header length {header_length:,} exceeds the {MAX_HEADER_BYTES:,}-byte limit of the safetensors "
            "reader and the Run:ai streamer",
        )
    if HEADER_LENGTH_BYTES + header_length > object_size:
        return header_error(
            "header-exceeds-file",
            f"header length {header_length:,} needs {HEADER_LENGTH_BYTES + header_length:,} bytes but the "
            f"object has {object_size:,}",
        )
    return None


def _file_too_small(object_size: int) -> HeaderProblem:
    return header_error(
        "file-too-small", f"{object_size} bytes: a safetensors file starts with an 8-byte header length"
    )


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
        return HeaderRead(
            None, header_error("object-vanished", "listed, but gone when its header was read"), requests, 0
        )
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
            None, header_error("object-vanished", "listed, but gone when its header was read"), requests, bytes_read
        )
    bytes_read += len(rest)
    if len(head) + len(rest) < header_end:
        return HeaderRead(None, _changed(size, len(head) + len(rest)), requests, bytes_read)
    return HeaderRead(head[HEADER_LENGTH_BYTES:] + rest, None, requests, bytes_read)


def _changed(listed_size: int, available: int) -> HeaderProblem:
    return header_error("object-changed", f"listed as {listed_size:,} bytes, but only {available:,} could be read")


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
        if not all(is_dim(dim) for dim in shape):
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
