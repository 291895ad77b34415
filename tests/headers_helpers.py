"""Run streamctl's real entry point in this process (exit codes, stdout and stderr as a user sees them)."""

from __future__ import annotations

import sys

import pytest

from streamctl import app as app_module
from streamctl import output


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The real entry point in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(output, "settings", output.Settings())
    monkeypatch.setattr(output, "_documents_printed", 0)
    monkeypatch.setattr(sys, "argv", ["streamctl", *args])
    code: object = 0
    try:
        app_module.main()
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return (code if isinstance(code, int) else (0 if code is None else 1)), captured.out, captured.err
