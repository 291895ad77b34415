"""One writer per DEST (streamctl.dest.lease), with real `streamctl transfer` and `shard` processes against a
local folder and the three bucket servers: a second run into a DEST another run is writing is refused
(exit 7, naming the holder) and leaves no trace; a stale lease (dead process, expired heartbeat, SIGKILLed
run) is taken over; a run paused past its lease's expiry stops instead of mixing DEST.

Determinism: the first run is frozen with SIGSTOP as soon as its lease (or, on code without leases, its
first upload) appears, so "the other run is still writing" holds for as long as the test needs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from cli_helpers import run_cli
from streamctl.checkpoint.files import MANIFEST_NAME
from streamctl.checkpoint.safetensors import safetensors_bytes
from streamctl.dest.lease import Holder, LeaseSettings, acquire, hold_lease
from streamctl.errors import DestinationBusy
from streamctl.progress import NullProgress
from streamctl.storage import open_location
from streamctl.storage.base import LEASE_NAME, Location
from tiny_models import write_tiny_checkpoint

MiB = 1024 * 1024
BUSY = 7


class Notes(NullProgress):
    def __init__(self) -> None:
        self.messages: list[str] = []

    def log(self, message: str) -> None:
        self.messages.append(message)


def write_source(folder: Path, seed: int, size: int = 48 * MiB) -> dict[str, bytes]:
    """A model folder: one large safetensors file (long enough to be caught mid-copy) and small files."""
    data = bytes((seed * 31 + index) % 251 for index in range(256)) * (size // 256)
    files = {
        "model.safetensors": safetensors_bytes([("w", "U8", [len(data)], data)]),
        "config.json": json.dumps({"model": seed}).encode(),
        "tokenizer.json": json.dumps({"tokenizer": seed}).encode(),
    }
    folder.mkdir(parents=True)
    for name, body in files.items():
        (folder / name).write_bytes(body)
    return files


def contents(location: Location) -> dict[str, bytes]:
    return {location.relative(info.key): location.store.read_range(info.key, 0, info.size) for info in location.list()}


def raw_names(location: Location) -> list[str]:
    """Every object under DEST as the store lists it: the lease and temporary files included."""
    names = [location.relative(info.key) for info in location.store.list(location.key(""))]
    if location.store.scheme == "file":
        root = Path(location.store.url(location.prefix))
        names = [str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()] if root.exists() else []
    return sorted(names)


def has_lease(location: Location) -> bool:
    try:
        location.store.read_versioned(location.key(LEASE_NAME))
        return True
    except Exception:  # noqa: BLE001 - not there (yet)
        return False


def writing(location: Location) -> bool:
    """The run has started writing: its lease exists (or, without leases, an upload was started)."""
    if has_lease(location):
        return True
    return bool(uploads(location))


def uploads(location: Location) -> list[str]:
    """Unfinished uploads of model files (not the lease's own temporary file, locally)."""
    try:
        found = location.store.unfinished_uploads(location.key(""))
    except Exception:  # noqa: BLE001 - DEST not created yet
        return []
    return [upload.key for upload in found if not upload.key.endswith(LEASE_NAME)]


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "streamctl", *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def freeze_when(process: subprocess.Popen[str], condition: Callable[[], bool], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before it could be caught writing: {process.communicate()}"
        assert time.monotonic() < deadline, "the run never started writing"
        time.sleep(0.01)
    process.send_signal(signal.SIGSTOP)


def dest_url(root: str, tmp_path: Path) -> str:
    return str(tmp_path / "dest") if root == "local" else f"{root}/model"


def with_manifest(files: dict[str, bytes], dest: Location) -> dict[str, bytes]:
    got = contents(dest)
    assert MANIFEST_NAME in got
    return {**files, MANIFEST_NAME: got[MANIFEST_NAME]}


@pytest.mark.parametrize("root", ["local", "s3_root", "gs_root", "az_root"])
def test_a_second_transfer_into_a_dest_being_written_is_refused_and_dest_ends_unmixed(
    root: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = request.getfixturevalue("storage_env") if root != "local" else {}
    url = dest_url(request.getfixturevalue(root) if root != "local" else root, tmp_path)
    model_a, model_b = write_source(tmp_path / "a", 1), write_source(tmp_path / "b", 2, size=MiB)
    dest = open_location(url)
    first = start(["transfer", str(tmp_path / "a"), url, "-j", "1", "--part-size", "5MiB", "--no-verify"], env)
    try:
        freeze_when(first, lambda: writing(dest))
        before = raw_names(dest)
        for source in ("b", "a"):  # another model, and the same model again
            second = run_cli("transfer", str(tmp_path / source), url, "--no-verify", env=env)
            assert second.exit_code == BUSY, second.stderr
            line = " ".join(second.stderr.split())  # one line, which the console wraps at its width
            assert "being written by another streamctl run" in line
            assert f"on {socket.gethostname()}, pid {first.pid}, started " in line
            assert "expires at" in second.stderr
            assert raw_names(dest) == before  # it discarded nothing and wrote nothing
    finally:
        first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=180)
    assert first.returncode == 0, stderr
    assert contents(dest) == with_manifest(model_a, dest)
    assert json.loads(contents(dest)[MANIFEST_NAME])["source"].rstrip("/").endswith("/a")
    assert LEASE_NAME not in [name.rpartition("/")[2] for name in raw_names(dest)]  # released at the end
    assert model_b["config.json"] not in contents(dest).values()


@pytest.mark.parametrize("root", ["local", "s3_root"])
def test_two_transfers_started_together_never_mix_dest(
    root: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = request.getfixturevalue("storage_env") if root != "local" else {}
    url = dest_url(request.getfixturevalue(root) if root != "local" else root, tmp_path)
    models = {"a": write_source(tmp_path / "a", 1, 8 * MiB), "b": write_source(tmp_path / "b", 2, 8 * MiB)}
    runs = {
        name: start(["transfer", str(tmp_path / name), url, "--part-size", "5MiB", "--no-verify"], env)
        for name in models
    }
    results = {name: (run.communicate(timeout=180), run.returncode) for name, run in runs.items()}
    codes = sorted(code for _, code in results.values())
    winners = [name for name, (_, code) in results.items() if code == 0]
    assert len(winners) == 1, results
    # The loser was refused while the winner wrote (7), or found the winner's finished model there (2).
    assert codes[1] in (2, BUSY), results
    dest = open_location(url)
    assert contents(dest) == with_manifest(models[winners[0]], dest)


def test_a_stale_lease_of_a_dead_process_on_this_host_is_taken_over(tmp_path: Path) -> None:
    model = write_source(tmp_path / "a", 1, MiB)
    dest_folder = tmp_path / "dest"
    dest = open_location(str(dest_folder))
    dead_pid = _dead_pid()
    now = datetime.now(UTC)
    holder = _holder_here(dead_pid, now, expires=now + timedelta(hours=1))
    dest_folder.mkdir()
    dest.store.create_if_absent(dest.key(LEASE_NAME), holder.to_bytes())
    result = run_cli("transfer", str(tmp_path / "a"), str(dest_folder), "--no-verify")
    assert result.exit_code == 0, result.stderr
    assert not (dest_folder / LEASE_NAME).exists()  # taken over, then released
    assert sorted(path.name for path in dest_folder.iterdir()) == sorted([*model, MANIFEST_NAME])


def test_taking_over_a_stale_lease_says_whose_and_why(tmp_path: Path) -> None:
    dest = open_location(str(tmp_path))
    now = datetime.now(UTC)
    dead_pid = _dead_pid()
    dest.store.create_if_absent(dest.key(LEASE_NAME), _holder_here(dead_pid, now, now + timedelta(hours=1)).to_bytes())
    notes = Notes()
    lease = acquire(dest, "streamctl test", notes, LeaseSettings(ttl_s=5, heartbeat_s=1))
    try:
        assert lease.taken_over is not None and lease.taken_over.pid == dead_pid
        assert notes.messages == [
            f"took over the lease of a stale run ('streamctl transfer old' on {socket.gethostname()}, pid {dead_pid}, "
            f"started {lease.taken_over.started.isoformat(timespec='seconds')}) on {tmp_path}: "
            f"process {dead_pid} no longer runs on this host"
        ]
    finally:
        lease.release()
    assert not has_lease(dest)


def test_a_live_lease_of_another_host_is_refused_until_it_expires(tmp_path: Path) -> None:
    write_source(tmp_path / "a", 1, MiB)
    dest_folder = tmp_path / "dest"
    dest_folder.mkdir()
    dest = open_location(str(dest_folder))
    now = datetime.now(UTC)
    elsewhere = Holder("x" * 32, "gpu-node-7", 4242, "streamctl transfer hf://org/other s3://b/m", now, now,
                       now + timedelta(seconds=4))  # fmt: skip
    version = dest.store.create_if_absent(dest.key(LEASE_NAME), elsewhere.to_bytes())
    refused = run_cli("transfer", str(tmp_path / "a"), str(dest_folder), "--no-verify", "--json")
    assert refused.exit_code == BUSY
    assert "gpu-node-7, pid 4242, started" in refused.stderr
    assert sorted(path.name for path in dest_folder.iterdir()) == [LEASE_NAME]  # nothing written
    assert dest.store.read_versioned(dest.key(LEASE_NAME))[1] == version
    time.sleep(max(0.0, (elsewhere.expires - datetime.now(UTC)).total_seconds()) + 0.5)
    taken = run_cli("transfer", str(tmp_path / "a"), str(dest_folder), "--no-verify")
    assert taken.exit_code == 0, taken.stderr
    assert not has_lease(dest)


@pytest.mark.parametrize("root", ["local", "s3_root"])
def test_a_sigkilled_runs_lease_is_taken_over_and_its_uploads_discarded(
    root: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = request.getfixturevalue("storage_env") if root != "local" else {}
    url = dest_url(request.getfixturevalue(root) if root != "local" else root, tmp_path)
    model = write_source(tmp_path / "a", 1)
    dest = open_location(url)
    killed = start(["transfer", str(tmp_path / "a"), url, "-j", "1", "--part-size", "5MiB", "--no-verify"], env)
    freeze_when(killed, lambda: bool(uploads(dest)) and has_lease(dest))
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=30)
    assert has_lease(dest)
    rerun = run_cli("transfer", str(tmp_path / "a"), url, "--no-verify", "--json", env=env)
    assert rerun.exit_code == 0, rerun.stderr
    assert "model.safetensors" in rerun.json()["discarded_uploads"]
    assert contents(dest) == with_manifest(model, dest)
    assert dest.store.unfinished_uploads(dest.key("")) == []
    assert not has_lease(dest)


@pytest.mark.parametrize("root", ["local", "s3_root"])
def test_a_run_paused_past_its_lease_expiry_is_taken_over_and_stops_without_mixing(
    root: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = request.getfixturevalue("storage_env") if root != "local" else {}
    url = dest_url(request.getfixturevalue(root) if root != "local" else root, tmp_path)
    write_source(tmp_path / "a", 1)
    model_b = write_source(tmp_path / "b", 2, MiB)
    dest = open_location(url)
    short = {**env, "STREAMCTL_LEASE_TTL": "3", "STREAMCTL_LEASE_HEARTBEAT": "0.5"}
    paused = start(["transfer", str(tmp_path / "a"), url, "-j", "1", "--part-size", "5MiB", "--no-verify"], short)
    try:
        freeze_when(paused, lambda: bool(uploads(dest)) and has_lease(dest))
        time.sleep(3.5)  # its lease expires: a hung or cut-off run looks exactly like this
        taker = run_cli("transfer", str(tmp_path / "b"), url, "--no-verify", env=env)
        assert taker.exit_code == 0, taker.stderr  # a live lease would have refused it (exit 7)
    finally:
        paused.send_signal(signal.SIGCONT)
    _, stderr = paused.communicate(timeout=120)
    assert paused.returncode == BUSY, stderr
    assert "another run took over the lease" in " ".join(stderr.split())
    assert contents(dest) == with_manifest(model_b, dest)


def test_lease_lifecycle_in_the_library(any_root: str) -> None:
    """Refused while live, renewed by the heartbeat, released at the end, and gone after an exception too."""
    dest = open_location(any_root)
    fast = LeaseSettings(ttl_s=3, heartbeat_s=0.3)
    notes = Notes()
    with hold_lease(dest, "streamctl test one", notes, fast) as lease:
        first_expiry = lease.holder.expires
        with pytest.raises(DestinationBusy) as refused:
            acquire(dest, "streamctl test two", notes, fast)
        assert "'streamctl test one' on" in refused.value.message
        time.sleep(1.2)
        stored = Holder.from_bytes(dest.store.read_versioned(dest.key(LEASE_NAME))[0])
        assert stored is not None and stored.expires > first_expiry  # renewed by the heartbeat
        time.sleep(3)  # longer than the TTL: only the heartbeat keeps it live
        with pytest.raises(DestinationBusy):
            acquire(dest, "streamctl test two", notes, fast)
    assert not has_lease(dest)
    with pytest.raises(RuntimeError), hold_lease(dest, "streamctl test three", notes, fast):
        raise RuntimeError("the run failed")
    assert not has_lease(dest)
    assert notes.messages == []


def test_lease_settings_come_from_the_environment() -> None:
    assert LeaseSettings.from_environ({}) == LeaseSettings(120.0, 20.0)
    assert LeaseSettings.from_environ({"STREAMCTL_LEASE_TTL": "8"}) == LeaseSettings(8.0, 2.0)
    from streamctl.errors import UsageError

    for bad in ({"STREAMCTL_LEASE_TTL": "soon"}, {"STREAMCTL_LEASE_TTL": "5", "STREAMCTL_LEASE_HEARTBEAT": "9"}):
        with pytest.raises(UsageError):
            LeaseSettings.from_environ(bad)


@pytest.mark.parametrize("root", ["local", "s3_root"])
def test_a_second_shard_into_a_dest_being_written_is_refused(
    root: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = request.getfixturevalue("storage_env") if root != "local" else {}
    url = dest_url(request.getfixturevalue(root) if root != "local" else root, tmp_path)
    big = {"hidden_size": 256, "intermediate_size": 2048, "vocab_size": 16000, "num_hidden_layers": 4}  # ~30 MB
    write_tiny_checkpoint(tmp_path / "a", "llama-gqa", seed=1, **big)
    write_tiny_checkpoint(tmp_path / "b", "llama-gqa", seed=2)
    dest = open_location(url)
    first = start(["shard", str(tmp_path / "a"), url, "-tp", "2"], env)
    try:
        freeze_when(first, lambda: writing(dest))
        before = raw_names(dest)
        for source, tp in (("b", "2"), ("a", "1")):
            second = run_cli("shard", str(tmp_path / source), url, "-tp", tp, "--force", env=env)
            assert second.exit_code == BUSY, second.stderr
            assert f"pid {first.pid}" in second.stderr
            assert raw_names(dest) == before
    finally:
        first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    names = sorted(info.key.rpartition("/")[2] for info in dest.list())
    assert "streamctl-shard-manifest.json" in names
    ranks = {name.split("-part-")[0] for name in names if name.endswith(".safetensors")}
    assert ranks == {"model-rank-0", "model-rank-1"}  # TP 2 from the first run only
    assert not has_lease(dest)
    check = run_cli("verify-index", url, "-tp", "2", env=env)
    assert check.exit_code == 0, check.stdout + check.stderr


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _holder_here(pid: int, now: datetime, expires: datetime) -> Holder:
    from streamctl.dest.lease import _pid_namespace, _read_text

    return Holder("d" * 32, socket.gethostname(), pid, "streamctl transfer old", now - timedelta(minutes=5), now,
                  expires, _read_text("/proc/sys/kernel/random/boot_id"), _pid_namespace())  # fmt: skip


def test_a_plan_made_before_another_run_finished_is_checked_again_under_the_lease(tmp_path: Path) -> None:
    """Run A plans, run B writes another model and finishes, then A gets the lease: A must look again and
    refuse, not copy its files next to B's."""
    from streamctl.errors import UsageError
    from streamctl.transfer import TransferOptions, execute_transfer, plan_transfer

    write_source(tmp_path / "a", 1, MiB)
    model_b = write_source(tmp_path / "b", 2, MiB)
    (tmp_path / "b" / "special_tokens_map.json").write_bytes(b"{}")
    model_b["special_tokens_map.json"] = b"{}"
    source_a, source_b = open_location(str(tmp_path / "a")), open_location(str(tmp_path / "b"))
    dest = open_location(str(tmp_path / "dest"))
    stale_plan = plan_transfer(source_a, dest, source_a.url, TransferOptions())
    execute_transfer(plan_transfer(source_b, dest, source_b.url, TransferOptions()), source_b, dest)
    with pytest.raises(UsageError, match="already holds"):
        execute_transfer(stale_plan, source_a, dest)
    assert contents(dest) == with_manifest(model_b, dest)
    assert not has_lease(dest)


def test_the_vllm_engine_holds_the_lease_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--engine vllm-gpu (vLLM's save stood in for: no GPU here): refused while another run holds DEST, holds the
    lease while vLLM saves, and releases it when the save fails."""
    import subprocess as subprocess_module

    import streamctl.shard.vllm_engine as shard_module
    from streamctl.errors import UsageError
    from streamctl.shard.plan import ShardOptions

    write_tiny_checkpoint(tmp_path / "hf", "llama-gqa")
    dest = open_location(str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    calls: list[bool] = []

    def fake_vllm(command: list[str]) -> subprocess_module.CompletedProcess[str]:
        calls.append(has_lease(dest))
        return subprocess_module.CompletedProcess(command, 1, "", "CUDA out of memory")

    monkeypatch.setattr(shard_module, "check_vllm_engine_available", lambda: None)
    now = datetime.now(UTC)
    other = Holder("o" * 32, "gpu-node-2", 77, "streamctl shard x y", now, now, now + timedelta(minutes=2))
    version = dest.store.create_if_absent(dest.key(LEASE_NAME), other.to_bytes())
    options = ShardOptions(2, engine="vllm-gpu")
    with pytest.raises(DestinationBusy, match="gpu-node-2, pid 77"):
        shard_module.shard_with_vllm(open_location(str(tmp_path / "hf")), dest, options, runner=fake_vllm)
    assert calls == []  # refused before starting an engine
    dest.store.delete_if_version(dest.key(LEASE_NAME), version)
    with pytest.raises(UsageError, match="vLLM's save failed"):
        shard_module.shard_with_vllm(open_location(str(tmp_path / "hf")), dest, options, runner=fake_vllm)
    assert calls == [True]
    assert not has_lease(dest)
