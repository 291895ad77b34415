"""A sharded checkpoint that `shard` never completed is an error for `verify-index` and `serve`.

`shard` used to copy the tokenizer and config after the weights and write its manifest last, with nothing
before: out of space (or killed) in between, DEST held complete weights without tokenizer or manifest, and
`verify-index` and `serve` accepted them. Now the run marks DEST first (its manifest with `"complete": false`),
copies the small serving files, then the weights, and replaces the marker with the completed manifest last.
Checked against a real full file system (a small tmpfs, where mounting is allowed), a store that fails each
write in turn, and `kill -9`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import run_cli
from shard_models import write_model
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.errors import NotFoundError, RemoteError, StreamctlError
from streamctl.retry import RetryPolicy
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from streamctl.storage.base import Location
from streamctl.verify.run import verify_checkpoint

FAST_RETRY = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.02)
RANK_FILES = ("model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors")
SERVING = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def findings(folder: Path) -> set[str] | None:
    """verify-index's error codes for `folder`, or None when it finds no checkpoint at all (exit 3)."""
    try:
        report = verify_checkpoint(open_location(str(folder)))
    except NotFoundError:
        return None
    return {finding.code for finding in report.errors}


def state_after_failure(folder: Path) -> str:
    """Check what a failed run left, and name it: 'empty', 'no weights' or 'weights, incomplete'."""
    names = {path.name for path in folder.iterdir()} if folder.exists() else set()
    final = {name for name in names if not name.endswith(".streamctl-partial")}
    if not final:
        return "empty"
    assert SHARD_MANIFEST_NAME in final, final  # marked before the first byte of anything else
    assert json.loads((folder / SHARD_MANIFEST_NAME).read_text())["complete"] is False
    errors = findings(folder)
    if not any(name.endswith(".safetensors") for name in final):
        assert errors is None  # nothing to serve: verify-index finds no weights (exit 3)
        return "no weights"
    # Weights under their final names come only after every serving file, and never look servable.
    assert set(SERVING) <= final, final
    assert errors is not None and "shard-incomplete" in errors, errors
    return "weights, incomplete"


# ------------------------------------------------------------------------------------------ each write fails


class FailingWrites:
    """Wraps a store; from the Nth write on (a put, a part, or completing an upload), every write fails, as
    on a full disk (retries included)."""

    def __init__(self, inner: Any, fail_at: int | None) -> None:
        self.inner, self.fail_at, self.writes = inner, fail_at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write(self) -> None:
        self.writes += 1
        if self.fail_at is not None and self.writes >= self.fail_at:
            raise RemoteError("/dest: no space left on device")

    def put(self, key: str, data: bytes, metadata: Any = None, content_type: Any = None) -> Any:
        self.write()
        return self.inner.put(key, data, metadata, content_type)

    def start_multipart(
        self, key: str, part_size: int, metadata: Any = None, content_type: Any = None, resume: Any = None
    ) -> Any:
        upload = self.inner.start_multipart(key, part_size, metadata, content_type, resume)
        outer = self

        class Upload:
            def __getattr__(self, name: str) -> Any:
                return getattr(upload, name)

            def upload_part(self, index: int, data: bytes) -> None:
                outer.write()
                upload.upload_part(index, data)

            def complete(self, metadata: Any = None) -> Any:
                outer.write()
                return upload.complete(metadata)

            def positional_writer(self) -> None:
                return None  # parts only, so every write is counted here

        return Upload()


def failing_dest(folder: Path, fail_at: int | None) -> tuple[Location, FailingWrites]:
    dest = open_location(str(folder))
    store = FailingWrites(dest.store, fail_at)
    return Location(store, dest.prefix), store  # type: ignore[arg-type]


