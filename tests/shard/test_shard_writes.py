"""`streamctl shard` writing: what DEST gets, --force, failures that leave nothing under a final name, the
reconstruction check catching corruption, ranged reads, bucket and Hub sources, interrupts, killed runs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli_helpers import run_cli
from shard_models import (
    assert_rank_matches,
    read_file,
    shard,
    write_model,
)
from slowproxy import SlowProxy
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.checkpoint.safetensors import parse_safetensors_bytes
from streamctl.errors import UsageError
from streamctl.retry import RetryPolicy
from streamctl.shard.checks import check_reconstruction
from streamctl.shard.plan import ShardOptions
from streamctl.shard.result import ShardCheckFailed
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from streamctl.storage.base import Location

# ---------------------------------------------------------------------------------------------------
# Destination contents, manifest, force, failures


def test_dest_gets_serving_files_manifest_and_nothing_else(tmp_path: Path) -> None:
    config, _ = write_model(tmp_path / "hf", "llama-gqa", auto_map={"AutoConfig": "configuration_tiny.TinyConfig"})
    (tmp_path / "hf" / "configuration_tiny.py").write_text("class TinyConfig: pass\n")
    result = shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2)
    names = sorted(
        path.relative_to(tmp_path / "out").as_posix() for path in (tmp_path / "out").rglob("*") if path.is_file()
    )
    assert names == [
        "config.json",
        "configuration_tiny.py",
        "generation_config.json",
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
        SHARD_MANIFEST_NAME,
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == config
    manifest = json.loads((tmp_path / "out" / SHARD_MANIFEST_NAME).read_text())
    assert (manifest["tensor_parallel_size"], manifest["pipeline_parallel_size"]) == (2, 1)
    assert manifest["pattern"] == "model-rank-{rank}-part-{part}.safetensors"
    for rank in manifest["ranks"]:
        for file in rank["files"]:
            data = (tmp_path / "out" / file["path"]).read_bytes()
            assert file["sha256"] == hashlib.sha256(data).hexdigest() and file["size"] == len(data)
            assert [(t["name"], t["dtype"], tuple(t["shape"])) for t in file["tensors"]] == [
                (name, dtype, shape) for name, (dtype, shape, _) in read_file(tmp_path / "out" / file["path"]).items()
            ]
    assert {file.sha256 for file in result.files} == {
        file["sha256"] for rank in manifest["ranks"] for file in rank["files"]
    }


def test_force_replaces_old_weights(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=4)
    with pytest.raises(UsageError, match="already holds"):
        shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2)
    result = shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2, force=True)
    # The old ranks 2 and 3 would be loaded (or flagged) next to the new files; the old manifest is replaced
    # in place (first by the run's "incomplete" one), so it is not among the removed.
    assert sorted(result.removed) == [
        "model-rank-2-part-0.safetensors",
        "model-rank-3-part-0.safetensors",
    ]
    assert sorted(path.name for path in (tmp_path / "out").glob("*.safetensors")) == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
    ]


@pytest.mark.parametrize("fail_at", [1, 5])
def test_a_failure_mid_way_leaves_nothing_under_a_final_name(tmp_path: Path, fail_at: int) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    dest = open_location(str(tmp_path / "out"))
    failing = Location(CountingParts(dest.store, positional=False, fail_at=fail_at), dest.prefix)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="injected failure"):
        shard_checkpoint(
            open_location(str(tmp_path / "hf")), failing, ShardOptions(tensor_parallel_size=2, max_part_size=3000)
        )
    leftovers = [path.name for path in (tmp_path / "out").rglob("*")] if (tmp_path / "out").exists() else []
    assert leftovers == []  # no final names, and the temporary files were removed by the aborts


class CountingParts:
    """Wraps a store: counts the parts its uploads are sent in; `positional` False hides the uploads'
    positional writer, as a store without one would; the `fail_at`-th part raises, as a full disk or a
    dropped link would."""

    def __init__(self, inner: Any, positional: bool, fail_at: int | None = None) -> None:
        self.inner, self.positional, self.fail_at, self.parts = inner, positional, fail_at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start_multipart(
        self, key: str, part_size: int, metadata: Any = None, content_type: Any = None, resume: Any = None
    ) -> Any:
        upload = self.inner.start_multipart(key, part_size, metadata, content_type, resume)
        outer = self

        class Upload:
            def __getattr__(self, name: str) -> Any:
                return getattr(upload, name)

            def upload_part(self, index: int, data: bytes) -> None:
                outer.parts += 1
                if outer.parts == outer.fail_at:
                    raise UsageError("injected failure")
                upload.upload_part(index, data)

            def positional_writer(self) -> Any:
                return upload.positional_writer() if outer.positional else None

        return Upload()


@pytest.mark.parametrize("positional", [True, False])
def test_rank_files_are_written_in_place_where_the_upload_can_and_in_parts_otherwise(
    tmp_path: Path, positional: bool
) -> None:
    config, hf = write_model(tmp_path / "hf", "llama-gqa")
    dest = open_location(str(tmp_path / "out"))
    counting = CountingParts(dest.store, positional)
    options = ShardOptions(tensor_parallel_size=2, max_part_size=3000)
    result = shard_checkpoint(open_location(str(tmp_path / "hf")), Location(counting, dest.prefix), options)  # type: ignore[arg-type]
    assert result.ok and len(result.files) > 2
    assert counting.parts == (0 if positional else len(result.files))  # small files: one part each
    assert_rank_matches(tmp_path / "out", config, hf, 2)


def test_reconstruction_check_catches_a_corrupted_file(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    result = shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2)
    path = tmp_path / "out" / "model-rank-1-part-0.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # the last tensor of the file
    path.write_bytes(bytes(data))
    report = check_reconstruction(
        open_location(str(tmp_path / "hf")), open_location(str(tmp_path / "out")), result.plan, RetryPolicy()
    )
    assert not report.ok and "differ from the source" in report.problems[0]


def test_a_failed_check_fails_the_run_and_writes_no_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import streamctl.shard.writer as writer_module

    write_model(tmp_path / "hf", "llama-gqa")
    real = writer_module.block_chunks

    def one_wrong_bit(block: Any, data: Any, out_dtype: str) -> list[tuple[int, memoryview]]:
        chunks = real(block, data, out_dtype)
        if block.source is None or not block.source.name.endswith("down_proj.weight"):
            return chunks
        flipped = np.frombuffer(chunks[0][1], dtype=np.uint8).copy()
        flipped[0] ^= 1
        return [(chunks[0][0], flipped.data), *chunks[1:]]

    monkeypatch.setattr(writer_module, "block_chunks", one_wrong_bit)
    with pytest.raises(ShardCheckFailed) as failure:
        shard(tmp_path / "hf", tmp_path / "out", tensor_parallel_size=2)
    assert failure.value.exit_code == 1
    assert failure.value.result.verify.ok and not failure.value.result.reconstruction.ok
    # No completed manifest: the one left says the run never completed (verify-index and serve refuse it).
    assert json.loads((tmp_path / "out" / SHARD_MANIFEST_NAME).read_text())["complete"] is False


def test_reads_are_small_ranged_reads_inside_one_tensor(tmp_path: Path) -> None:
    """Memory never holds a tensor whole: every data read is one block (read_block at most) of one tensor."""
    from checkpoints import counting

    write_model(tmp_path / "hf", "llama-gqa", intermediate_size=4096)  # 256 KiB MLP tensors
    source, store = counting(open_location(str(tmp_path / "hf")))
    shard_checkpoint(
        source, open_location(str(tmp_path / "out")), ShardOptions(tensor_parallel_size=2, read_block=65536)
    )
    spans = []
    for path in (tmp_path / "hf").glob("*.safetensors"):
        header = parse_safetensors_bytes(path.read_bytes())
        spans += [
            (path.name, 8 + header.header_length + t.begin, 8 + header.header_length + t.end) for t in header.tensors
        ]
    data_reads = [read for read in store.reads if read[0].endswith(".safetensors") and read[1] > 0]
    assert data_reads and max(read[2] for read in data_reads) <= 65536
    for key, start, length in data_reads:
        assert any(key.endswith(name) and begin <= start and start + length <= end for name, begin, end in spans)


# ---------------------------------------------------------------------------------------------------
# Buckets


@pytest.fixture(params=["s3", "gs", "az"])
def bucket_root(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_root")


def test_bucket_uploads_offer_no_positional_writer(bucket_root: str) -> None:
    dest = open_location(f"{bucket_root}/positional")
    upload = dest.store.start_multipart(dest.key("x.safetensors"), 5 * 1024 * 1024)
    try:
        assert upload.positional_writer() is None
    finally:
        upload.abort()


def test_a_local_upload_writes_at_any_offset_and_shows_only_once_complete(tmp_path: Path) -> None:
    dest = open_location(str(tmp_path / "out"))
    upload = dest.store.start_multipart(dest.key("x.bin"), 5 * 1024 * 1024)
    write_at = upload.positional_writer()
    assert write_at is not None
    write_at(3, memoryview(b"def"))
    write_at(0, b"abc")
    assert not (tmp_path / "out" / "x.bin").exists()
    upload.complete()
    assert (tmp_path / "out" / "x.bin").read_bytes() == b"abcdef"


def test_bucket_source_and_destination(tmp_path: Path, bucket_root: str) -> None:
    """S3, GCS (parts composed) and Azure (staged blocks) as both SOURCE and DEST. Parts of 4 kB where the
    store allows them (S3's minimum is 5 MiB), so GCS and Azure put every rank file together from parts."""
    config, hf = write_model(tmp_path / "hf", "qwen3", extra_files=False)
    source = open_location(f"{bucket_root}/hf")
    for path in (tmp_path / "hf").iterdir():
        source.store.put(source.key(path.name), path.read_bytes())
    dest = open_location(f"{bucket_root}/sharded")
    options = ShardOptions(
        tensor_parallel_size=2, pipeline_parallel_size=2, upload_chunk=4096, read_block=4096, max_buffer=64 * 4096
    )
    result = shard_checkpoint(source, dest, options)
    assert result.ok and result.reconstruction is not None and result.reconstruction.bytes_compared > 0
    if dest.store.min_part_size <= 4096:
        assert all(file.size > 2 * 4096 for file in result.files)  # several parts each
    local = tmp_path / "copy"
    local.mkdir()
    for info in dest.list():
        (local / dest.relative(info.key)).write_bytes(dest.store.read_range(info.key, 0, info.size))
    assert_rank_matches(local, config, hf, 2, 2)
    manifest = json.loads((local / SHARD_MANIFEST_NAME).read_text())
    assert (local / "config.json").exists() and not list(local.glob(".*"))
    for rank in manifest["ranks"]:
        for file in rank["files"]:
            assert hashlib.sha256((local / file["path"]).read_bytes()).hexdigest() == file["sha256"]


def test_hub_repo_as_source(tmp_path: Path, fake_hub: Any) -> None:
    """SOURCE as a Hub repo (ORG/NAME, as `transfer` takes it): read in ranges through the real
    huggingface_hub client, the same bytes as from a local copy, the manifest pinned to the commit."""
    write_model(tmp_path / "hf", "qwen2")
    repo = fake_hub.add_repo("org/tiny", folder=tmp_path / "hf")
    result = run_cli("shard", "org/tiny", str(tmp_path / "out"), "-tp", "2", "--json")
    assert result.exit_code == 0, result.stderr
    shard(tmp_path / "hf", tmp_path / "local", tensor_parallel_size=2)
    names = sorted(path.name for path in (tmp_path / "local").glob("model-rank-*"))
    assert names and sorted(path.name for path in (tmp_path / "out").glob("model-rank-*")) == names
    for name in names:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    manifest = json.loads((tmp_path / "out" / SHARD_MANIFEST_NAME).read_text())
    assert manifest["source"] == f"hf://org/tiny@{repo.refs['main']}"
    assert fake_hub.count("/resolve/", role="hub") + fake_hub.count("/resolve/", role="cdn") > 0
    missing = run_cli("shard", "org/absent", str(tmp_path / "out2"), "-tp", "2")
    assert missing.exit_code == 3 and "Traceback" not in missing.stderr
    token = fake_hub.add_token("hf_gated_secret")
    fake_hub.add_repo("org/gated", folder=tmp_path / "hf", gated=True, granted=[token])
    refused = run_cli("shard", "hf://org/gated", str(tmp_path / "gated"), "-tp", "2")
    assert refused.exit_code == 4 and not (tmp_path / "gated").exists()
    granted = run_cli("shard", "hf://org/gated", str(tmp_path / "gated"), "-tp", "2", "--token", token, "--json")
    assert granted.exit_code == 0, granted.stderr
    assert token not in granted.stdout + granted.stderr + "".join(
        path.read_text() for path in (tmp_path / "gated").glob("*.json")
    )


def test_cli_writes_into_a_bucket_with_json(tmp_path: Path, s3_root: str, storage_env: dict[str, str]) -> None:
    write_model(tmp_path / "hf", "mistral")
    result = run_cli("shard", str(tmp_path / "hf"), f"{s3_root}/m", "-tp", "2", "--json", env=storage_env)
    assert result.exit_code == 0, result.stderr
    document = result.json()
    assert set(document) >= {
        "source",
        "dest",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "pattern",
        "vllm_version",
        "files",
        "bytes_written",
        "seconds",
        "checks",
    }
    assert document["checks"]["verify"]["ok"] and document["checks"]["reconstruction"]["ok"]
    assert [(file["tp_rank"], file["pp_rank"], file["part"]) for file in document["files"]] == [(0, 0, 0), (1, 0, 0)]
    assert all(len(file["sha256"]) == 64 and file["tensors"] > 0 for file in document["files"])


@pytest.mark.parametrize("where", ["local", "s3"])
def test_interrupt_aborts_every_upload_and_leaves_no_file(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """Ctrl-C while rank files are being written: exit 130, no traceback, no multipart upload left open
    (on S3 they cost storage until aborted), no temporary file left, nothing under DEST at all."""
    import os
    import signal
    import time

    # ~145 MB of weights: rank files of ~72 MB go out as several 8 MiB parts, long enough to interrupt.
    write_model(
        tmp_path / "hf", "llama-gqa", hidden_size=512, intermediate_size=4096, vocab_size=32000, num_hidden_layers=4
    )
    if where == "s3":
        import boto3

        s3_root = request.getfixturevalue("s3_root")
        env = request.getfixturevalue("storage_env")
        bucket = s3_root.split("/")[2]
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
        dest = f"{s3_root}/tp2"

        def writing() -> bool:
            return bool(client.list_multipart_uploads(Bucket=bucket).get("Uploads"))
    else:
        env, dest = {}, str(tmp_path / "tp2")

        def writing() -> bool:
            return any((tmp_path / "tp2").glob(".streamctl-tmp/*/*"))

    with contextlib.ExitStack() as stack:
        if where == "s3":  # parts go up at 1 MiB/s: a loaded machine cannot finish before the Ctrl-C
            port = int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
            part_upload = lambda method, path: method == "PUT" and "partNumber=" in path  # noqa: E731
            proxy = stack.enter_context(SlowProxy(port, part_upload, "steady", rate_bps=1024 * 1024))
            env = {**env, "AWS_ENDPOINT_URL": proxy.url}
        process = subprocess.Popen(
            [sys.executable, "-m", "streamctl", "shard", str(tmp_path / "hf"), dest, "-tp", "2"],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not writing():
            assert process.poll() is None, "shard finished before it could be interrupted"
            assert time.monotonic() < deadline, "no rank file was started"
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip() == "error: interrupted"
    assert list(open_location(dest).list()) == []
    if where == "s3":
        assert not writing(), "a multipart upload was left open"
    else:
        assert not list((tmp_path / "tp2").rglob("*")), "a file was left behind"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_killed_runs_unfinished_uploads_are_discarded(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """kill -9 leaves what no process can abort: a local temporary file, or S3 multipart parts (billed).
    The next run discards those of the files it writes, and leaves other objects' uploads alone."""
    config, hf = write_model(tmp_path / "hf", "llama-gqa")
    dest = open_location(str(tmp_path / "out") if where == "local" else f"{request.getfixturevalue('s3_root')}/m")
    part_size = dest.store.min_part_size
    for name in ("model-rank-1-part-0.safetensors", "config.json", "notes/someone-elses.bin"):
        upload = dest.store.start_multipart(dest.key(name), part_size)
        upload.upload_part(0, b"x" * min(part_size, 1 << 20))  # and then the process was killed
    result = shard_checkpoint(open_location(str(tmp_path / "hf")), dest, ShardOptions(tensor_parallel_size=2))
    assert result.ok and result.discarded == ("config.json", "model-rank-1-part-0.safetensors")
    assert result.to_json()["discarded_uploads"] == list(result.discarded)
    left = dest.store.unfinished_uploads(f"{dest.prefix}/" if dest.prefix else "")
    assert [dest.relative(upload.key) for upload in left] == ["notes/someone-elses.bin"]
    if where == "local":
        assert_rank_matches(tmp_path / "out", config, hf, 2)
        hidden = sorted(path.relative_to(tmp_path / "out").as_posix() for path in (tmp_path / "out").rglob(".*/*/*"))
        assert len(hidden) == 1 and hidden[0].startswith("notes/.streamctl-tmp/")
        assert hidden[0].endswith("/someone-elses.bin")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [2, 8])
def test_a_small_buffer_never_stalls_the_writer(tmp_path: Path, tp: int) -> None:
    """Blocks read ahead hold budget until handed to the writers: with a budget of a few blocks (column
    copies and casts make blocks count double) the writer must still make progress, not wait on itself."""
    config, hf = write_model(tmp_path / "hf", "llama-mha", intermediate_size=1024)
    options = ShardOptions(tensor_parallel_size=tp, read_block=4096, max_buffer=3 * 4096, dtype="float32")
    result = shard_checkpoint(open_location(str(tmp_path / "hf")), open_location(str(tmp_path / "out")), options)
    assert result.ok
    as_f32 = {name: (array.astype(np.uint32) << 16).view(np.float32) for name, array in hf.items()}
    assert_rank_matches(tmp_path / "out", config, as_f32, tp)
