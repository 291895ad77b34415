"""With --json, stdout is exactly one JSON document, on failure too.

A failure is `{"ok": false, "error": {"code", "exit_code", "message", "hint"}}` (plus the command's own
fields where it has some: findings of a failed check). Every command's error paths are walked: bad URL,
missing source, bad option value, unknown option, missing argument, failing verify, failing pre-flight,
an interrupt and a bug; the document's exit_code is the process's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpoints import write_serving_files
from cli_helpers import run_cli
from headers_helpers import run_main
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.storage import open_location

COMMANDS: dict[str, list[str]] = {  # each command's arguments before the source and what follows it
    "transfer": ["transfer", "{source}", "{dest}"],
    "verify-index": ["verify-index", "{source}"],
    "shard": ["shard", "{source}", "{dest}", "-tp", "2"],
    "serve": ["serve", "{source}", "--dry-run"],
}


def only_document(stdout: str) -> dict[str, Any]:
    """stdout holds exactly one JSON document (json.loads refuses a second one: "Extra data")."""
    document = json.loads(stdout)
    assert isinstance(document, dict)
    return document


def assert_failure(code: int, stdout: str, expected_exit: int, expected_code: str | tuple[str, ...]) -> dict[str, Any]:
    document = only_document(stdout)
    assert document["ok"] is False, document
    error = document["error"]
    assert set(error) == {"code", "exit_code", "message", "hint"}, error
    assert error["exit_code"] == code == expected_exit, (code, error)
    assert error["code"] in ((expected_code,) if isinstance(expected_code, str) else expected_code), error
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
    return document


def arguments(command: str, source: str, dest: str) -> list[str]:
    return [part.format(source=source, dest=dest) for part in COMMANDS[command]]


@pytest.fixture()
def broken_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint whose only shard's header lies about its size: verify-index errors on it."""
    root = tmp_path / "broken"
    root.mkdir()
    write_serving_files(open_location(str(root)))
    data = bytearray(safetensors_bytes([("model.norm.weight", "F32", [2], bytes(8))]))
    (root / "model.safetensors").write_bytes(bytes(data) + b"trailing")
    return root


COMMAND_NAMES = list(COMMANDS)


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_a_bad_url(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    code, stdout, _ = run_main(
        monkeypatch, capsys, *arguments(command, "nope://bucket/x", str(tmp_path / "d")), "--json"
    )
    assert_failure(code, stdout, 2, "usage-error")


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_a_missing_source(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    code, stdout, _ = run_main(
        monkeypatch, capsys, *arguments(command, str(tmp_path / "missing"), str(tmp_path / "d")), "--json"
    )
    assert_failure(code, stdout, 3, "not-found")


@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("transfer", ["--part-size", "lots"]),
        ("transfer", ["-j", "abc"]),
        ("verify-index", ["-j", "0"]),
        ("shard", ["-pp", "99999999"]),
        ("shard", ["--max-part-size", "nan"]),
        ("serve", ["--memory-limit", "1e400"]),
        ("serve", ["-tp", "x"]),
    ],
)
def test_a_bad_option_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, option: list[str]
) -> None:
    code, stdout, _ = run_main(
        monkeypatch, capsys, *arguments(command, str(tmp_path), str(tmp_path / "d")), *option, "--json"
    )
    assert_failure(code, stdout, 2, "bad-option-value")


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_an_unknown_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    code, stdout, _ = run_main(
        monkeypatch, capsys, *arguments(command, str(tmp_path), str(tmp_path / "d")), "--bogus", "--json"
    )
    document = assert_failure(code, stdout, 2, "unknown-option")
    assert "--bogus" in document["error"]["message"] and document["error"]["hint"] == f"see streamctl {command} --help"


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_a_missing_argument(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, stdout, _ = run_main(monkeypatch, capsys, command, "--json")
    assert_failure(code, stdout, 2, "missing-parameter")


def test_json_after_the_vllm_separator_is_vllms(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stdout, stderr = run_main(monkeypatch, capsys, "serve", "--bogus", "--", "--json")
    assert code == 2 and stdout == "" and "--bogus" in stderr


def test_a_failing_verify(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], broken_checkpoint: Path
) -> None:
    code, stdout, _ = run_main(monkeypatch, capsys, "verify-index", str(broken_checkpoint), "--json")
    document = assert_failure(code, stdout, 1, "verification-failed")
    assert [finding["code"] for finding in document["findings"]] == ["file-trailing-bytes"]


def test_strict_warnings_fail_with_an_error_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    write_serving_files(open_location(str(tmp_path)), tokenizer=False)  # tokenizer-missing: a warning
    (tmp_path / "model.safetensors").write_bytes(safetensors_bytes([("w", "F32", [2], bytes(8))]))
    code, stdout, _ = run_main(monkeypatch, capsys, "verify-index", str(tmp_path), "--json")
    assert code == 0 and only_document(stdout)["ok"] is True and "error" not in only_document(stdout)
    code, stdout, _ = run_main(monkeypatch, capsys, "verify-index", str(tmp_path), "--strict", "--json")
    assert_failure(code, stdout, 1, "verification-failed")


def test_a_failing_preflight_carries_the_findings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], broken_checkpoint: Path
) -> None:
    code, stdout, _ = run_main(monkeypatch, capsys, "serve", str(broken_checkpoint), "--dry-run", "--json")
    document = assert_failure(code, stdout, 1, "preflight-failed")
    assert [finding["code"] for finding in document["findings"]] == ["file-trailing-bytes"]
    assert document["checkpoint"] == str(broken_checkpoint) and "stats" in document  # as verify-index --json


def test_a_failing_verify_after_transfer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], broken_checkpoint: Path, tmp_path: Path
) -> None:
    code, stdout, _ = run_main(
        monkeypatch, capsys, "transfer", str(broken_checkpoint), str(tmp_path / "copy"), "--json"
    )
    document = assert_failure(code, stdout, 1, "verification-failed")
    assert [finding["code"] for finding in document["verify"]["findings"]] == ["file-trailing-bytes"]


@pytest.mark.parametrize(
    ("raised", "exit_code", "code"), [(KeyboardInterrupt, 130, "interrupted"), (RuntimeError, 70, "internal-error")]
)
def test_an_interrupt_and_a_bug(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    broken_checkpoint: Path,
    raised: type[BaseException],
    exit_code: int,
    code: str,
) -> None:
    import streamctl.verify.run

    def explode(*_: object, **__: object) -> None:
        raise raised("boom")

    monkeypatch.setattr(streamctl.verify.run, "verify_checkpoint", explode)
    status, stdout, stderr = run_main(monkeypatch, capsys, "verify-index", str(broken_checkpoint), "--json")
    assert_failure(status, stdout, exit_code, code)
    assert "Traceback" not in stderr


def test_without_json_errors_stay_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, stdout, stderr = run_main(monkeypatch, capsys, "verify-index", str(tmp_path / "missing"))
    assert code == 3 and stdout == "" and "error:" in stderr


@pytest.mark.parametrize(
    "args",
    [
        ["verify-index", "--bogus", "x", "--json"],
        ["shard", "a", "b", "--json"],
        ["transfer", "x", "y", "--part-size", "9" * 5000, "--json"],
    ],
    ids=["unknown-option", "missing-option", "huge-size"],
)
def test_in_a_real_process(args: list[str]) -> None:
    result = run_cli(*args)
    document = only_document(result.stdout)
    assert document["ok"] is False and document["error"]["exit_code"] == result.exit_code == 2
