"""Symbolic links in a local SOURCE are reported and followed only inside it (unless
--follow-symlinks); nothing is ever written through a link inside a local DEST.

Before: a link to a file outside SOURCE was copied silently, a linked folder was skipped silently, and a
linked sub-folder of DEST made writes (and deletes) land outside DEST.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.demo import build_demo_checkpoint
from streamctl.errors import UsageError
from streamctl.storage import StorageOptions, open_location

TEMPORARY_FOLDER = ".streamctl-tmp"  # storage/base.py TEMPORARY_FOLDER

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 60


@pytest.fixture
def linked_source(tmp_path: Path) -> Path:
    """A source folder with every kind of link: to a file and a folder inside it and outside it, a loop,
    a dangling link and a link to itself."""
    source, outside = tmp_path / "src", tmp_path / "outside"
    (source / "sub").mkdir(parents=True)
    outside.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}')
    (source / "sub" / "inner.json").write_text('{"inner": 1}')
    (outside / "secret.json").write_text('{"outside": true}')
    (outside / "folder").mkdir()
    (outside / "folder" / "far.json").write_text("{}")
    os.symlink("config.json", source / "alias.json")  # inside: followed
    os.symlink("sub", source / "linked-sub")  # a folder inside: followed
    os.symlink(outside / "secret.json", source / "leak.json")  # outside: reported, not copied
    os.symlink(outside / "folder", source / "far")  # a folder outside
    os.symlink(".", source / "sub" / "loop")  # a loop
    os.symlink("nowhere.json", source / "dangling.json")
    os.symlink("self.json", source / "self.json")  # ELOOP
    return source


def test_transfer_plan_reports_every_link_and_follows_only_those_inside(linked_source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    plan = run_cli("transfer", str(linked_source), str(dest), "--all-files", "--dry-run", "--json", timeout=TIMEOUT)
    assert plan.exit_code == 0, plan.stderr
    document = plan.json()
    files = {file["path"] for file in document["files"]}
    assert files == {"config.json", "alias.json", "sub/inner.json", "linked-sub/inner.json"}
    skipped = {entry["path"]: entry["kind"] for entry in document["skipped"]}
    assert skipped == {
        "leak.json": "symlink-outside",
        "far": "symlink-outside",
        "sub/loop": "symlink-loop",
        "linked-sub/loop": "symlink-loop",
        "dangling.json": "symlink-dangling",
        "self.json": "symlink-loop",
    }
    followed = {entry["path"]: entry["target"] for entry in document["symlinks"]}
    assert followed == {
        "alias.json": str(linked_source / "config.json"),
        "linked-sub": str(linked_source / "sub"),
    }

    text = run_cli("transfer", str(linked_source), str(dest), "--all-files", "--dry-run", timeout=TIMEOUT)
    assert text.exit_code == 0 and "leak.json" in text.stdout and "--follow-symlinks" in text.stdout

    done = run_cli("transfer", str(linked_source), str(dest), "--all-files", "--json", "--no-verify", timeout=TIMEOUT)
    assert done.exit_code == 0, done.stderr
    assert not (dest / "leak.json").exists() and not (dest / "far").exists()
    assert (dest / "linked-sub" / "inner.json").read_text() == '{"inner": 1}'
    assert not (dest / "alias.json").is_symlink() and (dest / "alias.json").read_text() == '{"model_type": "llama"}'
    assert {entry["path"] for entry in done.json()["skipped"]} == set(skipped)


def test_follow_symlinks_copies_links_that_lead_outside(linked_source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    result = run_cli(
        "transfer",
        str(linked_source),
        str(dest),
        "--all-files",
        "--follow-symlinks",
        "--json",
        "--no-verify",
        timeout=TIMEOUT,
    )
    assert result.exit_code == 0, result.stderr
    assert (dest / "leak.json").read_text() == '{"outside": true}'
    assert (dest / "far" / "far.json").read_text() == "{}"
    skipped = {entry["path"]: entry["kind"] for entry in result.json()["skipped"]}
    assert skipped.get("dangling.json") == "symlink-dangling" and skipped.get("self.json") == "symlink-loop"


def test_reading_a_key_through_an_outside_link_is_refused_unless_asked(linked_source: Path) -> None:
    store = open_location(str(linked_source)).store
    with pytest.raises(UsageError, match="outside"):
        store.read_range("leak.json", 0, 100)
    with pytest.raises(UsageError, match="outside"):
        store.stat("far/far.json")
    assert store.read_range("alias.json", 0, 100) == b'{"model_type": "llama"}'
    following = open_location(str(linked_source), StorageOptions(follow_symlinks=True)).store
    assert following.read_range("leak.json", 0, 100) == b'{"outside": true}'


def test_a_linked_subfolder_in_dest_is_never_written_through(tmp_path: Path) -> None:
    source, dest, elsewhere = tmp_path / "src", tmp_path / "dest", tmp_path / "elsewhere"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "x.json").write_text("{}")
    dest.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, dest / "sub")

    result = run_cli("transfer", str(source), str(dest), "--all-files", timeout=TIMEOUT)

    assert result.exit_code == 2, result.stderr
    assert "symbolic link" in result.stderr and str(dest / "sub") in result.stderr
    assert list(elsewhere.iterdir()) == []


def test_the_store_never_writes_or_deletes_through_a_link_below_its_root(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    (root / "real").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "victim.bin").write_bytes(b"keep me")
    (elsewhere / "target.bin").write_bytes(b"keep me too")
    os.symlink(elsewhere, root / "linked")
    os.symlink(elsewhere, root / "real" / "deeper")
    os.symlink(elsewhere / "target.bin", root / "final.bin")
    store = open_location(str(root)).store

    for key in ("linked/new.bin", "real/deeper/new.bin", "linked/victim.bin"):
        with pytest.raises(UsageError, match="symbolic link"):
            store.put(key, b"data")
        with pytest.raises(UsageError, match="symbolic link"):
            store.start_multipart(key, 1024)
    with pytest.raises(UsageError, match="symbolic link"):
        store.delete("linked/victim.bin")
    assert sorted(path.name for path in elsewhere.iterdir()) == ["target.bin", "victim.bin"]
    assert (elsewhere / "victim.bin").read_bytes() == b"keep me"

    # A link at the final name is replaced by the new file, never written through.
    store.put("final.bin", b"new bytes")
    assert not (root / "final.bin").is_symlink() and (root / "final.bin").read_bytes() == b"new bytes"
    assert (elsewhere / "target.bin").read_bytes() == b"keep me too"
    assert not any(TEMPORARY_FOLDER in path.parts for path in root.rglob("*"))


def test_a_dest_that_is_itself_a_link_is_written_into(tmp_path: Path) -> None:
    source, real_dest, link = tmp_path / "src", tmp_path / "real-dest", tmp_path / "dest-link"
    source.mkdir()
    (source / "config.json").write_text("{}")
    real_dest.mkdir()
    os.symlink(real_dest, link)

    result = run_cli("transfer", str(source), str(link), "--no-verify", timeout=TIMEOUT)

    assert result.exit_code == 0, result.stderr
    assert (real_dest / "config.json").read_text() == "{}"


def test_verify_index_and_shard_report_links_they_do_not_follow(tmp_path: Path) -> None:
    model, outside = tmp_path / "model", tmp_path / "outside"
    build_demo_checkpoint(open_location(str(model)))
    outside.mkdir()
    (model / "tokenizer.json").rename(outside / "tokenizer.json")
    os.symlink(outside / "tokenizer.json", model / "tokenizer.json")
    os.symlink(model, model / "loop")

    verify = run_cli("verify-index", str(model), "--json", timeout=TIMEOUT)
    findings = {(finding["code"], finding["file"]) for finding in verify.json()["findings"]}
    assert ("entry-skipped", "tokenizer.json") in findings and ("entry-skipped", "loop") in findings
    followed = run_cli("verify-index", str(model), "--json", "--follow-symlinks", timeout=TIMEOUT)
    assert ("entry-skipped", "tokenizer.json") not in {
        (finding["code"], finding["file"]) for finding in followed.json()["findings"]
    }


def test_shard_reports_source_links_and_follows_them_on_request(tmp_path: Path) -> None:
    from tiny_models import write_tiny_checkpoint

    source, outside = write_tiny_checkpoint(tmp_path / "hf", "llama-gqa"), tmp_path / "outside"
    outside.mkdir()
    (outside / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    os.symlink(outside / "tokenizer.json", source / "tokenizer.json")

    plain = run_cli("shard", str(source), str(tmp_path / "out"), "-tp", "1", "--json", timeout=TIMEOUT)
    assert plain.exit_code == 0, plain.stderr
    assert {entry["path"]: entry["kind"] for entry in plain.json()["skipped"]} == {"tokenizer.json": "symlink-outside"}
    assert not (tmp_path / "out" / "tokenizer.json").exists()

    followed = run_cli(
        "shard", str(source), str(tmp_path / "out2"), "-tp", "1", "--json", "--follow-symlinks", timeout=TIMEOUT
    )
    assert followed.exit_code == 0, followed.stderr
    assert (tmp_path / "out2" / "tokenizer.json").read_text() == json.dumps({"version": "1.0"})
    assert [entry["path"] for entry in followed.json()["symlinks"]] == ["tokenizer.json"]
