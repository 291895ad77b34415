"""streamctl refuses a header exactly where the readers fail or disagree, and only
warns where they agree on what is loaded.

The readers decide. Each case below is a checkpoint folder written byte by byte; `READERS_LOAD` records
what was measured with the reference reader (safetensors 0.8, numpy back end), vLLM 0.33's
`safetensors_weights_iterator` and the Run:ai streamer 0.17 (tests/vllm_oracle/read_safetensors.py):
  * a dimension of 2**63 or more fails torch, numpy and the streamer even in an empty tensor ("Overflow
    when unpacking long long", "Maximum allowed dimension exceeded"); 2**63-1 loads everywhere -> bad-shape.
    So does an empty tensor whose non-zero dimensions span more than 2**63-1 bytes: numpy refuses it ("array
    is too big"), torch's strides overflow in the streamer and sometimes in vLLM -> bad-shape.
  * a tensor name repeated in one header: all three load the last entry (the same bytes) -> a warning, and
    the layout rules judge the last entry (a first entry whose bytes are then unused fails all three).
  * a key repeated in `__metadata__`: all load, keeping the last -> a warning; but an earlier value that is
    not a string fails the reference reader (serde checks each value) and not the streamer -> an error.
  * `__metadata__` twice, or `dtype`/`shape`/`data_offsets` twice in one entry: the reference reader (and so
    vLLM) refuses "duplicate field", the streamer loads -> they disagree -> an error, naming the tensor.
    Unknown fields repeated are ignored by all three -> only the unknown-field warning.
  * a tensor mapped twice in weight_map, to one file or to two: vLLM (and transformers) read the index with
    json.load, the last entry wins, and load every file the values name -> they agree -> a warning.
  * a truncated file fails all three; the finding names the first tensor cut short.
The test without the oracle checks streamctl against the reference reader of the test venv alone; the
oracle test re-measures all three readers and asserts both the table and streamctl's verdict.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from checkpoints import INDEX_NAME, write_serving_files
from cli_helpers import run_cli
from oracle import read_safetensors_many, requires_vllm_oracle
from streamctl.storage import open_location
from streamctl.verify.report import VerifyReport
from streamctl.verify.run import verify_checkpoint

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open

READER_NAMES = ("safetensors", "vllm", "streamer")
ALL = dict.fromkeys(READER_NAMES, True)
NONE = dict.fromkeys(READER_NAMES, False)
STREAMER_ONLY = {"safetensors": False, "vllm": False, "streamer": True}
STREAMER_AND_VLLM = {"safetensors": False, "vllm": True, "streamer": True}
VLLM_ONLY = {"safetensors": False, "vllm": True, "streamer": False}
D63 = 2**63


def entry(dtype: str, shape: list[int], begin: int, end: int, **extra: Any) -> str:
    fields = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end], **extra}
    return json.dumps(fields, separators=(",", ":"))


def header_file(pairs: list[tuple[str, str]], data: bytes) -> bytes:
    """A safetensors file from (key, JSON text) pairs, so keys may repeat; padded as the writer pads."""
    text = ("{" + ",".join(f"{json.dumps(key)}:{value}" for key, value in pairs) + "}").encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def u8(begin: int, end: int) -> str:
    return entry("U8", [end - begin], begin, end)


@dataclass(frozen=True)
class Case:
    name: str
    files: dict[str, bytes]
    loads: dict[str, bool]  # measured: does each reader load it (READER_NAMES)?
    code: str  # the finding streamctl reports
    severity: str  # its severity: "error" exactly where a reader fails or the readers disagree
    tensor: str | None = None  # the tensor the finding names
    index: dict[str, Any] | None = field(default=None)
    truncate: int = 0  # bytes cut from the end of model.safetensors

    def folder(self, root: Path) -> Path:
        folder = root / self.name
        folder.mkdir()
        write_serving_files(open_location(str(folder)))
        for file, data in self.files.items():
            (folder / file).write_bytes(data[: len(data) - self.truncate] if self.truncate else data)
        if self.index is not None:
            (folder / INDEX_NAME).write_text(self.index if isinstance(self.index, str) else json.dumps(self.index))
        return folder


def _single(pairs: list[tuple[str, str]], data: bytes = b"") -> dict[str, bytes]:
    return {"model.safetensors": header_file(pairs, data)}


def _raw_index(pairs: list[tuple[str, str]]) -> Any:
    return '{"metadata":{"total_size":0},"weight_map":{' + ",".join(f'"{k}":"{v}"' for k, v in pairs) + "}}"


T8 = [("t", u8(0, 4)), ("u", u8(4, 8))]
DATA8 = b"abcdefgh"
CASES = [
    # Item 6: the largest dimension every reader builds, and the first ones none can.
    Case("dim-max-last", _single([("t", entry("U8", [0, D63 - 1], 0, 0))]), ALL, "", ""),
    Case(
        "dim-max-first",
        _single([("t", entry("U8", [D63 - 1, 2, 0], 0, 0))]),
        STREAMER_AND_VLLM,
        "bad-shape",
        "error",
        "t",
    ),
    Case("dim-f32-max", _single([("t", entry("F32", [2**61 - 1, 0], 0, 0))]), ALL, "", ""),
    Case("dim-f64-max", _single([("t", entry("F64", [0, 2**60 - 1], 0, 0))]), ALL, "", ""),
    # ... and an empty tensor whose other dimensions span more than 2**63-1 bytes (numpy: "array is too big",
    # torch: "Stride calculation overflowed"), where the readers fail or disagree.
    Case("extent-f32", _single([("t", entry("F32", [2**61, 0], 0, 0))]), STREAMER_AND_VLLM, "bad-shape", "error", "t"),
    Case("extent-u8", _single([("t", entry("U8", [0, 2**62, 2], 0, 0))]), NONE, "bad-shape", "error", "t"),
    Case("extent-3d", _single([("t", entry("U8", [0, 2**40, 2**40], 0, 0))]), VLLM_ONLY, "bad-shape", "error", "t"),
    Case("dim-2-63", _single([("t", entry("U8", [0, D63], 0, 0))]), NONE, "bad-shape", "error", "t"),
    Case("dim-2-63-first", _single([("t", entry("F32", [D63, 0], 0, 0))]), NONE, "bad-shape", "error", "t"),
    Case("dim-2-64-1", _single([("t", entry("I16", [0, 2**64 - 1], 0, 0))]), NONE, "bad-shape", "error", "t"),
    Case("dim-2-63-plus", _single([("t", entry("U8", [1, 0, D63 + 5], 0, 0))]), NONE, "bad-shape", "error", "t"),
    # Item 7: a name repeated in one header.
    Case("dup-tensor-same", _single([*T8, ("t", u8(0, 4))], DATA8), ALL, "duplicate-tensor", "warning", "t"),
    Case(
        "dup-tensor-retyped",
        _single([("t", u8(0, 4)), ("u", u8(4, 8)), ("t", entry("I8", [2, 2], 0, 4))], DATA8),
        ALL,
        "duplicate-tensor",
        "warning",
        "t",
    ),
    Case(
        "dup-tensor-moved",  # the last entry leaves the first one's 4 bytes unused: a gap for every reader
        _single([("t", u8(0, 4)), ("u", u8(4, 8)), ("t", u8(8, 12))], DATA8 + b"ijkl"),
        NONE,
        "offsets-gap",
        "error",
        "u",
    ),
    # Item 7: a key repeated in __metadata__, and __metadata__ itself repeated.
    Case(
        "dup-metadata-key",
        _single([("__metadata__", '{"format":"pt","format":"np"}'), *T8], DATA8),
        ALL,
        "duplicate-metadata-key",
        "warning",
    ),
    Case(
        "dup-metadata-keys",
        _single([("__metadata__", '{"a":"1","b":"2","a":"3","b":"4"}'), *T8], DATA8),
        ALL,
        "duplicate-metadata-key",
        "warning",
    ),
    Case(
        "dup-metadata-key-earlier-int",
        _single([("__metadata__", '{"format":1,"format":"pt"}'), *T8], DATA8),
        STREAMER_ONLY,
        "bad-metadata",
        "error",
    ),
    Case(
        "dup-metadata",
        _single([("__metadata__", '{"a":"1"}'), *T8, ("__metadata__", '{"b":"2"}')], DATA8),
        STREAMER_ONLY,
        "duplicate-key",
        "error",
    ),
    # Items 7 and 8: a field of the format repeated inside one entry, named by its tensor.
    Case(
        "dup-field-dtype",
        _single([("t", '{"dtype":"U8","dtype":"U8","shape":[4],"data_offsets":[0,4]}'), ("u", u8(4, 8))], DATA8),
        STREAMER_ONLY,
        "duplicate-key",
        "error",
        "t",
    ),
    Case(
        "dup-field-offsets",
        _single(
            [("t", u8(0, 4)), ("u\x1b[2J", '{"dtype":"U8","shape":[4],"data_offsets":[4,8],"data_offsets":[4,8]}')],
            DATA8,
        ),
        STREAMER_ONLY,
        "duplicate-key",
        "error",
        "u\x1b[2J",
    ),
    Case(
        "dup-field-shape",
        _single([("model.w", '{"shape":[2],"dtype":"U8","shape":[4],"data_offsets":[0,4]}'), ("u", u8(4, 8))], DATA8),
        STREAMER_ONLY,
        "duplicate-key",
        "error",
        "model.w",
    ),
    Case(
        "dup-unknown-field",  # readers ignore unknown fields, repeated or not
        _single(
            [("t", '{"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":1,"x":{"a":1,"a":2}}'), ("u", u8(4, 8))], DATA8
        ),
        ALL,
        "unknown-tensor-field",
        "warning",
        "t",
    ),
    # Item 7: a tensor mapped twice in weight_map.
    Case(
        "index-dup-same-file",
        {"model-00001-of-00001.safetensors": header_file(T8, DATA8)},
        ALL,
        "index-duplicate-tensor",
        "warning",
        "t",
        _raw_index(
            [
                ("t", "model-00001-of-00001.safetensors"),
                ("u", "model-00001-of-00001.safetensors"),
                ("t", "model-00001-of-00001.safetensors"),
            ]
        ),
    ),
    Case(
        "index-dup-two-files",  # the earlier entry names the other shard; the last one is right
        {
            "model-00001-of-00002.safetensors": header_file([("t", u8(0, 4))], DATA8[:4]),
            "model-00002-of-00002.safetensors": header_file([("u", u8(0, 4))], DATA8[4:]),
        },
        ALL,
        "index-duplicate-tensor",
        "warning",
        "u",
        _raw_index(
            [
                ("u", "model-00001-of-00002.safetensors"),
                ("t", "model-00001-of-00002.safetensors"),
                ("u", "model-00002-of-00002.safetensors"),
            ]
        ),
    ),
    # Item 8: a truncated file names the first tensor cut short.
    Case("truncated-last", _single(T8, DATA8), NONE, "file-truncated", "error", "u", truncate=1),
    Case(
        "truncated-middle",
        _single([*T8, ("v", u8(8, 12))], DATA8 + b"ijkl"),
        NONE,
        "file-truncated",
        "error",
        "u",
        truncate=5,
    ),
]


def _verify(folder: Path) -> VerifyReport:
    return verify_checkpoint(open_location(str(folder)))


def _reference_loads(folder: Path) -> bool:
    """The reference reader of the test venv, reading the files vLLM would (see the module docstring)."""
    index = folder / INDEX_NAME
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    try:
        for file in files:
            with safe_open(str(folder / file), framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not a dict
                    handle.get_tensor(name)
    except Exception:  # noqa: BLE001 - SafetensorError, numpy's ValueError: any refusal is the verdict
        return False
    return True


def _assert_verdict(case: Case, report: VerifyReport) -> None:
    expect_error = not all(case.loads.values())
    assert report.ok is not expect_error, (case.name, [(f.severity, f.code, f.tensor) for f in report.findings])
    if not case.code:
        assert report.findings == [] or all(f.severity == "warning" for f in report.findings), case.name
        return
    found = [(f.severity, f.tensor) for f in report.findings if f.code == case.code]
    assert (case.severity, case.tensor) in found, (case.name, [(f.severity, f.code, f.tensor) for f in report.findings])


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_streamctl_refuses_exactly_what_the_reference_reader_refuses(tmp_path: Path, case: Case) -> None:
    folder = case.folder(tmp_path)
    assert _reference_loads(folder) is case.loads["safetensors"], case.name
    _assert_verdict(case, _verify(folder))


@requires_vllm_oracle
def test_the_readers_load_what_the_table_says_and_streamctl_agrees(tmp_path: Path) -> None:
    folders = [case.folder(tmp_path) for case in CASES]
    results = read_safetensors_many(folders)
    wrong = {}  # every case that the measurements recorded in CASES no longer describe, with the readers' errors
    for case, readers in zip(CASES, results, strict=True):
        if {name: readers[name]["ok"] for name in READER_NAMES} != case.loads:
            wrong[case.name] = {name: readers[name]["error"] or "loads" for name in READER_NAMES}
    assert not wrong, wrong
    for case, folder, readers in zip(CASES, folders, results, strict=True):
        loaded = [readers[name]["tensors"] for name in READER_NAMES if readers[name]["ok"]]
        agree = all(loaded) and all(tensors == loaded[0] for tensors in loaded)
        if all(case.loads.values()):
            assert agree, (case.name, loaded)  # what a warning promises: every reader loads the same bytes
        _assert_verdict(case, _verify(folder))


def test_findings_name_a_hostile_tensor_escaped(tmp_path: Path) -> None:
    case = next(case for case in CASES if case.name == "dup-field-offsets")
    folder = case.folder(tmp_path)
    human = run_cli("verify-index", str(folder))
    assert human.exit_code == 1, human.stdout + human.stderr
    assert "u\\x1b[2J" in human.stdout + human.stderr and "\x1b[2J" not in human.stdout + human.stderr
    document = run_cli("verify-index", str(folder), "--json").json()
    assert [f["tensor"] for f in document["findings"] if f["code"] == "duplicate-key"] == ["u\x1b[2J"]


@pytest.mark.parametrize("name", ["dim-2-63", "dup-metadata", "dup-tensor-same", "index-dup-two-files"])
def test_verify_index_and_the_serve_preflight_give_the_same_verdict(tmp_path: Path, name: str) -> None:
    case = next(case for case in CASES if case.name == name)
    folder = case.folder(tmp_path)
    expected = 0 if all(case.loads.values()) else 1
    verify = run_cli("verify-index", str(folder), "--json")
    assert verify.exit_code == expected, verify.stdout + verify.stderr
    assert (case.severity, case.code) in [(f["severity"], f["code"]) for f in verify.json()["findings"]]
    serve = run_cli("serve", str(folder), "--dry-run")
    assert (serve.exit_code == 0) is (expected == 0), serve.stdout + serve.stderr
    if expected:
        assert case.code in serve.stderr
