"""SOURCE and DEST are compared by real location, and `--force` removes only what streamctl wrote.

`shard SRC LINK --force` with LINK a symlink to SRC used to delete the source's shards and index, because
the check compared URL strings. Every alias of one place (symlinks, bind mounts, file:// against a plain path,
trailing slashes, `..`) and every nesting (DEST inside SOURCE, SOURCE inside DEST) is refused with exit 2
before anything is written, for `transfer` and `shard` (both engines), on folders and on buckets.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from shard_models import write_model
from streamctl.checkpoint.files import MANIFEST_NAME, SHARD_MANIFEST_NAME
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.dest.overlap import check_disjoint, relation
from streamctl.errors import UsageError
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.shard.vllm_engine import shard_with_vllm
from streamctl.storage import StorageOptions, open_location


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path (following nothing: links are files here)."""
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


# ------------------------------------------------------------------------------------------ the relation


def local_aliases(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A source folder and URLs that all name it (or a place inside or around it)."""
    source = tmp_path / "models" / "src"
    source.mkdir(parents=True)
    (tmp_path / "link").symlink_to(source, target_is_directory=True)
    (tmp_path / "parent-link").symlink_to(tmp_path / "models", target_is_directory=True)
    return source, {
        "symlink": str(tmp_path / "link"),
        "symlink/": str(tmp_path / "link") + "/",
        "file://": f"file://{source}",
        "file:// of the symlink": f"file://{tmp_path / 'link'}",
        "trailing slash": f"{source}/",
        "dot-dot": str(tmp_path / "models" / "other" / ".." / "src"),
        "through a linked parent": str(tmp_path / "parent-link" / "src"),
    }


def test_every_alias_of_a_local_folder_is_the_same_location(tmp_path: Path) -> None:
    source, aliases = local_aliases(tmp_path)
    for what, url in aliases.items():
        assert relation(open_location(url), open_location(str(source))) == "same", what


def test_nesting_is_found_through_aliases_and_siblings_are_not(tmp_path: Path) -> None:
    source, _aliases = local_aliases(tmp_path)
    src = open_location(str(source))
    assert relation(open_location(str(tmp_path / "link" / "tp2")), src) == "inside"
    assert relation(open_location(f"file://{tmp_path}/parent-link/src/a/b"), src) == "inside"
    assert relation(open_location(str(tmp_path / "parent-link")), src) == "contains"
    assert relation(open_location(str(tmp_path)), src) == "contains"
    # A name that merely starts like SOURCE is a sibling.
    assert relation(open_location(str(source) + "2"), src) is None
    assert relation(open_location(str(tmp_path / "models" / "sr")), src) is None
    assert relation(open_location(str(tmp_path / "models" / "other")), src) is None


def test_a_bind_mount_of_the_source_is_the_same_location(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(source), str(mirror)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"bind mounts need privileges here: {mounted.stderr.strip()}")
    try:
        assert os.path.realpath(mirror) != os.path.realpath(source)  # the paths cannot tell them apart
        assert relation(open_location(str(mirror)), open_location(str(source))) == "same"
        assert relation(open_location(str(mirror / "sub" / "new")), open_location(str(source))) == "inside"
        assert relation(open_location(str(source / "sub")), open_location(str(mirror))) == "inside"
        assert relation(open_location(str(tmp_path)), open_location(str(mirror / "sub"))) == "contains"
    finally:
        subprocess.run(["umount", str(mirror)], check=True)


def test_bucket_prefixes_compare_by_segments_endpoint_and_account() -> None:
    def s3(url: str, endpoint: str | None = "http://127.0.0.1:9") -> Any:
        return open_location(url, StorageOptions(endpoint_url=endpoint))

    assert relation(s3("s3://bucket/a/b/"), s3("s3://bucket/a/b")) == "same"
    assert relation(s3("s3://bucket/a/b/c"), s3("s3://bucket/a/b")) == "inside"
    assert relation(s3("s3://bucket/a"), s3("s3://bucket/a/b")) == "contains"
    assert relation(s3("s3://bucket"), s3("s3://bucket/a/b")) == "contains"
    assert relation(s3("s3://bucket/a/bc"), s3("s3://bucket/a/b")) is None
    assert relation(s3("s3://bucket/a/b"), s3("s3://bucket/a/bc")) is None
    assert relation(s3("s3://bucket/a"), s3("s3://bucket2/a")) is None
    assert relation(s3("s3://bucket/a"), s3("s3://bucket/a", "http://127.0.0.1:10")) is None  # another store
    assert relation(s3("s3://bucket/a"), s3("s3://bucket/a", "HTTP://127.0.0.1:9/")) == "same"
    assert relation(open_location("gs://bucket/m"), open_location("gcs://bucket/m/")) == "same"
    assert relation(open_location("gs://bucket/m"), s3("s3://bucket/m")) is None
    one = "https://accountone.blob.core.windows.net/models/m"
    two = "https://accounttwo.blob.core.windows.net/models/m"
    assert relation(open_location(one + "/x"), open_location(one)) == "inside"
    assert relation(open_location(one), open_location(two)) is None
    assert relation(open_location(str(Path("/tmp/bucket/m"))), open_location("gs://bucket/m")) is None


def test_the_refusal_names_both_locations(tmp_path: Path) -> None:
    source, aliases = local_aliases(tmp_path)
    with pytest.raises(UsageError) as refused:
        check_disjoint(open_location(str(source)), open_location(aliases["symlink"]))
    assert str(source) in refused.value.message and aliases["symlink"] in refused.value.message
    assert refused.value.exit_code == 2


# ------------------------------------------------------------------------------------------ the commands


def test_shard_into_a_symlink_to_the_source_with_force_deletes_nothing(tmp_path: Path) -> None:
    """The reported case: `shard SRC LINK --force` deleted the source's shards and index."""
    write_model(tmp_path / "hf", "llama-gqa")
    before = snapshot(tmp_path / "hf")
    (tmp_path / "link").symlink_to(tmp_path / "hf", target_is_directory=True)
    for dest in (tmp_path / "link", f"file://{tmp_path}/link/", tmp_path / "hf" / "tp2", tmp_path):
        result = run_cli("shard", str(tmp_path / "hf"), str(dest), "-tp", "2", "--force")
        assert result.exit_code == 2, (dest, result.stderr)
        assert "SOURCE" in result.stderr and str(tmp_path / "hf") in result.stderr, result.stderr
        assert snapshot(tmp_path / "hf") == before, dest
    assert not (tmp_path / "hf" / "tp2").exists()


def test_shard_with_the_vllm_engine_refuses_an_alias_before_starting_vllm(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    (tmp_path / "link").symlink_to(tmp_path / "hf", target_is_directory=True)
    before = snapshot(tmp_path / "hf")

    def runner(command: list[str]) -> Any:
        raise AssertionError("vLLM must not be started")

    with pytest.raises(UsageError, match="is the same location as SOURCE"):
        shard_with_vllm(
            open_location(str(tmp_path / "hf")),
            open_location(str(tmp_path / "link")),
            ShardOptions(tensor_parallel_size=2, engine="vllm-gpu", force=True),
            runner=runner,
        )
    assert snapshot(tmp_path / "hf") == before


def test_transfer_into_an_alias_or_a_nested_folder_is_refused(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    before = snapshot(tmp_path / "hf")
    (tmp_path / "link").symlink_to(tmp_path / "hf", target_is_directory=True)
    for dest in (tmp_path / "link", tmp_path / "hf" / "copy", tmp_path):
        for extra in ((), ("--force",), ("--dry-run", "--json")):
            result = run_cli("transfer", str(tmp_path / "hf"), str(dest), *extra)
            assert result.exit_code == 2, (dest, extra, result.stderr)
            assert "SOURCE" in result.stderr, result.stderr
    assert snapshot(tmp_path / "hf") == before


def test_transfer_between_nested_bucket_prefixes_is_refused(
    tmp_path: Path, s3_root: str, storage_env: dict[str, str]
) -> None:
    write_model(tmp_path / "hf", "llama-gqa", extra_files=False)
    assert run_cli("transfer", str(tmp_path / "hf"), f"{s3_root}/m", "--no-verify", env=storage_env).exit_code == 0
    held = sorted(info.key for info in open_location(f"{s3_root}/m").list())
    for dest in (f"{s3_root}/m/", f"{s3_root}/m/copy", s3_root):
        result = run_cli("transfer", f"{s3_root}/m", dest, "--force", env=storage_env)
        assert result.exit_code == 2, (dest, result.stderr)
    assert sorted(info.key for info in open_location(f"{s3_root}/m").list()) == held
    # A sibling whose name starts the same is another place.
    result = run_cli("transfer", f"{s3_root}/m", f"{s3_root}/m2", "--no-verify", env=storage_env)
    assert result.exit_code == 0, result.stderr


# ------------------------------------------------------------------------------------------ what --force removes


def test_shard_force_leaves_files_streamctl_did_not_write(tmp_path: Path) -> None:
    """A DEST holding someone's own weights and index: --force writes next to them and removes none."""
    write_model(tmp_path / "hf", "llama-gqa")
    out = tmp_path / "out"
    write_model(out / "unused", "llama-gqa", files=1, extra_files=False)
    for name in ("model-00001-of-00001.safetensors", "model.safetensors.index.json"):
        (out / "unused" / name).rename(out / name)
    (out / "notes.txt").write_text("mine")
    theirs = snapshot(out)
    result = shard_checkpoint(open_location(str(tmp_path / "hf")), open_location(str(out)), ShardOptions(2, force=True))
    assert result.removed == ()
    assert {path: digest for path, digest in snapshot(out).items() if path in theirs} == theirs
    left = {item["path"]: item["reason"] for item in result.to_json()["left_alone"]}
    assert left["model-00001-of-00001.safetensors"] == "not written by streamctl"
    assert left["notes.txt"] == "not written by streamctl"
    assert "unused/config.json" in left


def test_shard_force_removes_what_a_manifest_names_and_its_own_pattern(tmp_path: Path) -> None:
    """Files a transfer manifest names, and rank files of this run's pattern an interrupted run left."""
    write_model(tmp_path / "hf", "llama-gqa")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old weights")
    (out / "model-rank-5-part-0.safetensors").write_bytes(b"an interrupted run's rank 5")
    keep = safetensors_bytes([("someone.else", "BF16", (1,), b"\0\0")])  # not named by the manifest
    (out / "keep.safetensors").write_bytes(keep)
    manifest = {"tool": "streamctl", "source": "hf://org/old", "files": [{"path": "model.safetensors"}]}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    result = shard_checkpoint(open_location(str(tmp_path / "hf")), open_location(str(out)), ShardOptions(2, force=True))
    assert set(result.removed) == {MANIFEST_NAME, "model-rank-5-part-0.safetensors", "model.safetensors"}
    assert (out / "keep.safetensors").read_bytes() == keep
    assert not (out / "model.safetensors").exists() and not (out / "model-rank-5-part-0.safetensors").exists()


def test_the_hint_about_a_stopped_run_appears_only_for_one(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    # A folder holding a Hugging Face checkpoint (config.json included) is not an interrupted shard run.
    write_model(tmp_path / "other-model", "llama-gqa", files=1)
    result = run_cli("shard", str(tmp_path / "hf"), str(tmp_path / "other-model"), "-tp", "2")
    assert result.exit_code == 2 and "already holds" in result.stderr
    assert "interrupted shard run" not in result.stderr, result.stderr
    # Rank files of our pattern and no manifest: that is one.
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    (ranks / "model-rank-0-part-0.safetensors").write_bytes(b"x")
    result = run_cli("shard", str(tmp_path / "hf"), str(ranks), "-tp", "2")
    assert result.exit_code == 2 and "interrupted shard run" in result.stderr, result.stderr
    # So is a DEST whose shard manifest says the run never completed, whatever it holds.
    marked = tmp_path / "marked"
    marked.mkdir()
    (marked / "config.json").write_text("{}")
    (marked / SHARD_MANIFEST_NAME).write_text(json.dumps({"tool": "streamctl", "complete": False}))
    result = run_cli("shard", str(tmp_path / "hf"), str(marked), "-tp", "2")
    assert result.exit_code == 2 and "interrupted shard run" in result.stderr, result.stderr
    # A completed run is not.
    assert run_cli("shard", str(tmp_path / "hf"), str(tmp_path / "done"), "-tp", "2").exit_code == 0
    # (The same plan again skips what is already right; another plan into it is refused, without the hint.)
    assert run_cli("shard", str(tmp_path / "hf"), str(tmp_path / "done"), "-tp", "2").exit_code == 0
    result = run_cli("shard", str(tmp_path / "hf"), str(tmp_path / "done"), "-tp", "1")
    assert result.exit_code == 2 and "already holds" in result.stderr, result.stderr
    assert "interrupted shard run" not in result.stderr, result.stderr


def test_force_never_removes_a_source_file_through_a_link_in_dest(tmp_path: Path) -> None:
    """A DEST file an old manifest names, that is a link to a file the run reads: only the link goes."""
    write_model(tmp_path / "hf", "llama-gqa")
    before = snapshot(tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.safetensors").symlink_to(tmp_path / "hf" / "model-00001-of-00002.safetensors")
    (out / "config.json").symlink_to(tmp_path / "hf" / "config.json")
    manifest = {"tool": "streamctl", "files": [{"path": "old.safetensors"}, {"path": "config.json"}]}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    result = shard_checkpoint(open_location(str(tmp_path / "hf")), open_location(str(out)), ShardOptions(2, force=True))
    assert "old.safetensors" in result.removed and not (out / "old.safetensors").is_symlink()
    assert snapshot(tmp_path / "hf") == before
