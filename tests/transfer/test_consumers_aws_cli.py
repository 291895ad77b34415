"""The AWS CLI reads what streamctl wrote to S3, as users' own scripts do.

`aws` (awscli, the test extra: botocore's own command line, with a botocore of its own, not streamctl's code)
lists, downloads and heads the objects of a `transfer` (multipart files, nested folders, names with spaces and
non-ASCII letters) and of a `shard` into moto on 127.0.0.1. What it reads must be exactly what streamctl
meant: the same keys and nothing else (no temporary or lease object), the same bytes, the sha256 and the
Content-Type streamctl recorded, and a multipart ETag with the part count the part size implies.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.storage.base import content_type_for
from tiny_models import write_tiny_checkpoint

AWS = shutil.which("aws", path=str(Path(sys.executable).parent)) or shutil.which("aws")
pytestmark = pytest.mark.skipif(AWS is None, reason="the AWS CLI (awscli, in the test extra) is not installed")
MiB = 1024 * 1024
PART = 5 * MiB  # S3's smallest part


def aws(*args: str, env: dict[str, str]) -> str:
    """One `aws` command against moto (path-style, the storage env's endpoint and keys); its stdout."""
    assert AWS is not None
    config = Path(env["AWS_CONFIG_FILE"]).with_name("aws-cli-config")
    if not config.exists():
        config.write_text("[default]\ns3 =\n    addressing_style = path\n")
    done = subprocess.run(
        [AWS, *args, "--endpoint-url", env["AWS_ENDPOINT_URL"]],
        env={**os.environ, **env, "AWS_CONFIG_FILE": str(config)},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (args, done.stderr[-2000:])
    return done.stdout


def bucket_and_prefix(root: str) -> tuple[str, str]:
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    return bucket, prefix


def listed_keys(root: str, env: dict[str, str]) -> set[str]:
    bucket, prefix = bucket_and_prefix(root)
    document = json.loads(aws("s3api", "list-objects-v2", "--bucket", bucket, "--prefix", f"{prefix}/", env=env))
    return {item["Key"].removeprefix(f"{prefix}/") for item in document.get("Contents", [])}


def head_object(root: str, name: str, env: dict[str, str]) -> dict[str, Any]:
    bucket, prefix = bucket_and_prefix(root)
    return json.loads(aws("s3api", "head-object", "--bucket", bucket, "--key", f"{prefix}/{name}", env=env))


def files_under(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def model_with_awkward_files(folder: Path) -> dict[str, bytes]:
    """A tiny Llama plus what real repos carry: a sentence-transformers module folder, a file in several
    parts, and names with a space and non-ASCII letters."""
    write_tiny_checkpoint(folder, "llama-gqa")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([{"idx": 0, "path": "1_Pooling"}]))
    (folder / "notes café.txt").write_text("résumé\n")
    (folder / "big weights.bin").write_bytes(os.urandom(2 * PART + 12345))  # three parts
    return files_under(folder)


def test_aws_cli_reads_a_transfer_exactly(tmp_path: Path, s3_root: str, storage_env: dict[str, str]) -> None:
    source = tmp_path / "model"
    files = model_with_awkward_files(source)
    done = run_cli(
        "transfer", str(source), s3_root, "--all-files", "--part-size", "5MiB", "--quiet", env=storage_env
    )  # fmt: skip
    assert done.exit_code == 0, done.stderr

    keys = listed_keys(s3_root, storage_env)
    extra = keys - set(files)
    assert set(files) <= keys, sorted(set(files) - keys)
    assert extra == {"streamctl-manifest.json"}, sorted(extra)  # no temporary, lease or part object

    downloaded = tmp_path / "downloaded"
    aws("s3", "cp", f"{s3_root}/", str(downloaded), "--recursive", "--only-show-errors", env=storage_env)
    got = files_under(downloaded)
    assert {name: got.get(name) for name in files} == files
    manifest = json.loads(got["streamctl-manifest.json"])
    assert {entry["path"]: entry["sha256"] for entry in manifest["files"]} == {
        name: hashlib.sha256(data).hexdigest() for name, data in files.items()
    }

    for name, data in files.items():
        head = head_object(s3_root, name, storage_env)
        assert head["ContentLength"] == len(data), name
        assert head["Metadata"].get("sha256") == hashlib.sha256(data).hexdigest(), (name, head["Metadata"])
        assert head["ContentType"] == content_type_for(name), (name, head["ContentType"])
    parts = -(-len(files["big weights.bin"]) // PART)
    assert head_object(s3_root, "big weights.bin", storage_env)["ETag"].strip('"').endswith(f"-{parts}")


def test_aws_cli_downloads_a_sharded_checkpoint_identical_to_a_local_one(
    tmp_path: Path, s3_root: str, storage_env: dict[str, str]
) -> None:
    source = tmp_path / "model"
    write_tiny_checkpoint(source, "llama-gqa")
    local = tmp_path / "local-tp2"
    for dest in (str(local), s3_root):
        done = run_cli("shard", str(source), dest, "-tp", "2", "--max-part-size", "20KB", "--quiet", env=storage_env)
        assert done.exit_code == 0, done.stderr

    downloaded = tmp_path / "downloaded"
    aws("s3", "sync", f"{s3_root}/", str(downloaded), "--only-show-errors", env=storage_env)
    ours, theirs = files_under(local), files_under(downloaded)
    weights = sorted(name for name in ours if name.endswith(".safetensors"))
    assert len(weights) > 2, weights  # several parts per rank
    assert sorted(theirs) == sorted(ours)
    for name in weights:
        assert theirs[name] == ours[name], name
    # The manifests differ only where they name DEST; both say complete, with the same files and digests.
    local_manifest, bucket_manifest = (json.loads(files[SHARD_MANIFEST_NAME]) for files in (ours, theirs))
    assert local_manifest["complete"] is bucket_manifest["complete"] is True
    assert local_manifest["ranks"] == bucket_manifest["ranks"]
