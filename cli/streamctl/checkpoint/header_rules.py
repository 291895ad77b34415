"""Rules 5 and 7-9 of a safetensors header, on its entries: tensor entries, `__metadata__`, sizes and layout.

Pure checks over decoded values; the scanner (header_scan) feeds them entry by entry.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamctl.checkpoint.header_json import DuplicateKey
from streamctl.checkpoint.header_types import (
    DTYPE_BITS,
    HEADER_LENGTH_BYTES,
    MAX_DIM,
    TENSOR_FIELDS,
    U64_MAX,
    HeaderProblem,
    TensorInfo,
    header_error,
    header_warning,
    printable,
)
from streamctl.common.limits import shown_number


def is_u64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX


def is_dim(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DIM


BAD_SHAPE = "shape must be a list of integers 0..2**63-1 (readers build tensors with signed 64-bit dimensions)"


def has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_metadata(value: Any) -> tuple[Mapping[str, str] | None, list[HeaderProblem]]:
    if value is None:
        # serde reads `null` as "no metadata"; the format says a map.
        return None, [header_warning("bad-metadata", "__metadata__ is null; the format expects a map of strings")]
    if not isinstance(value, dict):
        return None, [
            header_error("bad-metadata", f"__metadata__ must be a map of strings, not {type(value).__name__}")
        ]
    bad = [key for key, item in value.items() if not isinstance(item, str)]
    if bad:
        return None, [
            header_error(
                "bad-metadata",
                f"__metadata__ values must be strings; {printable(bad[0])!r} is {type(value[bad[0]]).__name__}",
            )
        ]
    if any(has_lone_surrogate(key) or has_lone_surrogate(item) for key, item in value.items()):
        return None, [
            header_error("bad-metadata", "__metadata__ holds a lone UTF-16 surrogate, which is not valid UTF-8")
        ]
    return dict(value), []


@dataclass(frozen=True, slots=True)
class Span:
    name: str
    begin: int
    end: int


def check_entry(name: str, entry: Any) -> tuple[TensorInfo | None, Span | None, list[HeaderProblem]]:
    """Rules 5 and 7 for one tensor entry, plus the types rule 8 needs.

    The span (offsets) is returned whenever the offsets are well-typed, even if dtype or shape is not,
    so contiguity can still be checked over every entry.
    """
    shown = printable(name)
    if has_lone_surrogate(name):
        return None, None, [header_error("bad-tensor-entry", "tensor name holds a lone UTF-16 surrogate", shown)]
    if not isinstance(entry, dict):
        return None, None, [header_error("bad-tensor-entry", f"entry is {type(entry).__name__}, not an object", shown)]
    missing = [field for field in TENSOR_FIELDS if field not in entry]
    if missing:
        return None, None, [header_error("bad-tensor-entry", f"entry lacks {', '.join(missing)}", shown)]
    problems: list[HeaderProblem] = []
    extra = sorted(key for key in entry if key not in TENSOR_FIELDS)
    if extra:
        # The reference reader ignores unknown fields; still worth knowing about.
        problems.append(
            header_warning("unknown-tensor-field", f"unknown fields {', '.join(map(repr, extra))}"[:200], shown)
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    span: Span | None = None
    if isinstance(offsets, list) and len(offsets) == 2 and all(is_u64(item) for item in offsets):
        span = Span(name, offsets[0], offsets[1])
    else:
        problems.append(
            header_error(
                "bad-offsets", f"data_offsets must be [begin, end], integers 0..2**64-1, got {offsets!r}"[:200], shown
            )
        )
    valid = span is not None
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        problems.append(header_error("unknown-dtype", f"unknown dtype {dtype!r}"[:200], shown))
        valid = False
    if not isinstance(shape, list) or not all(is_dim(dim) for dim in shape):
        problems.append(header_error("bad-shape", f"{BAD_SHAPE}, got {shape!r}"[:300], shown))
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


def shown_shape(shape: Sequence[int]) -> str:
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
    return header_error(
        "bad-shape",
        f"empty {tensor.dtype} tensor of shape {shown_shape(tensor.shape)}: its non-zero dimensions span "
        f"{shown_number(extent_bytes)} bytes, over the 2**63-1 numpy and torch can build (even with no element)",
        printable(tensor.name),
    )


def check_sizes(tensors: Sequence[TensorInfo]) -> Iterator[HeaderProblem]:
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
                header_error(
                    "size-overflow",
                    f"shape {shown_shape(tensor.shape)} overflows 64-bit arithmetic",
                    printable(tensor.name),
                )
            )
        elif nbits % 8:
            yield (
                header_error(
                    "size-not-whole-bytes",
                    f"{nbits} bits of {tensor.dtype} is not a whole number of bytes",
                    printable(tensor.name),
                )
            )
        elif nbits // 8 != tensor.nbytes:
            yield (
                header_error(
                    "size-mismatch",
                    f"{tensor.dtype} {shown_shape(tensor.shape)} needs {nbits // 8:,} bytes "
                    f"but data_offsets span {tensor.nbytes:,}",
                    printable(tensor.name),
                )
            )


def check_contiguity(spans: Sequence[TensorInfo | Span]) -> Iterator[HeaderProblem]:
    """Rule 8: end >= begin, and sorted by (begin, end) each tensor starts where the previous ended, from 0."""
    expected_begin = 0
    in_order = all(
        (left.begin, left.end) <= (right.begin, right.end) for left, right in itertools.pairwise(spans)
    )  # as writers lay them out; sorting would allocate a key per tensor
    for span in spans if in_order else sorted(spans, key=lambda item: (item.begin, item.end)):
        if span.end < span.begin:
            yield (
                header_error(
                    "offsets-reversed", f"data_offsets end {span.end} < begin {span.begin}", printable(span.name)
                )
            )
            continue
        if span.begin > expected_begin:
            yield (
                header_error(
                    "offsets-gap",
                    f"data starts at {span.begin:,}; the previous tensor ends at {expected_begin:,}",
                    printable(span.name),
                )
            )
        elif span.begin < expected_begin:
            yield (
                header_error(
                    "offsets-overlap",
                    f"data starts at {span.begin:,}, inside the previous tensor (ends {expected_begin:,})",
                    printable(span.name),
                )
            )
        expected_begin = max(expected_begin, span.end)


def _first_cut_tensor(spans: Sequence[TensorInfo | Span], data_available: int) -> TensorInfo | Span:
    """The tensor a reader fails on in a truncated file: the first, in file order, whose data ends past it."""
    return min((span for span in spans if span.end > data_available), key=lambda span: (span.begin, span.end))


def check_file_size(spans: Sequence[TensorInfo | Span], header_length: int, object_size: int) -> HeaderProblem | None:
    """Rule 9: the object ends where the data of the last tensor does (`spans`: every entry's offsets, laid
    out contiguously)."""
    data_end = max((span.end for span in spans), default=0)
    expected = HEADER_LENGTH_BYTES + header_length + data_end
    if expected > object_size:
        cut = _first_cut_tensor(spans, object_size - HEADER_LENGTH_BYTES - header_length)
        return header_error(
            "file-truncated",
            f"header and offsets need {expected:,} bytes; the object has {object_size:,}, so this "
            "tensor's data is cut short (and any after it)",
            printable(cut.name),
        )
    if expected < object_size:
        return header_error(
            "file-trailing-bytes",
            f"the object has {object_size - expected:,} bytes after the last tensor ({object_size:,} > {expected:,})",
        )
    return None


def entry_duplicates(name: str, entry: Any, duplicates: Sequence[DuplicateKey]) -> Iterator[HeaderProblem]:
    """A field of the format repeated in one tensor entry: the reference reader refuses it ("duplicate field"),
    the Run:ai streamer takes the last, so the readers disagree. Repeated unknown fields (or keys nested in
    them) are ignored by every reader, as the fields themselves are."""
    for duplicate in duplicates:
        if duplicate.owner is entry and duplicate.key in TENSOR_FIELDS:
            yield header_error(
                "duplicate-key",
                f"field {duplicate.key!r} appears twice in the tensor's entry; the safetensors reader (and so vLLM) "
                "refuses it as a duplicate field, while the Run:ai streamer takes the last",
                printable(name),
            )


def metadata_duplicates(metadata: Any, duplicates: Sequence[DuplicateKey]) -> Iterator[HeaderProblem]:
    """A key repeated in `__metadata__`: every reader keeps the last value, but the reference reader checks
    each value as it comes, so an earlier value that is not a string fails it (and not the streamer)."""
    for duplicate in duplicates:
        if duplicate.owner is not metadata:
            continue  # nested in a value that is not a string: already a bad-metadata error
        shown = printable(duplicate.key)
        if not isinstance(duplicate.earlier, str):
            yield header_error(
                "bad-metadata",
                f"__metadata__ values must be strings; the first {shown!r} is {type(duplicate.earlier).__name__} "
                "(the safetensors reader checks every value, even one a later key replaces)",
            )
        else:
            yield header_warning(
                "duplicate-metadata-key",
                f"__metadata__ key {shown!r} appears more than once; every reader keeps the last value",
            )
