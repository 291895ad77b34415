"""FIFOs, sockets, devices and folders under a file's name never block a command.

Before, a FIFO named `config.json` made `transfer`, `verify-index` and `serve --dry-run` wait forever for a
writer (open() of a FIFO blocks), and Ctrl-C did not stop them (the wait was in a worker thread). Now only
regular files are listed; every local read opens with O_NONBLOCK and checks fstat; the rest is reported.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.demo import build_demo_checkpoint
from streamctl.errors import NotFoundError, UsageError
from streamctl.storage import StorageOptions, open_location
from tiny_models import write_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)
COMMAND_TIMEOUT = 30  # run_cli raises TimeoutExpired beyond this: a regression fails, it does not hang


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[socket.socket]:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    yield server
    server.close()


def _replace_with_fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _model_with_specials(folder: Path, unix_socket: socket.socket) -> Path:
    """A demo checkpoint whose config.json is a FIFO, with a socket, a device link and a FIFO shard beside."""
    build_demo_checkpoint(open_location(str(folder)))
    _replace_with_fifo(folder / "config.json")
    os.mkfifo(folder / "extra-00001.safetensors")
    unix_socket.bind(str(folder / "tokenizer.model"))
    (folder / "generation_config.json").unlink(missing_ok=True)
    os.symlink("/dev/zero", folder / "generation_config.json")
    return folder


def _skipped(document: dict, key: str = "skipped") -> dict[str, str]:
    return {entry["path"]: entry["kind"] for entry in document[key]}


def test_transfer_skips_and_reports_fifos_sockets_and_devices(tmp_path: Path, unix_socket: socket.socket) -> None:
    source = _model_with_specials(tmp_path / "src", unix_socket)
    dest = tmp_path / "dest"

    plan = run_cli("transfer", str(source), str(dest), "--dry-run", "--json", "--all-files", timeout=COMMAND_TIMEOUT)
    assert plan.exit_code == 0, plan.stderr
    skipped = _skipped(plan.json())
    assert skipped == {
        "config.json": "fifo",
        "extra-00001.safetensors": "fifo",
        "tokenizer.model": "socket",
        "generation_config.json": "symlink-outside",
    }
    assert not {"config.json", "tokenizer.model"} & {file["path"] for file in plan.json()["files"]}

    text = run_cli("transfer", str(source), str(dest), "--dry-run", timeout=COMMAND_TIMEOUT)
    assert text.exit_code == 0 and "FIFO" in text.stdout and "unix socket" in text.stdout

    # --follow-symlinks reaches /dev/zero, which is a device, not a file: skipped, never read forever.
    followed = run_cli(
        "transfer", str(source), str(dest), "--json", "--no-verify", "--follow-symlinks", timeout=COMMAND_TIMEOUT
    )
    assert followed.exit_code == 0, followed.stderr
    assert _skipped(followed.json())["generation_config.json"] == "char-device"
    assert not (dest / "config.json").exists() and not (dest / "generation_config.json").exists()
    assert (dest / "model.safetensors.index.json").is_file()


def test_verify_index_and_serve_dry_run_finish_and_report_the_fifo(tmp_path: Path, unix_socket: socket.socket) -> None:
    source = _model_with_specials(tmp_path / "src", unix_socket)

    verify = run_cli("verify-index", str(source), "--json", timeout=COMMAND_TIMEOUT)
    findings = {(finding["code"], finding["file"]) for finding in verify.json()["findings"]}
    assert ("entry-skipped", "config.json") in findings and ("entry-skipped", "tokenizer.model") in findings
    assert any(code == "config-missing" for code, _ in findings)
    assert verify.exit_code == 1

    serve = run_cli("serve", str(source), "--dry-run", timeout=COMMAND_TIMEOUT)
    assert serve.exit_code in (0, 1, 2), serve.stderr
    assert "config.json" in serve.stdout + serve.stderr


def test_shard_does_not_block_on_a_fifo_config(tmp_path: Path) -> None:
    source = write_tiny_checkpoint(tmp_path / "hf", "llama-gqa")
    _replace_with_fifo(source / "config.json")

    result = run_cli("shard", str(source), str(tmp_path / "out"), "-tp", "1", timeout=COMMAND_TIMEOUT)

    assert result.exit_code == 3, result.stderr
    assert "config.json" in result.stderr and "FIFO" in result.stderr


def test_the_store_refuses_special_files_named_directly(tmp_path: Path, unix_socket: socket.socket) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "fifo")
    unix_socket.bind(str(root / "sock"))
    (root / "folder.json").mkdir()
    os.symlink("/dev/zero", root / "zero")
    store = open_location(str(root)).store

    for key in ("fifo", "sock"):
        with pytest.raises(UsageError, match="not a regular file"):
            store.read_range(key, 0, 10)
        with pytest.raises(UsageError, match="not a regular file"):
            store.stat(key)
    with pytest.raises(NotFoundError, match="folder"):
        store.read_range("folder.json", 0, 10)
    with pytest.raises(UsageError, match="outside"):
        store.read_range("zero", 0, 10)
    following = open_location(str(root), StorageOptions(follow_symlinks=True)).store
    with pytest.raises(UsageError, match="character device"):
        following.read_range("zero", 0, 10)
    assert [info.key for info in store.list("")] == []


def _start(arguments: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "streamctl", *arguments],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str], timeout: float) -> str:
    try:
        return process.communicate(timeout=timeout)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize(
    "command",
    [
        ["transfer", "{src}", "{dest}"],
        ["transfer", "{src}", "{dest}", "--dry-run"],
        ["verify-index", "{src}"],
        ["serve", "{src}", "--dry-run"],
    ],
    ids=["transfer", "transfer-dry-run", "verify-index", "serve-dry-run"],
)
def test_every_command_that_meets_a_fifo_finishes_by_itself(tmp_path: Path, command: list[str]) -> None:
    source = tmp_path / "src"
    build_demo_checkpoint(open_location(str(source)))
    _replace_with_fifo(source / "config.json")
    _replace_with_fifo(source / "tokenizer.json")
    process = _start([part.format(src=source, dest=tmp_path / "dest") for part in command])

    stderr = _finish(process, COMMAND_TIMEOUT)

    assert process.returncode in (0, 1), stderr  # 1: verify-index / serve's pre-flight miss config.json
    assert "Traceback" not in stderr


def test_ctrl_c_stops_a_transfer_whose_copy_met_a_fifo(tmp_path: Path) -> None:
    """The FIFO is a file the copy reads (tokenizer.json), not one the plan reads: before, a worker thread
    sat in open() for ever, and Ctrl-C left the main thread waiting for it. Now the copy never waits on
    it, and a Ctrl-C at any moment ends the run (130) or finds it done (0)."""
    source = tmp_path / "src"
    build_demo_checkpoint(open_location(str(source)))
    _replace_with_fifo(source / "tokenizer.json")
    process = _start(["transfer", str(source), str(tmp_path / "dest"), "--no-verify"])
    time.sleep(2)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)

    stderr = _finish(process, COMMAND_TIMEOUT)

    assert process.returncode in (0, 130), stderr
    assert "Traceback" not in stderr
    if process.returncode == 0:
        assert not (tmp_path / "dest" / "tokenizer.json").exists()
