"""Every object streamctl writes carries its sha256 and a correct Content-Type.

Read back with each store's own SDK head call (boto3 head_object, google-cloud-storage's blob reload,
azure-storage-blob's get_blob_properties) or, for folders, the file's extended attributes; the sha256
is compared with the object's actual bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from servers import StorageServers
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from streamctl.storage import s3 as s3_module
from streamctl.storage.base import Location, content_type_for
from streamctl.storage.local_fs import MIME_TYPE_XATTR
from streamctl.storage.url import source_identity
from streamctl.transfer import TransferOptions, execute_transfer, plan_transfer
from tiny_models import write_tiny_checkpoint

SHA256_XATTR = "user.streamctl.sha256"
MiB = 1024 * 1024


def model_folder(folder: Path) -> Path:
    write_tiny_checkpoint(folder, "llama-gqa")
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (folder / "vocab.txt").write_text("a\nb\n")
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "tokenizer.model").write_bytes(b"\x0a\x0bsentencepiece")
    return folder


def head(servers: StorageServers, location: Location, key: str) -> tuple[str | None, dict[str, str]]:
    """(Content-Type, user metadata) as the store's own SDK reports them."""
    scheme, bucket = location.store.scheme, location.store.bucket
    if scheme == "s3":
        response = servers.s3().client().head_object(Bucket=bucket, Key=key)
        return response["ContentType"], {k.lower(): v for k, v in response["Metadata"].items()}
    if scheme == "gs":
        blob = servers.gcs().client().bucket(bucket).get_blob(key)
        return blob.content_type, dict(blob.metadata or {})
    if scheme == "az":
        properties = servers.azure().service().get_blob_client(bucket, key).get_blob_properties()
        return properties.content_settings.content_type, dict(properties.metadata or {})
    path = Path(location.store.url(key).removeprefix("file://"))
    return os.getxattr(path, MIME_TYPE_XATTR).decode(), {"sha256": os.getxattr(path, SHA256_XATTR).decode()}


def _read(location: Location, key: str, size: int) -> bytes:
    return location.store.read_range(key, 0, size)


def check_every_object(servers: StorageServers, location: Location) -> list[str]:
    problems = []
    objects = list(location.list())
    assert objects, location.url
    for info in objects:
        content_type, metadata = head(servers, location, info.key)
        if content_type != content_type_for(info.key):
            problems.append(f"{info.key}: Content-Type {content_type!r}, expected {content_type_for(info.key)!r}")
        actual = hashlib.sha256(_read(location, info.key, info.size)).hexdigest()
        if metadata.get("sha256") != actual:
            problems.append(f"{info.key}: sha256 metadata {metadata.get('sha256')!r}, bytes hash to {actual}")
    return problems


def test_content_types_by_suffix() -> None:
    assert content_type_for("m/config.json") == "application/json"
    assert content_type_for("model-rank-0-part-0.safetensors") == "application/octet-stream"
    assert content_type_for("chat_template.jinja") == "text/plain"
    assert content_type_for("vocab.txt") == "text/plain"
    assert content_type_for("tokenizer.model") == "application/octet-stream"
    assert content_type_for("no-suffix") == "application/octet-stream"
    assert content_type_for("archive.tar.gz") == "application/octet-stream"  # an encoding is no type


def test_transfer_and_shard_objects_carry_sha256_and_content_type(
    tmp_path: Path, any_root: str, storage_servers: StorageServers
) -> None:
    source = open_location(str(model_folder(tmp_path / "src")))
    transferred = open_location(any_root.rstrip("/") + "/transferred")
    plan = plan_transfer(source, transferred, source_identity(source))
    execute_transfer(plan, source, transferred, TransferOptions())
    sharded = open_location(any_root.rstrip("/") + "/sharded")
    shard_checkpoint(source, sharded, ShardOptions(tensor_parallel_size=2))
    names = {sharded.relative(info.key) for info in sharded.list()}
    assert {"config.json", "chat_template.jinja", "streamctl-shard-manifest.json"} <= names
    assert any(name.endswith(".safetensors") for name in names)
    problems = check_every_object(storage_servers, transferred) + check_every_object(storage_servers, sharded)
    assert not problems, "\n".join(problems)


def test_s3_late_metadata_above_the_copy_limit_uses_a_multipart_copy(
    s3_root: str, storage_servers: StorageServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_module, "MAX_COPY_OBJECT_BYTES", 6 * MiB)
    monkeypatch.setattr(s3_module, "COPY_PART_BYTES", 5 * MiB)
    location = open_location(s3_root)
    data = os.urandom(13 * MiB)
    key = location.key("big.safetensors")
    upload = location.store.start_multipart(key, 5 * MiB)
    for index, start in enumerate(range(0, len(data), 5 * MiB)):
        upload.upload_part(index, data[start : start + 5 * MiB])
    digest = hashlib.sha256(data).hexdigest()
    info = upload.complete({"sha256": digest})
    assert info.metadata["sha256"] == digest and info.size == len(data)
    content_type, metadata = head(storage_servers, location, key)
    assert (content_type, metadata) == ("application/octet-stream", {"sha256": digest})
    assert location.store.read_range(key, 0, len(data)) == data
    assert not location.store.unfinished_uploads(location.prefix)
