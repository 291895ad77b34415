"""Names too long for DEST are refused before anything is written, naming the longest.

S3 and GCS keys hold 1,024 bytes of UTF-8, Azure blob names 1,024 characters, local folders 255 bytes per
name and 4,095 per path (the scheme table's NameLimits). A name counts with the temporary name streamctl
writes it through (`DIR/.streamctl-tmp/TOKEN/NAME`, plus `/PART` on GCS; Azure stages blocks and has none),
so a name that fits DEST also fits as a temporary name. `transfer` and `shard` (DEST prefix plus every file
name, the manifest and the lease) refuse with exit 2 and leave DEST untouched: no object, no upload, no
lease, no folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from servers import StorageServers
from streamctl.storage import open_location

TEMPORARY_EXTRA = len("/.streamctl-tmp/0123456789abcdef")  # 32: what a temporary name adds to a key


def everything_in(storage_servers: StorageServers, root: str) -> list[str]:
    """Every object, part object, blob or unfinished multipart upload in the bucket of `root`."""
    scheme, _, rest = root.partition("://")
    bucket = rest.partition("/")[0]
    if scheme == "s3":
        client = storage_servers.s3().client()
        objects = [item["Key"] for item in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
        uploads = [item["Key"] for item in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
        return objects + uploads
    if scheme == "gs":
        return storage_servers.gcs().object_names(bucket)
    container = storage_servers.azure().service().get_container_client(bucket)
    return [blob.name for blob in container.list_blobs(include=["uncommittedblobs"])]


def key_bytes(root: str, prefix: str, name: str) -> int:
    bucket_prefix = root.partition("://")[2].partition("/")[2]
    return len(f"{bucket_prefix}/{prefix}/{name}".encode())


# ------------------------------------------------------------------------------------------ buckets


def test_a_long_dest_prefix_is_refused_before_anything_is_written(
    model: Path, bucket_root: str, env: dict[str, str], storage_servers: StorageServers
) -> None:
    prefix = "p" * 1_000
    for argv in (
        ["transfer", str(model), f"{bucket_root}/{prefix}"],
        ["transfer", str(model), f"{bucket_root}/{prefix}", "--json"],
        ["shard", str(model), f"{bucket_root}/{prefix}", "-tp", "2"],
    ):
        result = run_cli(*argv, env=env)
        assert result.exit_code == 2, (argv, result.stdout, result.stderr)
        text = result.json()["error"]["message"] if "--json" in argv else result.stderr
        assert "name too long for" in text and "holds 1,024" in text, text
        assert "Traceback" not in result.stderr
        assert everything_in(storage_servers, bucket_root) == [], argv


def test_the_refusal_names_the_longest_file(
    tmp_path: Path, model: Path, bucket_root: str, env: dict[str, str], storage_servers: StorageServers
) -> None:
    """A deep file in SOURCE (--all-files): the longest of several names too long is the one named."""
    deep = model / "extra" / ("a" * 200) / ("b" * 200) / ("c" * 200) / ("d" * 200) / ("f" * 200)
    deep.mkdir(parents=True)
    (deep / "short.txt").write_text("x")
    (deep / ("e" * 150 + ".txt")).write_text("y")
    result = run_cli("transfer", str(model), f"{bucket_root}/model", "--all-files", env=env)
    assert result.exit_code == 2, result.stderr
    assert "/model/extra/aaa" in result.stderr and "e" * 50 + ".txt" in result.stderr, result.stderr
    assert "(1 more name too long)" in result.stderr
    assert everything_in(storage_servers, bucket_root) == []


def test_bytes_of_utf8_on_s3_and_gcs_characters_on_azure(
    model: Path, bucket_root: str, env: dict[str, str], storage_servers: StorageServers
) -> None:
    """480 two-byte characters: 960 bytes plus the names is over 1,024 bytes, well under 1,024 characters."""
    prefix = "é" * 480
    result = run_cli("transfer", str(model), f"{bucket_root}/{prefix}", env=env)
    if bucket_root.startswith("az://"):
        assert result.exit_code == 0, result.stderr
        assert any(name.startswith(f"data/{prefix}/") for name in everything_in(storage_servers, bucket_root))
    else:
        assert result.exit_code == 2, result.stderr
        assert "bytes of UTF-8" in result.stderr
        assert everything_in(storage_servers, bucket_root) == []


def test_a_name_that_fits_only_without_its_temporary_name_is_refused_where_one_is_written(
    tmp_path: Path, bucket_root: str, env: dict[str, str], storage_servers: StorageServers
) -> None:
    """The longest final key is 1,010 bytes: it fits, its temporary name (1,042, GCS 1,048) would not; Azure
    writes none."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text("{}")
    prefix = "q" * (1_010 - key_bytes(bucket_root, "", "streamctl-manifest.json"))
    assert key_bytes(bucket_root, prefix, "streamctl-manifest.json") == 1_010
    result = run_cli("transfer", str(source), f"{bucket_root}/{prefix}", "--all-files", env=env)
    if bucket_root.startswith("az://"):
        assert result.exit_code == 0, result.stderr
    else:
        assert result.exit_code == 2, result.stderr
        assert "as its temporary name under .streamctl-tmp/" in result.stderr, result.stderr
        assert everything_in(storage_servers, bucket_root) == []