def test_a_failure_at_any_write_never_leaves_a_servable_incomplete_checkpoint(tmp_path: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    options = ShardOptions(tensor_parallel_size=2, max_part_size=4000, retry=FAST_RETRY)
    source = open_location(str(tmp_path / "hf"))
    dest, counting = failing_dest(tmp_path / "complete", None)
    shard_checkpoint(source, dest, options)
    assert findings(tmp_path / "complete") == set()
    states = []
    for fail_at in range(1, counting.writes + 1):
        folder = tmp_path / f"fail-{fail_at}"
        dest, _ = failing_dest(folder, fail_at)
        with pytest.raises(RemoteError, match="no space left"):
            shard_checkpoint(source, dest, options)
        states.append(state_after_failure(folder))
    # Up to the last weight file, a failing run removes what it began with (the uploads were aborted, nothing
    # is under a final name); after that, DEST stays marked incomplete until the completed manifest lands.
    empty = states.count("empty")
    assert 0 < empty < len(states) and states == ["empty"] * empty + ["weights, incomplete"] * (len(states) - empty)


# ------------------------------------------------------------------------------------------ a real full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (a real ENOSPC), where this user may mount one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0777", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the failing-store test covers it")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, free: int) -> None:
    """Leave about `free` bytes free on `disk` (whole pages)."""
    (disk / "filler").unlink(missing_ok=True)
    stats = os.statvfs(disk)
    available = stats.f_bavail * stats.f_frsize
    with open(disk / "filler", "wb") as handle:
        handle.write(b"\0" * max(0, available - free))
    os.sync()


def test_out_of_space_on_a_real_file_system(tmp_path: Path, small_disk: Path) -> None:
    write_model(tmp_path / "hf", "llama-gqa")
    source = open_location(str(tmp_path / "hf"))
    options = ShardOptions(tensor_parallel_size=2)
    fill(small_disk, 1 << 20)
    shard_checkpoint(source, open_location(str(small_disk / "ok")), options)
    needed = sum((path.stat().st_blocks * 512) for path in (small_disk / "ok").iterdir())
    subprocess.run(["rm", "-rf", str(small_disk / "ok")], check=True)
    states: dict[str, int] = {}
    page = 4096
    for free in range(0, needed + 4 * page, page):
        dest = small_disk / "out"
        fill(small_disk, free)
        try:
            shard_checkpoint(source, open_location(str(dest)), options)
        except StreamctlError as error:
            assert "no space left" in error.message, error.message
            state = state_after_failure(dest)
        else:
            assert findings(dest) == set()
            state = "complete"
        states[state] = states.get(state, 0) + 1
        if state == "weights, incomplete" and "serve" not in states:
            served = run_cli("serve", str(dest), "--dry-run", "-tp", "2")
            assert served.exit_code == 1 and "shard-incomplete" in served.stderr, served.stderr
            states["serve"] = 1
        subprocess.run(["rm", "-rf", str(dest)], check=True)
    assert {"weights, incomplete", "complete"} <= set(states), states


# ------------------------------------------------------------------------------------------ kill -9


def big_model(folder: Path) -> None:
    # ~145 MB of weights, so the run spends a while in each phase (as in test_shard's interrupt test).
    write_model(folder, "llama-gqa", hidden_size=512, intermediate_size=4096, vocab_size=32000, num_hidden_layers=4)


def kill_when(folder: Path, ready: Any, *args: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "streamctl", "shard", *args, "-tp", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not ready():
        assert process.poll() is None, "shard finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait(30)


def test_a_run_killed_after_its_weights_is_refused_by_verify_and_serve_and_finished_by_a_rerun(tmp_path: Path) -> None:
    big_model(tmp_path / "hf")
    out = tmp_path / "out"
    kill_when(out, lambda: all((out / name).exists() for name in RANK_FILES), str(tmp_path / "hf"), str(out))
    assert state_after_failure(out) == "weights, incomplete"
    verified = run_cli("verify-index", str(out), "--json")
    assert verified.exit_code == 1, verified.stderr
    codes = {finding["code"] for finding in verified.json()["findings"] if finding["severity"] == "error"}
    assert "shard-incomplete" in codes
    for args in ((), ("--sharded",)):
        served = run_cli("serve", str(out), "--dry-run", "-tp", "2", *args)
        assert served.exit_code == 1 and "shard-incomplete" in served.stderr, served.stderr
    # A run of another kind (here another TP) is refused, naming the interrupted run; the same command
    # again finishes it without --force (issue 21: an evicted pod's replacement just runs again).
    other = run_cli("shard", str(tmp_path / "hf"), str(out), "-tp", "4")
    assert other.exit_code == 2 and "interrupted shard run" in other.stderr, other.stderr
    again = run_cli("shard", str(tmp_path / "hf"), str(out), "-tp", "2")
    assert again.exit_code == 0, again.stderr
    assert findings(out) == set()
    assert json.loads((out / SHARD_MANIFEST_NAME).read_text())["complete"] is True
    assert run_cli("serve", str(out), "--dry-run", "-tp", "2").exit_code == 0


def test_a_run_killed_in_its_weights_leaves_nothing_to_serve(tmp_path: Path) -> None:
    big_model(tmp_path / "hf")
    out = tmp_path / "out"
    # Once the serving files are in place, the run is on to the weights (which take a while here).
    kill_when(out, lambda: all((out / name).exists() for name in SERVING), str(tmp_path / "hf"), str(out))
    assert state_after_failure(out) == "no weights"
    assert run_cli("serve", str(out), "--dry-run", "-tp", "2").exit_code == 3
    # The manifest names what the run was writing, so --force knows it for sure.
    marker = json.loads((out / SHARD_MANIFEST_NAME).read_text())
    assert set(RANK_FILES) | set(SERVING) <= set(marker["planned"])
    assert marker["tensor_parallel_size"] == 2 and marker["pattern"] == "model-rank-{rank}-part-{part}.safetensors"


# ------------------------------------------------------------------------------------------ what the manifest says


def test_the_manifest_decides_on_a_bucket_too(tmp_path: Path, s3_root: str, storage_env: dict[str, str]) -> None:
    """In a bucket as locally: "complete": false or an unreadable manifest is refused; a manifest of an
    earlier version (no "complete" key, written only at the end) is a completed run."""
    write_model(tmp_path / "hf", "llama-gqa")
    dest = f"{s3_root}/tp2"
    assert run_cli("shard", str(tmp_path / "hf"), dest, "-tp", "2", env=storage_env).exit_code == 0
    location = open_location(dest)
    key = location.key(SHARD_MANIFEST_NAME)
    completed = json.loads(location.store.read_range(key, 0, location.store.stat(key).size))
    assert completed["complete"] is True
    earlier = {name: value for name, value in completed.items() if name != "complete"}
    for body, refused in (
        (json.dumps(earlier).encode(), False),
        (json.dumps({**completed, "complete": False}).encode(), True),
        (b'{"complete": tr', True),
    ):
        location.store.put(key, body)
        verified = run_cli("verify-index", dest, "--json", env=storage_env)
        codes = {finding["code"] for finding in verified.json()["findings"]}
        assert ("shard-incomplete" in codes) is refused and verified.exit_code == (1 if refused else 0), body
        served = run_cli("serve", dest, "--dry-run", "-tp", "2", env=storage_env)
        assert served.exit_code == (1 if refused else 0), served.stderr
