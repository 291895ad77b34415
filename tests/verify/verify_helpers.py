"""Shared helpers of the verify tests: shard names, running a check, and reading its findings back."""

from __future__ import annotations

import json
from typing import Any

from checkpoints import INDEX_NAME, put_json, read_object
from streamctl.storage.base import Location
from streamctl.verify.report import VerifyOptions, VerifyReport
from streamctl.verify.run import verify_checkpoint

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"


def run(location: Location, **options: Any) -> VerifyReport:
    return verify_checkpoint(location, VerifyOptions(**options))


def error_codes(report: VerifyReport) -> list[str]:
    return sorted({finding.code for finding in report.errors})


def warning_codes(report: VerifyReport) -> list[str]:
    return sorted({finding.code for finding in report.warnings})


def findings_of(report: VerifyReport, code: str) -> list[tuple[str | None, str | None]]:
    return sorted((finding.file, finding.tensor) for finding in report.findings if finding.code == code)


def edit_index(location: Location, change: Any) -> None:
    index = json.loads(read_object(location, INDEX_NAME))
    change(index)
    put_json(location, INDEX_NAME, index)
