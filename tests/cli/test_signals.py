"""SIGTERM and SIGINT stop every command cleanly (streamctl.interrupts, installed by app.main).

Real `streamctl` processes get real signals while a slow link (tests/slowproxy.py in front of the fake hub or
moto) holds them mid-part or mid-request. Each must end within 10 s with exit 143 (SIGTERM) or 130 (SIGINT),
exactly one line on stderr (or, with --json, one JSON error document: "terminated" / "interrupted"), its
lease gone from DEST, nothing incomplete under a final name; and a re-run must succeed at once, without exit 7
and without --force. Before the handler, SIGTERM killed the process on the spot: no line, the lease left in
DEST (another host's re-run exits 7 for its TTL), an unfinished shard needing --force.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from checkpoints import write_hf_checkpoint
from cli_helpers import run_cli
from shard_models import write_model
from slowproxy import SlowProxy
from streamctl.checkpoint.files import MANIFEST_NAME, SHARD_MANIFEST_NAME
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.common.sizes import MiB
from streamctl.errors import NotFoundError
from streamctl.storage import open_location
from streamctl.storage.base import LEASE_NAME, Location

pytestmark = pytest.mark.timeout(180)

STOP_BOUND_S = 10.0  # what the commands promise (Kubernetes gives 30 s)
EXIT = {signal.SIGTERM: 143, signal.SIGINT: 130}
LINE = {signal.SIGTERM: "error: terminated (SIGTERM)", signal.SIGINT: "error: interrupted"}
CODE = {signal.SIGTERM: "terminated", signal.SIGINT: "interrupted"}
SIGNALS = pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])


@dataclass(frozen=True)
class Stopped:
    exit_code: int
    stdout: str
    stderr: str
    seconds: float  # from the signal to the exit


def start(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "streamctl", *args],
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until(condition: Callable[[], bool], process: subprocess.Popen[str], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the command ended before {what}: {process.communicate()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stop(process: subprocess.Popen[str], signum: int, again: int | None = None) -> Stopped:
    """Send `signum` (then `again`, a second signal during the clean-up) and wait for the exit."""
    process.send_signal(signum)
    sent = time.monotonic()
    if again is not None:
        time.sleep(0.05)
        process.send_signal(again)
    try:
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return Stopped(process.returncode, stdout, stderr, time.monotonic() - sent)


def assert_stopped_cleanly(stopped: Stopped, signum: int, json_output: bool = False) -> None:
    assert stopped.exit_code == EXIT[signum], stopped
    assert stopped.seconds < STOP_BOUND_S, stopped
    assert "Traceback" not in stopped.stderr, stopped.stderr
    assert stopped.stderr.splitlines() == [LINE[signum]], stopped.stderr
    if json_output:
        document = json.loads(stopped.stdout)
        assert document["ok"] is False and document["error"]["code"] == CODE[signum], document
        assert document["error"]["exit_code"] == EXIT[signum], document
    else:
        assert stopped.stdout == "", stopped.stdout


def names(location: Location) -> dict[str, int]:
    """Every object under the location (hidden ones included: the lease), relative, with its size."""
    if location.store.scheme == "file":
        root = Path(location.store.url(location.prefix))
        if not root.exists():
            return {}
        return {
            path.relative_to(root).as_posix(): path.stat().st_size
            for path in root.rglob("*")
            if path.is_file() and ".streamctl-tmp" not in path.parts
        }
    try:
        return {location.relative(info.key): info.size for info in location.store.list(location.key(""))}
    except NotFoundError:
        return {}


def lease_held(location: Location) -> bool:
    try:
        location.store.stat(location.key(LEASE_NAME))
    except NotFoundError:
        return False
    return True


def unfinished_uploads(location: Location) -> list[str]:
    return [location.relative(upload.key) for upload in location.store.unfinished_uploads(location.key(""))]


def dest_root(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return str(tmp_path / "out") if where == "local" else f"{request.getfixturevalue('s3_root')}/out"


@contextmanager
def slow_reads(upstream_endpoint: str, match: Callable[[str, str], bool], rate_bps: int) -> Iterator[SlowProxy]:
    with SlowProxy(int(upstream_endpoint.rsplit(":", 1)[1]), match, "steady", rate_bps=rate_bps) as proxy:
        yield proxy


HUB_SHARD_READS = lambda method, path: method == "GET" and "/resolve/" in path and ".safetensors" in path  # noqa: E731
S3_SAFETENSORS_READS = lambda method, path: method == "GET" and ".safetensors" in path and "list-type" not in path  # noqa: E731


# ---------------------------------------------------------------------------------------------------------
# transfer: mid-part on a slow source, into a local folder and into a bucket


def hub_model(fake_hub: Any) -> dict[str, bytes]:
    rng = random.Random(21)
    big = safetensors_bytes([("model.embed_tokens.weight", "U8", [11 * MiB], rng.randbytes(11 * MiB))])
    files = {"model.safetensors": big, "config.json": b'{"architectures": ["LlamaForCausalLM"]}'}
    fake_hub.add_repo("org/evicted", files)
    fake_hub.redirect_lfs = False  # every byte from the hub, i.e. through the proxy
    return files


@pytest.mark.parametrize(
    ("signum", "where", "json_output"),
    [
        (signal.SIGTERM, "local", False),
        (signal.SIGTERM, "s3", True),
        (signal.SIGINT, "local", True),
        (signal.SIGINT, "s3", False),
    ],
    ids=["SIGTERM-local", "SIGTERM-s3-json", "SIGINT-local-json", "SIGINT-s3"],
)
def test_a_signal_stops_transfer_mid_part_and_the_rerun_resumes(
    signum: int,
    where: str,
    json_output: bool,
    fake_hub: Any,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    storage_env: dict[str, str],
) -> None:
    """The source sends 5 MiB parts at 128 KiB/s (each read's deadline is ~100 s): the signal lands while
    worker threads are mid-part, and the command still ends at once, its uploads aborted, its lease gone; a
    second signal during the clean-up changes nothing. The re-run copies everything, exit 0."""
    files = hub_model(fake_hub)
    root = dest_root(where, tmp_path, request)
    env = {**storage_env} if where == "s3" else {}
    dest = open_location(root)
    with slow_reads(fake_hub.endpoint, HUB_SHARD_READS, 128 * 1024) as proxy:
        args = ["transfer", "org/evicted", root, "--part-size", "5MiB", *(["--json"] if json_output else [])]
        process = start(*args, env={**env, "HF_ENDPOINT": proxy.url})
        wait_until(lambda: proxy.hits >= 2, process, "two parts being read")
        time.sleep(0.3)
        stopped = stop(process, signum, again=signal.SIGINT if signum == signal.SIGTERM else signal.SIGTERM)
    assert_stopped_cleanly(stopped, signum, json_output)
    assert not lease_held(dest), "the lease was left in DEST"
    assert "model.safetensors" not in names(dest), "an incomplete file under its final name"
    assert unfinished_uploads(dest) == [], "uploads were left open"
    started = time.monotonic()
    rerun = run_cli("transfer", "org/evicted", root, "--json", env=env)
    assert rerun.exit_code == 0, rerun.stdout + rerun.stderr
    assert time.monotonic() - started < 60
    for name, data in files.items():
        info = dest.store.stat(dest.key(name))
        assert dest.store.read_range(dest.key(name), 0, info.size) == data, name
    assert MANIFEST_NAME in names(dest) and not lease_held(dest)


def test_a_clean_up_that_hangs_is_cut_at_the_grace(
    fake_hub: Any, s3_root: str, storage_env: dict[str, str], tmp_path: Path
) -> None:
    """The clean-up itself cannot finish (DEST answers none of the upload aborts): the command still ends,
    at STREAMCTL_STOP_GRACE_S, with the one error line saying so; what it left, a killed run's leftovers,
    the re-run discards (its lease names a process that is gone on this host)."""
    hub_model(fake_hub)
    aborts = lambda method, path: method == "DELETE" and "uploadId=" in path  # noqa: E731
    moto = storage_env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]
    with (
        slow_reads(fake_hub.endpoint, HUB_SHARD_READS, 128 * 1024) as reads,
        SlowProxy(int(moto), aborts, "silent") as dead_aborts,
    ):
        env = {**storage_env, "HF_ENDPOINT": reads.url, "AWS_ENDPOINT_URL": dead_aborts.url}
        process = start(
            "transfer", "org/evicted", s3_root, "--part-size", "5MiB", env={**env, "STREAMCTL_STOP_GRACE_S": "3"}
        )
        wait_until(lambda: reads.hits >= 1, process, "a part being read")
        time.sleep(0.3)
        stopped = stop(process, signal.SIGTERM)
    assert stopped.exit_code == 143, stopped
    assert 3.0 <= stopped.seconds < 3.0 + 4.0, stopped
    assert dead_aborts.hits >= 1, "the clean-up never reached the aborts: the test proves nothing"
    lines = stopped.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(LINE[signal.SIGTERM]), stopped.stderr
    assert "clean-up took over 3 s" in lines[0], lines[0]
    rerun = run_cli("transfer", "org/evicted", s3_root, env=storage_env)
    assert rerun.exit_code == 0, rerun.stderr


# ---------------------------------------------------------------------------------------------------------
# shard: mid-write, from a slow bucket into a folder and into a bucket


def s3_model(s3_root: str, tmp_path: Path) -> str:
    """A ~6 MB Llama on S3 (written directly, not through any proxy)."""
    write_model(tmp_path / "hf", "llama-gqa", hidden_size=256, intermediate_size=1024, vocab_size=4096)
    source = open_location(f"{s3_root}/hf")
    for path in sorted((tmp_path / "hf").rglob("*")):
        if path.is_file():
            source.store.put(source.key(path.relative_to(tmp_path / "hf").as_posix()), path.read_bytes())
    return f"{s3_root}/hf"


def writing(dest: Location) -> Callable[[], bool]:
    if dest.store.scheme == "file":
        root = Path(dest.store.url(dest.prefix))
        return lambda: any(root.glob(".streamctl-tmp/*/model-rank-*"))  # (small files go through it too)
    return lambda: bool(unfinished_uploads(dest))


@pytest.mark.parametrize(
    ("signum", "where"),
    [(signal.SIGTERM, "local"), (signal.SIGINT, "s3"), (signal.SIGTERM, "s3")],
    ids=["SIGTERM-local", "SIGINT-s3", "SIGTERM-s3"],
)
def test_a_signal_stops_shard_mid_write_and_the_rerun_needs_no_force(
    signum: int, where: str, s3_root: str, tmp_path: Path, request: pytest.FixtureRequest, storage_env: dict[str, str]
) -> None:
    """Blocks of the source come at 256 KiB/s: the signal lands mid-write. No rank file, no manifest and no
    lease are left (the run removes what it began); the re-run writes everything, without --force."""
    source = s3_model(s3_root, tmp_path)
    root = dest_root(where, tmp_path, request)
    dest = open_location(root)
    with slow_reads(storage_env["AWS_ENDPOINT_URL"], S3_SAFETENSORS_READS, 256 * 1024) as proxy:
        process = start("shard", source, root, "-tp", "2", env={**storage_env, "AWS_ENDPOINT_URL": proxy.url})
        wait_until(writing(dest), process, "a rank file being written")
        time.sleep(0.3)
        stopped = stop(process, signum)
    assert proxy.hits >= 1
    assert_stopped_cleanly(stopped, signum)
    assert names(dest) == {}, names(dest)
    assert not lease_held(dest) and unfinished_uploads(dest) == []
    rerun = run_cli("shard", source, root, "-tp", "2", "--json", env=storage_env)
    assert rerun.exit_code == 0, rerun.stdout + rerun.stderr
    assert json.loads(open_location(root).store.read_range(dest.key(SHARD_MANIFEST_NAME), 0, 10**7))["complete"]


@SIGNALS
def test_a_shard_run_stopped_over_earlier_output_is_finished_without_force(
    signum: int, s3_root: str, tmp_path: Path, storage_env: dict[str, str]
) -> None:
    """DEST holds a completed run and a file of the user's; a --force run is stopped mid-write, which leaves
    the earlier rank files and the manifest saying "complete": false (what the run replaced stays). The same
    command without --force then finishes it (before: exit 2, "pass --force"), and the user's file stays."""
    source = s3_model(s3_root, tmp_path)
    out = tmp_path / "out"
    assert run_cli("shard", source, str(out), "-tp", "2", env=storage_env).exit_code == 0
    (out / "notes.txt").write_text("mine")
    with slow_reads(storage_env["AWS_ENDPOINT_URL"], S3_SAFETENSORS_READS, 256 * 1024) as proxy:
        env = {**storage_env, "AWS_ENDPOINT_URL": proxy.url}
        process = start("shard", source, str(out), "-tp", "2", "--force", env=env)
        wait_until(writing(open_location(str(out))), process, "a rank file being written")
        stopped = stop(process, signum)
    assert_stopped_cleanly(stopped, signum)
    assert json.loads((out / SHARD_MANIFEST_NAME).read_text())["complete"] is False
    assert not (out / LEASE_NAME).exists()
    rerun = run_cli("shard", source, str(out), "-tp", "2", "--json", env=storage_env)
    assert rerun.exit_code == 0, rerun.stdout + rerun.stderr
    assert json.loads((out / SHARD_MANIFEST_NAME).read_text())["complete"] is True
    assert (out / "notes.txt").read_text() == "mine"


def test_a_killed_shard_run_is_finished_without_force_but_another_sources_is_not(
    tmp_path: Path, s3_root: str, storage_env: dict[str, str]
) -> None:
    """kill -9 leaves the "incomplete" manifest, the serving files and the lease of a process that is gone:
    the same command takes over at once, without --force. A shard of ANOTHER source into that DEST is still
    refused (exit 2, nothing touched): only the same kind of run may finish what one began."""
    source = s3_model(s3_root, tmp_path)
    out = tmp_path / "out"
    with slow_reads(storage_env["AWS_ENDPOINT_URL"], S3_SAFETENSORS_READS, 256 * 1024) as proxy:
        process = start("shard", source, str(out), "-tp", "2", env={**storage_env, "AWS_ENDPOINT_URL": proxy.url})
        wait_until(writing(open_location(str(out))), process, "a rank file being written")
        stopped = stop(process, signal.SIGKILL)
    assert stopped.exit_code == -9
    assert json.loads((out / SHARD_MANIFEST_NAME).read_text())["complete"] is False
    before = names(open_location(str(out)))
    other = tmp_path / "other"
    write_model(other, "llama-gqa", num_hidden_layers=2)
    refused = run_cli("shard", str(other), str(out), "-tp", "2", "--json")
    assert refused.exit_code == 2, refused.stdout + refused.stderr
    assert "--force" in refused.json()["error"]["hint"]
    assert names(open_location(str(out))) == before
    rerun = run_cli("shard", source, str(out), "-tp", "2", env=storage_env)
    assert rerun.exit_code == 0, rerun.stderr
    assert json.loads((out / SHARD_MANIFEST_NAME).read_text())["complete"] is True


# ---------------------------------------------------------------------------------------------------------
# verify-index and serve: stuck on a server that never answers


@pytest.mark.parametrize(
    ("command", "signum", "json_output"),
    [
        ("verify-index", signal.SIGTERM, True),
        ("verify-index", signal.SIGINT, False),
        ("serve", signal.SIGTERM, False),
        ("serve", signal.SIGINT, True),
    ],
    ids=["verify-index-SIGTERM-json", "verify-index-SIGINT", "serve-SIGTERM", "serve-SIGINT-json"],
)
def test_a_signal_stops_a_command_stuck_on_a_silent_server(
    command: str, signum: int, json_output: bool, s3_root: str, storage_servers: Any, storage_env: dict[str, str]
) -> None:
    write_hf_checkpoint(open_location(s3_root))
    port = int(storage_servers.s3().endpoint.rsplit(":", 1)[1])
    with SlowProxy(port, S3_SAFETENSORS_READS, "silent") as proxy:
        extra = ["--dry-run"] if command == "serve" else []
        process = start(
            command, s3_root, *extra, *(["--json"] if json_output else []),
            env={**storage_env, "AWS_ENDPOINT_URL": proxy.url},
        )  # fmt: skip
        wait_until(lambda: proxy.hits >= 1, process, "a read that never gets an answer")
        time.sleep(0.3)
        stopped = stop(process, signum)
    assert_stopped_cleanly(stopped, signum, json_output)
