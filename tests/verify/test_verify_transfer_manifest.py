"""`transfer-incomplete`: a `transfer --worker K/N` copy whose manifest says not every share has finished."""

from __future__ import annotations

import pytest
from verify_helpers import error_codes, findings_of, run, warning_codes

from checkpoints import put_bytes, put_json, write_hf_checkpoint
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.storage.base import Location


def _manifest(complete: bool | None, finished: list[int], count: int = 3) -> dict[str, object]:
    document: dict[str, object] = {"tool": "streamctl", "source": "hf://org/m", "commit": None, "files": []}
    if complete is not None:
        document["complete"] = complete
        document["workers"] = {"count": count, "plan": "0" * 32, "finished": finished}
    return document


def test_a_manifest_with_shares_still_to_run_is_a_warning_naming_them(remote_or_local: Location) -> None:
    write_hf_checkpoint(remote_or_local)
    put_json(remote_or_local, MANIFEST_NAME, _manifest(False, [0, 2], count=4))
    report = run(remote_or_local)
    assert warning_codes(report) == ["transfer-incomplete"]
    assert error_codes(report) == []  # the files that are there are sound: a warning, as the issue asks
    assert findings_of(report, "transfer-incomplete") == [(MANIFEST_NAME, None)]
    message = next(finding.message for finding in report.findings if finding.code == "transfer-incomplete")
    assert "2 of 4 `--worker` shares finished" in message and "--worker 1/4, 3/4" in message


@pytest.mark.parametrize(
    "document",
    [_manifest(True, [0, 1, 2]), _manifest(None, [])],
    ids=["every-share-finished", "a-whole-run"],
)
def test_a_complete_manifest_is_no_finding(location: Location, document: dict[str, object]) -> None:
    write_hf_checkpoint(location)
    put_json(location, MANIFEST_NAME, document)
    assert "transfer-incomplete" not in warning_codes(run(location))


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"complete": false}'])
def test_a_manifest_this_version_cannot_read_says_only_what_it_knows(location: Location, body: bytes) -> None:
    write_hf_checkpoint(location)
    put_bytes(location, MANIFEST_NAME, body)
    codes = warning_codes(run(location))
    assert ("transfer-incomplete" in codes) is (body == b'{"complete": false}')


def test_the_code_is_in_the_documented_table() -> None:
    import streamctl.verify.report as report

    assert "| `transfer-incomplete` | warning |" in (report.__doc__ or "")
