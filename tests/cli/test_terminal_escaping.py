"""Terminal control sequences in file and tensor names (ESC, C0, DEL, C1, bidi overrides) reach
no terminal raw: every human output escapes them, JSON keeps the names exactly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from checkpoints import TensorSpec, write_serving_files, write_tensor_file
from cli_helpers import run_cli
from streamctl.common.redact import printable
from streamctl.storage import open_location

# What a terminal acts on, each kind once: clear screen, set title + BEL, C1 CSI, DEL, bidi override, isolate.
FILE = "evil\x1b[2J\x1b]0;pwned\x07\x9b31m\x7f\u202etxt.safetensors"
TENSOR = "model.embed\x1b[2J\x08\x1b[1A\u2066x"
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")  # \t and \n may be layout


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("a\x1b[2Jb", "a\\x1b[2Jb"),
        ("t\x07", "t\\x07"),
        ("x\x9by", "x\\x9by"),
        ("d\x7f", "d\\x7f"),
        ("\u202eabc", "\\u202eabc"),
        ("two\nlines\r\t", "two\\nlines\\r\\t"),
        ("plain é 日本 🔥 [bold]", "plain é 日本 🔥 [bold]"),
    ],
)
def test_printable(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert not RAW.search(printable(text))


@pytest.fixture
def hostile_model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    location = open_location(str(folder))
    spec = TensorSpec(TENSOR, "F32", (4,))
    write_tensor_file(location, "model.safetensors", [spec, TensorSpec("lm_head.weight", "F32", (4,))])
    write_tensor_file(location, FILE, [spec])  # the same tensor in two files: an error naming both
    write_serving_files(location)
    return folder


def _no_raw_controls(*texts: str) -> None:
    for text in texts:
        assert not RAW.search(text), repr(RAW.search(text))


def test_verify_index_escapes_names(hostile_model: Path) -> None:
    result = run_cli("verify-index", str(hostile_model))
    assert result.exit_code == 1, result.stderr
    _no_raw_controls(result.stdout, result.stderr)
    assert "\\x1b[2J" in result.stdout and "\\u202e" in result.stdout  # shown, escaped
    document = run_cli("verify-index", str(hostile_model), "--json").json()
    names = {(finding.get("file"), finding.get("tensor")) for finding in document["findings"]}
    assert any(file == FILE or tensor == TENSOR for file, tensor in names), names  # JSON keeps them exactly


def test_transfer_plan_escapes_names(hostile_model: Path, tmp_path: Path) -> None:
    result = run_cli("transfer", str(hostile_model), str(tmp_path / "copy"), "--dry-run", "--all-files")
    assert result.exit_code == 0, result.stderr
    _no_raw_controls(result.stdout, result.stderr)
    assert "\\x1b[2J" in result.stdout
    document = run_cli("transfer", str(hostile_model), str(tmp_path / "copy"), "--dry-run", "--all-files", "--json")
    assert FILE in {file["path"] for file in document.json()["files"]}
    assert "\x1b" not in document.stdout  # JSON escapes it (\u001b), and the parser gives it back


def test_serve_preflight_report_and_command_line_escape_names(hostile_model: Path, tmp_path: Path) -> None:
    failed = run_cli("serve", str(hostile_model), "--dry-run")
    assert failed.exit_code == 1
    _no_raw_controls(failed.stdout, failed.stderr)
    assert "\\x1b[2J" in failed.stderr
    odd = tmp_path / "m\u202e"  # a bidi override; a location holding a C0/C1 control is refused (issue 21.5)
    dry = run_cli(
        "serve", str(odd), "--dry-run", "--no-preflight", "--not-sharded", "--", "--served-model-name", "\x1b]0;t\x07"
    )
    assert dry.exit_code == 0, dry.stderr
    _no_raw_controls(dry.stdout, dry.stderr)
    assert "$'" in dry.stdout  # bash's own quoting for control characters: still copy-pasteable


def test_errors_escape_names(tmp_path: Path) -> None:
    missing = tmp_path / "gone\x1b[2J\x9b1m"
    for command in (("verify-index", str(missing)), ("serve", str(missing), "--dry-run")):
        result = run_cli(*command)
        assert result.exit_code == 2, result.stderr  # a location holding control characters (issue 21.5)
        _no_raw_controls(result.stdout, result.stderr)
        assert "gone\\x1b[2J\\x9b1m" in result.stderr


def test_warnings_escape_names(tmp_path: Path) -> None:
    result = run_cli(
        "serve",
        "s3://bkt/m",
        "--dry-run",
        "--no-preflight",
        "--not-sharded",
        "--endpoint-url",
        "http://127.0.0.1:9",
        env={"AWS_ENDPOINT_URL": "http://x\x1b[2J:9"},
    )
    assert result.exit_code == 0, result.stderr
    assert "keeping" in result.stderr or "using" in result.stderr
    _no_raw_controls(result.stdout, result.stderr)
