"""output.emit and the failures that carry a result: what a person and a script see is the command's result,
drawn in one place (output.py), with an error line only where the result does not say it all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpoints import write_serving_files
from headers_helpers import run_main
from streamctl import output
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.errors import VerificationFailed
from streamctl.storage import open_location
from tiny_models import write_tiny_checkpoint


def subclasses(base: type) -> list[type]:
    return [base, *(cls for sub in base.__subclasses__() for cls in subclasses(sub))]


def test_a_failed_verify_index_shows_the_report_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    write_serving_files(open_location(str(tmp_path)))
    (tmp_path / "model.safetensors").write_bytes(safetensors_bytes([("w", "F32", [2], bytes(8))]) + b"trailing")
    code, stdout, stderr = run_main(monkeypatch, capsys, "verify-index", str(tmp_path))
    assert code == 1
    assert "file-trailing-bytes" in stdout and "FAILED" in stdout
    assert "error:" not in stderr  # the table is the message: no error line under it


def test_a_shard_whose_checks_failed_shows_them_above_the_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The checks of a real run, shown as a failure would show them (the library raises it with the result)."""
    write_tiny_checkpoint(tmp_path / "hf", "llama-gqa")
    emitted: list[Any] = []
    monkeypatch.setattr(output, "emit", emitted.append)
    code, _, stderr = run_main(monkeypatch, capsys, "shard", str(tmp_path / "hf"), str(tmp_path / "out"), "-tp", "2")
    assert code == 0 and len(emitted) == 1, stderr
    result = emitted[0]
    failed_class = next(cls for cls in subclasses(VerificationFailed) if cls.code == "shard-check-failed")
    failure = failed_class(result)
    assert failure.result is result

    monkeypatch.setattr(output, "settings", output.Settings())
    output.print_error(failure)
    captured = capsys.readouterr()
    assert "checks:" in captured.out and "reconstruction" in captured.out  # the checks, on stdout
    assert captured.err.startswith(f"error: {failure.message}\n")

    monkeypatch.setattr(output, "settings", output.Settings(json=True))
    monkeypatch.setattr(output, "_documents_printed", 0)
    output.print_error(failure)
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False and document["error"]["code"] == "shard-check-failed"
    assert document["error"]["exit_code"] == 1
    assert {key: value for key, value in document.items() if key not in ("ok", "error")} == result.to_json()


def test_emit_has_a_renderer_for_each_result_or_says_which_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "settings", output.Settings())

    class Unknown:
        def to_json(self) -> dict[str, Any]:
            return {}

    with pytest.raises(TypeError, match="no renderer for .*Unknown"):
        output.emit(Unknown())