def test_names_that_fit_with_their_temporary_names_are_written(
    tmp_path: Path, bucket_root: str, env: dict[str, str], storage_servers: StorageServers
) -> None:
    """The boundary: the longest name's temporary form is exactly 1,024 (GCS: with its part suffix)."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text("{}")
    extra = 0 if bucket_root.startswith("az://") else TEMPORARY_EXTRA + (6 if bucket_root.startswith("gs://") else 0)
    longest = "streamctl-manifest.json"
    prefix = "r" * (1_024 - extra - key_bytes(bucket_root, "", longest))
    assert key_bytes(bucket_root, prefix, longest) + extra == 1_024
    result = run_cli("transfer", str(source), f"{bucket_root}/{prefix}", "--all-files", env=env)
    assert result.exit_code == 0, result.stderr
    location = open_location(f"{bucket_root}/{prefix}")
    assert {location.relative(info.key) for info in location.list()} == {"config.json", longest}
    from streamctl.errors import UsageError
    from streamctl.storage.names import check_names_fit

    with pytest.raises(UsageError, match="name too long"):
        check_names_fit(location, [longest + "x"])


# ------------------------------------------------------------------------------------------ local folders


def test_a_local_dest_folder_name_over_255_bytes_is_refused_before_any_folder_is_made(
    tmp_path: Path, model: Path
) -> None:
    parent = tmp_path / "parent"
    parent.mkdir()
    for name in ("n" * 256, "ü" * 128):  # 256 bytes either way
        for argv in (
            ["transfer", str(model), str(parent / name / "x")],
            ["shard", str(model), str(parent / name), "-tp", "2"],
        ):
            result = run_cli(*argv, "--json")
            assert result.exit_code == 2, (argv, result.stdout, result.stderr)
            message = result.json()["error"]["message"]
            assert "a local folder" in message and "256 bytes" in message and "holds 255 per name" in message
            assert list(parent.iterdir()) == []


def test_a_local_dest_path_over_path_max_is_refused(tmp_path: Path, model: Path) -> None:
    deep = tmp_path / "deep"
    dest = deep.joinpath(*["d" * 250] * 17)  # each name fits; the whole path is over 4,095 bytes
    assert len(os.fsencode(str(dest))) > 4_095
    result = run_cli("transfer", str(model), str(dest))
    assert result.exit_code == 2, result.stderr
    assert "holds 4,095" in result.stderr, result.stderr
    assert not deep.exists()


def test_a_bucket_key_with_a_long_segment_cannot_become_a_local_file(
    tmp_path: Path, model: Path, s3_root: str, storage_env: dict[str, str], storage_servers: StorageServers
) -> None:
    """S3 keys may hold a 300-byte segment; no local file can be named so: refused before the copy."""
    source = f"{s3_root}/model"
    assert run_cli("transfer", str(model), source, env=storage_env).exit_code == 0
    bucket, _, prefix = source.partition("://")[2].partition("/")
    storage_servers.s3().client().put_object(Bucket=bucket, Key=f"{prefix}/notes/{'z' * 300}.txt", Body=b"z")
    result = run_cli("transfer", source, str(tmp_path / "out"), "--all-files", env=storage_env)
    assert result.exit_code == 2, result.stderr
    assert "'zzz" in result.stderr and "/notes/zzz" in result.stderr and "304 bytes" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_the_vllm_gpu_engine_refuses_a_long_dest_before_its_lease_and_before_vllm(
    model: Path, bucket_root: str, storage_servers: StorageServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM names its own files as it saves: each rank's first part, the serving files, the manifest and the
    lease are checked before the lease is taken. (No GPU here: only the availability probe is stubbed.)"""
    from streamctl.errors import UsageError
    from streamctl.progress import NULL_PROGRESS
    from streamctl.shard.engines.vllm_gpu import engine as vllm_engine
    from streamctl.shard.plan import ShardOptions
    from streamctl.shard.run import run_shard

    monkeypatch.setattr(vllm_engine, "check_vllm_engine_available", lambda: None)

    def runner(command: list[str]) -> Any:
        raise AssertionError("vLLM must not be started")

    with pytest.raises(UsageError, match=r"name too long for .*holds 1,024"):
        run_shard(
            open_location(str(model)),
            open_location(f"{bucket_root}/{'p' * 1_000}"),
            ShardOptions(tensor_parallel_size=2, engine="vllm-gpu"),
            NULL_PROGRESS,
            vllm_engine.VllmGpuEngine(runner),
        )
    assert everything_in(storage_servers, bucket_root) == []
