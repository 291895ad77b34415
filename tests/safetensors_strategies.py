"""Hypothesis strategies for damaged safetensors files: a valid base file and `mutated_files()`, which breaks
it in one or more ways (header fields, offsets, JSON, UTF-8, nesting, length, truncation)."""

from __future__ import annotations

import copy
import json
import struct
from typing import Any

from hypothesis import strategies as st

from streamctl.checkpoint.safetensors import safetensors_bytes

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
