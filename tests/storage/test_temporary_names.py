"""streamctl's temporary names never collide with a source's names, and fit beside any name.

Every backend that makes temporary names (local files, GCS part objects) uses one reserved shape,
`DIR/.streamctl-tmp/TOKEN/NAME[/PART]`; S3 and Azure stage parts server-side and make none. A name the
destination cannot hold (ENAMETOOLONG and the like) is a usage error, exit 2, never retried.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.errors import RemoteError, UsageError
from streamctl.retry import RetryPolicy, with_retries
from streamctl.storage import open_location

TEMPORARY_FOLDER = ".streamctl-tmp"  # the documented reserved folder (storage/base.py TEMPORARY_FOLDER)

pytestmark = pytest.mark.timeout(120)

OLD_LOCAL_FORM = ".config.json.0123456789ab.streamctl-partial"  # what streamctl 0.x named its local temp files
OLD_GCS_FORM = "config.json.streamctl-parts/0123456789abcdef/00000"  # ... and its GCS part objects
NEW_FORM_LOOKALIKE = f"{TEMPORARY_FOLDER}/notes.txt"  # the reserved folder name, but not the temporary shape
LONG_ASCII = "a" * 245 + ".json"  # 250 bytes
LONG_UTF8_250 = "é" * 122 + "x.json"  # 244 + 6 = 250 bytes


def _names() -> dict[str, bytes]:
    return {
        "config.json": b'{"model_type": "llama"}',
        OLD_LOCAL_FORM: b"a repo file that only looks like a temporary file",
        OLD_GCS_FORM: b"another one",
        NEW_FORM_LOOKALIKE: b"notes",
        LONG_ASCII: b'{"long": "ascii"}',
        LONG_UTF8_250: b'{"long": "utf-8"}',
    }


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_the_long_names_are_as_long_as_the_issue_says() -> None:
    from streamctl.storage.base import TEMPORARY_FOLDER as reserved
    from streamctl.storage.base import parse_temporary_key, temporary_key

    assert reserved == TEMPORARY_FOLDER
    assert len(LONG_ASCII.encode()) == 250 and len(LONG_UTF8_250.encode()) == 250
    # The temporary form keeps the name as its own segment: no segment grows.
    key = temporary_key(f"sub/{LONG_UTF8_250}", "0123456789abcdef")
    assert max(len(part.encode()) for part in key.split("/")) == 250
    assert parse_temporary_key(key) is not None and parse_temporary_key(key).final_key == f"sub/{LONG_UTF8_250}"
    assert parse_temporary_key(OLD_LOCAL_FORM) is None and parse_temporary_key(NEW_FORM_LOOKALIKE) is None


def test_source_files_named_like_temporary_files_are_copied_and_kept(tmp_path: Path) -> None:
    """Before: the old-form file was left out of the listing (and a DEST copy deleted on every run), and
    the 250-byte names failed: their temporary names were 281 bytes (ENAMETOOLONG, retried, exit 6)."""
    source, dest = tmp_path / "src", tmp_path / "dest"
    files = _names()
    _write_tree(source, files)

    for run in range(2):  # the second run must neither delete nor re-copy anything
        result = run_cli("transfer", str(source), str(dest), "--all-files", "--json", "--no-verify")
        assert result.exit_code == 0, result.stderr
        actions = {file["path"]: file["action"] for file in result.json()["files"]}
        assert set(actions) == set(files)
        assert set(actions.values()) == ({"copied"} if run == 0 else {"skipped"})
        assert result.json()["discarded_uploads"] == []
        for name, data in files.items():
            assert (dest / name).read_bytes() == data
            assert (source / name).read_bytes() == data
    assert not (dest / TEMPORARY_FOLDER).exists() or os.listdir(dest / TEMPORARY_FOLDER) == ["notes.txt"]


def test_a_dest_file_named_like_an_old_temporary_file_survives_a_run(tmp_path: Path) -> None:
    source, dest = tmp_path / "src", tmp_path / "dest"
    _write_tree(source, {"config.json": b"{}"})
    _write_tree(dest, {OLD_LOCAL_FORM: b"the user's own file"})

    result = run_cli("transfer", str(source), str(dest), "--no-verify")

    assert result.exit_code == 0, result.stderr
    assert (dest / OLD_LOCAL_FORM).read_bytes() == b"the user's own file"


def test_every_backend_lists_lookalike_names_as_data_and_never_discards_them(any_root: str) -> None:
    """Before: GCS hid `*.streamctl-parts/*` and offered it for discarding; local did so for the old form."""
    root = open_location(any_root)
    lookalikes = [OLD_LOCAL_FORM, OLD_GCS_FORM, NEW_FORM_LOOKALIKE, f"sub/{OLD_LOCAL_FORM}"]
    for name in ["config.json", *lookalikes]:
        root.store.put(root.key(name), name.encode())

    listed = sorted(root.relative(info.key) for info in root.list())

    assert listed == sorted(["config.json", *lookalikes])
    assert root.store.unfinished_uploads(root.key("")) == []


def test_a_killed_upload_in_the_new_form_is_hidden_listed_and_discarded(any_root: str) -> None:
    root = open_location(any_root)
    key = root.key(f"sub/{LONG_UTF8_250}" if any_root.startswith("/") else "sub/killed.bin")
    upload = root.store.start_multipart(key, max(root.store.min_part_size, 1024))
    upload.upload_part(0, b"x" * max(root.store.min_part_size, 1024))  # ... and the process dies

    assert [info.key for info in root.list()] == []
    found = root.store.unfinished_uploads(root.key(""))
    assert [upload.key for upload in found] == [key]
    for unfinished in found:
        unfinished.discard()
    assert root.store.unfinished_uploads(root.key("")) == []


def test_a_name_too_long_for_the_destination_is_a_usage_error_never_retried(tmp_path: Path) -> None:
    store = open_location(str(tmp_path / "dest")).store
    calls = []

    def put() -> object:
        calls.append(1)
        return store.put("x" * 256 + ".json", b"{}")

    with pytest.raises(UsageError, match="name too long"):
        with_retries(put, RetryPolicy(attempts=5, base_delay_s=0.01))
    assert calls == [1]
    with pytest.raises(UsageError, match="name too long"):
        store.start_multipart("sub/" + "é" * 128, 1024)  # 256 bytes of UTF-8
    assert not isinstance(UsageError("x"), RemoteError)


def test_cli_exits_2_at_once_when_a_source_name_cannot_exist_in_dest(
    s3_root: str, storage_env: dict[str, str], tmp_path: Path
) -> None:
    """An object store holds names a folder cannot: a 300-byte name from S3 into a local folder."""
    source = open_location(s3_root)
    too_long = "w" * 295 + ".json"
    for name, data in (("config.json", b"{}"), (LONG_UTF8_250, b"fits"), (too_long, b"does not fit")):
        source.store.put(source.key(name), data, {"sha256": hashlib.sha256(data).hexdigest()})
    started = time.monotonic()

    result = run_cli("transfer", s3_root, str(tmp_path / "dest"), "--all-files", "--no-verify", env=storage_env)

    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert "name too long" in result.stderr and "retry" not in result.stderr.lower()
    assert time.monotonic() - started < 60
    assert not any(path.name == too_long for path in (tmp_path / "dest").rglob("*"))


def test_a_source_holding_the_temporary_shape_is_told_so_not_silently_trimmed(tmp_path: Path) -> None:
    """A file in the exact reserved shape is another run's upload in flight (or a killed one's): never
    copied as data, and shown in the plan as what it is."""
    source = tmp_path / "src"
    in_flight = f"{TEMPORARY_FOLDER}/0123456789abcdef/model.safetensors"
    _write_tree(source, {"config.json": b"{}", in_flight: b"half a file"})

    plan = run_cli("transfer", str(source), str(tmp_path / "dest"), "--all-files", "--dry-run", "--json")

    assert plan.exit_code == 0, plan.stderr
    assert [file["path"] for file in plan.json()["files"]] == ["config.json"]
    assert [(entry["path"], entry["kind"]) for entry in plan.json()["skipped"]] == [(in_flight, "temporary")]
