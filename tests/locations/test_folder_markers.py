"""Folder markers are skipped in every listing and reported, on every bucket backend.

A zero-byte `prefix/` or `prefix/sub/` object (what the S3 and GCS consoles' "Create folder" writes; an Azure
hierarchical-namespace folder is a blob with metadata hdi_isfolder=true) made `transfer` refuse the whole
source ("refusing unsafe file name ''") while `verify-index` and `shard` accepted it. Now one rule
(storage/base.py: folder_marker_reason, applied by Location.list) leaves markers out of every listing, and
every command reports them as it reports a local folder's FIFOs ("skipped" in JSON, kind "folder-marker").
An object whose name ends with '/' and holds bytes is data no file can be named: `transfer` refuses it,
naming it, before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cli_helpers import run_cli
from servers import StorageServers

MARKERS = ("", "sub/", "sub/deeper/", "tokenizer/")  # relative to the model's prefix: itself, nested, deeper


def put(
    storage_servers: StorageServers, root: str, key: str, data: bytes, metadata: dict[str, str] | None = None
) -> None:
    """Write one object through the backend's own SDK, as a console or another tool would."""
    scheme, _, rest = root.partition("://")
    bucket, _, prefix = rest.partition("/")
    name = f"{prefix}/{key}" if prefix else key
    if scheme == "s3":
        storage_servers.s3().client().put_object(Bucket=bucket, Key=name, Body=data, Metadata=metadata or {})
    elif scheme == "gs":
        blob = storage_servers.gcs().client().bucket(bucket).blob(name)
        blob.metadata = metadata
        blob.upload_from_string(data)
    else:
        storage_servers.azure().service().get_container_client(bucket).upload_blob(name, data, metadata=metadata)


def upload_model(storage_servers: StorageServers, model: Path, root: str) -> None:
    for path in sorted(model.rglob("*")):
        if path.is_file():
            put(storage_servers, root, path.relative_to(model).as_posix(), path.read_bytes())


def skipped_markers(document: dict[str, Any]) -> set[str]:
    return {entry["path"] for entry in document["skipped"] if entry["kind"] == "folder-marker"}


def test_markers_are_skipped_and_reported_and_the_copy_is_exact(
    tmp_path: Path, model: Path, bucket_root: str, env: dict[str, str], storage_servers: StorageServers
) -> None:
    source = f"{bucket_root}/model"
    upload_model(storage_servers, model, source)
    for marker in MARKERS:
        put(storage_servers, source, marker, b"")
    if bucket_root.startswith("az://"):  # a hierarchical-namespace folder: no trailing '/', hdi_isfolder
        put(storage_servers, source, "adls-folder", b"", {"hdi_isfolder": "true"})
    expected = {marker.rstrip("/") if marker else "" for marker in MARKERS}

    result = run_cli("transfer", source, str(tmp_path / "out"), "--json", env=env)
    assert result.exit_code == 0, result.stderr
    document = result.json()
    reported = {path.rstrip("/") for path in skipped_markers(document)}
    assert expected <= reported, document["skipped"]
    if bucket_root.startswith("az://"):
        assert "adls-folder" in reported
    copied = [file["path"] for file in document["files"]]
    assert copied and all(path for path in copied)
    for path in copied:
        assert (tmp_path / "out" / path).read_bytes() == (model / path).read_bytes(), path
    assert not (tmp_path / "out" / "sub").exists()  # no folder made for a marker

    human = run_cli("transfer", source, str(tmp_path / "out2"), "--dry-run", env=env)
    assert human.exit_code == 0, human.stderr
    assert "folder marker" in human.stdout and "sub/deeper/" in human.stdout, human.stdout

    verified = run_cli("verify-index", source, "--json", env=env)
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    warnings = [finding for finding in verified.json()["findings"] if finding["code"] == "entry-skipped"]
    assert {(finding["file"] or "").rstrip("/") for finding in warnings} >= expected, warnings

    sharded = run_cli("shard", source, str(tmp_path / "tp2"), "-tp", "2", "--json", env=env)
    assert sharded.exit_code == 0, sharded.stdout + sharded.stderr
    assert {path.rstrip("/") for path in skipped_markers(sharded.json())} >= expected


def test_a_source_of_markers_only_is_not_found(
    tmp_path: Path, bucket_root: str, env: dict[str, str], storage_servers: StorageServers
) -> None:
    source = f"{bucket_root}/empty"
    for marker in MARKERS:
        put(storage_servers, source, marker, b"")
    result = run_cli("transfer", source, str(tmp_path / "out"), env=env)
    assert result.exit_code == 3, result.stderr
    assert "folder marker" in result.stderr
    assert not (tmp_path / "out").exists()


def test_an_object_ending_in_a_slash_that_holds_bytes_is_refused_by_name(
    tmp_path: Path, model: Path, bucket_root: str, env: dict[str, str], storage_servers: StorageServers
) -> None:
    """Not a marker: data that no file can be named. Skipping it would lose it silently."""
    source = f"{bucket_root}/model"
    upload_model(storage_servers, model, source)
    put(storage_servers, source, "notes/", b"important")
    result = run_cli("transfer", source, str(tmp_path / "out"), "--json", env=env)
    assert result.exit_code == 2, result.stderr
    error = result.json()["error"]
    assert "'notes/'" in error["message"] and "ends with '/'" in error["message"], error
    assert "9 bytes" in error["message"]
    assert not (tmp_path / "out").exists()


def test_a_dest_holding_markers_takes_a_transfer_and_keeps_them(
    tmp_path: Path, model: Path, bucket_root: str, env: dict[str, str], storage_servers: StorageServers
) -> None:
    """A DEST made with a console's "Create folder": its markers are no stray files to report or remove."""
    dest = f"{bucket_root}/made-in-console"
    put(storage_servers, dest, "", b"")
    put(storage_servers, dest, "sub/", b"")
    first = run_cli("transfer", str(model), dest, "--json", env=env)
    assert first.exit_code == 0, first.stderr
    again = run_cli("transfer", str(model), dest, "--force", "--dry-run", "--json", env=env)
    assert again.exit_code == 0, again.stderr
    plan = again.json()
    assert all(item["path"] not in ("", "sub/") for item in plan["left_alone"]), plan["left_alone"]
    assert json.dumps(plan).count("sub/") == 0
