"""Every integer field is accepted exactly when the reference reader accepts it.

The reference is the `safetensors` package in the test venv (Rust, serde_json into usize): `-0`, `0.0`,
`1e3`, `+1`, `01`, values past 2**64-1 and negative numbers are all refused there, so they must be errors
here, in `data_offsets`, in `shape` entries and in the 8-byte length prefix. Where streamctl is stricter on
purpose (lone surrogates, JSON nested over 64 levels; see test_verify_fuzz) the cases below are not used.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints import write_serving_files
from safetensors_strategies import mutated_files
from streamctl.checkpoint.safetensors import parse_safetensors_bytes
from streamctl.storage import open_location
from streamctl.verify.run import verify_checkpoint

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open

DATA = b"\x00" * 4
TEMPLATE = '{{"__metadata__":{{"format":"pt"}},"t":{{"dtype":"U8","shape":[{shape}],"data_offsets":[{begin},{end}]}}}}'


def reference_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="numpy") as handle:  # validates the whole header on open
            handle.keys()  # (get_tensor would also test numpy, which has no F4 or F8 types)
    except Exception:  # noqa: BLE001 - SafetensorError, or the OSError/ValueError of a bad length prefix
        return False
    return True


def file_with(shape: str = "4", begin: str = "0", end: str = "4") -> bytes:
    header = TEMPLATE.format(shape=shape, begin=begin, end=end).encode()
    return struct.pack("<Q", len(header)) + header + DATA


def agree(tmp_path: Path, data: bytes) -> tuple[bool, bool]:
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    return parse_safetensors_bytes(data).ok, reference_accepts(path)


HAND_PICKED = [
    "-0",
    "-00",
    "0.0",
    "-0.0",
    "0e0",
    "0E0",
    "0e+0",
    "0e-0",
    "+0",
    "00",
    "01",
    "4.0",
    "4e0",
    "4E0",
    "0.4e1",
    "40e-1",
    "+4",
    "04",
    "-4",
    "-1",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999",
    "1" * 400,
    "1" * 5000,
    "-" + "1" * 5000,
    "0x4",
    "4 ",
    " 4",
    "\t4",
    "4\n",
    "NaN",
    "Infinity",
    "-Infinity",
    "true",
    "null",
    '"4"',
    "[4]",
    "{}",
    "4,",
    "",
]


@pytest.mark.parametrize("spelling", HAND_PICKED)
@pytest.mark.parametrize("field", ["shape", "begin", "end"])
def test_hand_picked_spellings_agree_with_the_reference(tmp_path: Path, field: str, spelling: str) -> None:
    value = {"shape": "4", "begin": "0", "end": "4"}
    value[field] = spelling
    ours, reference = agree(tmp_path, file_with(**value))
    assert ours == reference, f"{field}={spelling!r}: streamctl {'accepts' if ours else 'refuses'}, reference not"


def test_negative_zero_is_refused_everywhere(tmp_path: Path) -> None:
    for value in ({"shape": "-0"}, {"begin": "-0"}, {"shape": "4,-0"}, {"end": "-0"}):
        ours, reference = agree(tmp_path, file_with(**value))
        assert not ours and not reference, value


SPELLINGS = st.builds(
    lambda sign, digits, fraction, exponent, pad: pad[0] + sign + digits + fraction + exponent + pad[1],
    st.sampled_from(["", "", "-", "+"]),
    st.sampled_from(["0", "4", "04", "00", "40", "18446744073709551615", "18446744073709551616"])
    | st.text("0123456789", min_size=1, max_size=30),
    st.sampled_from(["", "", ".0", ".00", ".5", "."]),
    st.sampled_from(["", "", "e0", "E1", "e-1", "e+0", "e"]),
    st.sampled_from([("", ""), (" ", ""), ("", " "), ("\n", "\t")]),
)


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(["shape", "begin", "end", "shape2"]), spelling=SPELLINGS)
def test_generated_spellings_agree_with_the_reference(
    tmp_path_factory: pytest.TempPathFactory, field: str, spelling: str
) -> None:
    value = {"shape": "4", "begin": "0", "end": "4"}
    if field == "shape2":
        value["shape"] = f"{spelling},1"
    else:
        value[field] = spelling
    tmp_path = tmp_path_factory.mktemp("spelling")
    ours, reference = agree(tmp_path, file_with(**value))
    assert ours == reference, f"{field}={spelling!r}: streamctl {ours}, reference {reference}"


def _with_length(header: bytes, length: int, data: bytes = DATA) -> bytes:
    return struct.pack("<Q", length) + header + data


GOOD_HEADER = TEMPLATE.format(shape="4", begin="0", end="4").encode()


@pytest.mark.parametrize(
    "data",
    [
        _with_length(GOOD_HEADER, len(GOOD_HEADER)),
        _with_length(GOOD_HEADER, 0),
        _with_length(GOOD_HEADER, len(GOOD_HEADER) - 1),
        _with_length(GOOD_HEADER, len(GOOD_HEADER) + 1),
        _with_length(GOOD_HEADER, len(GOOD_HEADER) + 4, b""),  # the data taken for header padding
        _with_length(GOOD_HEADER + b"    ", len(GOOD_HEADER) + 4),  # space padding, as writers do
        _with_length(GOOD_HEADER + b"\x00\x00", len(GOOD_HEADER) + 2),  # NUL padding
        _with_length(GOOD_HEADER, 2**63),
        _with_length(GOOD_HEADER, 2**64 - 1),
        _with_length(GOOD_HEADER, 100_000_001),
        struct.pack("<Q", len(GOOD_HEADER))[:7],
        b"",
    ],
    ids=lambda data: data[:8].hex(),
)
def test_length_prefix_agrees_with_the_reference(tmp_path: Path, data: bytes) -> None:
    ours, reference = agree(tmp_path, data)
    assert ours == reference


METADATA_CASES = [
    '{"format":"pt"}',
    "{}",
    "null",
    '{"a":1}',
    '{"a":null}',
    '{"a":true}',
    '{"a":["x"]}',
    '{"a":{"b":"c"}}',
    '{"a":"-0"}',
    "[]",
    '"pt"',
    "1",
    "-0",
    '{"a":-0}',
    '{"dtype":"U8","shape":[0],"data_offsets":[4,4]}',  # a tensor entry's form under the metadata key
]


@pytest.mark.parametrize("metadata", METADATA_CASES)
def test_metadata_values_agree_with_the_reference(tmp_path: Path, metadata: str) -> None:
    header = (f'{{"__metadata__":{metadata},"t":{{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}}}').encode()
    ours, reference = agree(tmp_path, struct.pack("<Q", len(header)) + header + DATA)
    assert ours == reference, metadata


def test_verify_index_reports_a_negative_zero_offset(tmp_path: Path) -> None:
    location = open_location(str(tmp_path))
    write_serving_files(location)
    (tmp_path / "model.safetensors").write_bytes(file_with(begin="-0"))
    assert not reference_accepts(tmp_path / "model.safetensors")
    report = verify_checkpoint(location)
    assert [(finding.code, finding.file) for finding in report.errors] == [("bad-offsets", "model.safetensors")]


# Where streamctl is stricter than the reference on purpose. Repeated keys are not: streamctl refuses exactly the
# ones the reference refuses (test_reader_agreement).
_STRICTER_ON_PURPOSE = {"header-too-complex"}


@settings(max_examples=600, deadline=None)
@given(data=mutated_files())
def test_damaged_files_are_refused_exactly_when_the_reference_refuses_them(
    tmp_path_factory: pytest.TempPathFactory, data: bytes
) -> None:
    parsed = parse_safetensors_bytes(data)
    codes = {problem.code for problem in parsed.problems}
    surrogate = any("surrogate" in problem.message for problem in parsed.problems)
    if codes & _STRICTER_ON_PURPOSE or surrogate:
        return
    path = tmp_path_factory.mktemp("damaged") / "model.safetensors"
    path.write_bytes(data)
    assert parsed.ok == reference_accepts(path), sorted(codes)
