"""Run the real `streamctl` entry point in a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: str | os.PathLike[str] | None = None
) -> CliResult:
    merged = {**os.environ, **(env or {})}
    merged.pop("STREAMCTL_DEBUG", None) if env is None or "STREAMCTL_DEBUG" not in env else None
    completed = subprocess.run(
        [sys.executable, "-m", "streamctl", *args],
        capture_output=True,
        text=True,
        env=merged,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
    )
    return CliResult(completed.returncode, completed.stdout, completed.stderr)
