"""The `shard --engine vllm-cpu` worker never outlives streamctl, and streamctl never waits forever on it.

A stand-in worker (standard library only, no vLLM needed) speaks the pipe protocol through the real worker's
own life-support (`vllm_protocol.start_lifeline`: PR_SET_PDEATHSIG, the parent's pid watched, heartbeats) and
stalls where a test wants it; `--vllm-python` is a script that answers the environment probe and runs the
stand-in in place of the worker module. Real `streamctl shard` processes get real signals: SIGTERM/SIGINT
are forwarded to the worker, a SIGKILLed streamctl takes it along, and a worker that stops answering
(SIGSTOP, or one that sleeps without heartbeats) is killed at STREAMCTL_DEADLINE_ENGINE_S and reported, exit
6, while a slow one that keeps sending heartbeats is never cut. Before: the parent blocked forever on a
hung worker, and a killed parent left the worker running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cli_helpers import run_cli
from shard_models import write_model
from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.storage.base import LEASE_NAME

pytestmark = pytest.mark.timeout(120)

STANDIN = r"""
import hashlib, json, os, signal, sys, threading, time
from streamctl.shard.engines.vllm_cpu.protocol import write_frame
try:
    from streamctl.shard.engines.vllm_cpu.protocol import HEARTBEAT, start_lifeline
except ImportError:  # a streamctl from before the lifeline (to see these tests fail there)
    HEARTBEAT, start_lifeline = {}, lambda send, working: None

out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
lock = threading.Lock()
state = os.environ["STANDIN_STATE"]
mode = os.environ["STANDIN_MODE"]


def note(name, text):
    with open(os.path.join(state, name), "w") as file:
        file.write(text)


def send(header, payload=None):
    with lock:
        write_frame(out, header, payload)


def on_signal(signum, frame):
    note("signal", signal.Signals(signum).name)
    os._exit(128 + signum)


note("pid", str(os.getpid()))
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
working = threading.Event()
start_lifeline(lambda: send(dict(HEARTBEAT)), working)


def stall(heartbeats):
    if not heartbeats:
        working.clear()  # a worker that hangs where no heartbeat thread runs
    note("stalled", mode)
    while True:
        time.sleep(1)


TENSORS = [{"name": "a.weight", "dtype": "BF16", "shape": [64], "layer": 0},
           {"name": "b.weight", "dtype": "BF16", "shape": [64], "layer": 0}]
for line in sys.stdin.buffer:
    working.set()
    request = json.loads(line)
    if request["op"] == "plan":
        if mode in ("stall-plan", "silent-plan"):
            stall(heartbeats=mode == "stall-plan")
        if mode == "slow-plan":
            time.sleep(float(os.environ["STANDIN_SLEEP"]))  # heartbeats go on meanwhile
        send({"type": "plan", "vllm_version": "0.33.0", "torch_version": "x", "architecture": "LlamaForCausalLM",
              "served_dtype": "BF16", "num_layers": 1, "quantization": None, "shims": [],
              "stages": [{"pp_rank": 0, "layers": [0, 1], "tensors": TENSORS}]})
    elif request["op"] == "write":
        if mode == "stall-write":
            stall(heartbeats=True)
        for name in request["stages"][0]["parts"][0]:
            data = b"\1" * 128
            send({"type": "tensor", "pp_rank": 0, "tp_rank": 0, "name": name, "dtype": "BF16", "shape": [64],
                  "nbytes": 128, "sha256": hashlib.sha256(data).hexdigest()}, data)
        send({"type": "written", "seconds": 0.1, "peak_rss_mib": 1.0, "kept_construction_value": []})
    elif request["op"] == "check":
        # As the real worker's check_rank: every sent tensor loaded back and its sha256 matched (2 x 128 bytes).
        rank = {"pp_rank": 0, "tp_rank": 0, "ok": True, "tensors": 2, "tensors_matched": 2, "bytes_matched": 256,
                "problems": [], "skipped": None}
        send({"type": "checked", "loader": "runai_streamer_sharded", "ranks": [rank], "peak_rss_mib": 1.0})
    working.clear()
"""


def standin_python(folder: Path) -> Path:
    """A `--vllm-python`: the probe sees a vllm 0.33.0 distribution; the worker module is the stand-in."""
    info = folder / "site" / "vllm-0.33.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    (folder / "standin_worker.py").write_text(STANDIN)
    python = folder / "bin" / "python"
    python.parent.mkdir()
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = "-m" ] && [ "$3" = "streamctl.shard.engines.vllm_cpu.worker" ]; then\n'
        f'  PYTHONPATH="{folder}:$PYTHONPATH" exec {sys.executable} -P -m standin_worker\n'
        "fi\n"
        f'PYTHONPATH={folder / "site"} exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return python


class Run:
    """One `streamctl shard --engine vllm-cpu` with the stand-in in `mode`."""

    def __init__(self, tmp_path: Path, mode: str, *extra: str, **env: str) -> None:
        self.tmp_path = tmp_path
        self.state = tmp_path / f"state-{mode}-{time.monotonic_ns()}"
        self.state.mkdir()
        if not (tmp_path / "hf").exists():
            write_model(tmp_path / "hf", "llama-gqa", num_hidden_layers=1)
        python = tmp_path / "standin" / "bin" / "python"
        if not python.exists():
            standin_python(tmp_path / "standin")
        self.out = tmp_path / "out"
        args = ["shard", str(tmp_path / "hf"), str(self.out), "-tp", "1", "--engine", "vllm-cpu"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "streamctl", *args, "--vllm-python", str(python), *extra],
            env={**os.environ, "STANDIN_STATE": str(self.state), "STANDIN_MODE": mode, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_for(self, name: str, timeout: float = 60) -> str:
        """A note the stand-in writes: its "pid", "stalled" once it stalls, "signal" it received."""
        deadline = time.monotonic() + timeout
        while not (self.state / name).exists():
            assert self.process.poll() is None, f"streamctl ended first: {self.process.communicate()}"
            assert time.monotonic() < deadline, f"the stand-in never wrote {name}"
            time.sleep(0.02)
        time.sleep(0.05)  # written, and closed
        return (self.state / name).read_text()

    @property
    def worker_pid(self) -> int:
        return int(self.wait_for("pid"))

    def finish(self, timeout: float = 30) -> tuple[int, str, str]:
        try:
            stdout, stderr = self.process.communicate(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        return self.process.returncode, stdout, stderr


def process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state in (b"Z", b"X")  # a zombie nobody reaped yet runs no more


def wait_gone(pid: int, timeout: float) -> float:
    started = time.monotonic()
    while not process_gone(pid):
        if time.monotonic() - started > timeout:
            os.kill(pid, signal.SIGKILL)  # do not leave it behind for the next test
            raise AssertionError(f"worker {pid} still runs {timeout} s later")
        time.sleep(0.02)
    return time.monotonic() - started


def dest_names(out: Path) -> list[str]:
    return sorted(path.relative_to(out).as_posix() for path in out.rglob("*") if path.is_file()) if out.exists() else []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_is_forwarded_to_the_worker_and_the_rerun_needs_no_force(tmp_path: Path, signum: int) -> None:
    run = Run(tmp_path, "stall-write")
    worker = run.worker_pid
    run.wait_for("stalled")  # mid-write: the lease held, the serving files and the incomplete manifest written
    assert (run.out / LEASE_NAME).exists() and (run.out / SHARD_MANIFEST_NAME).exists()
    run.process.send_signal(signum)
    sent = time.monotonic()
    code, stdout, stderr = run.finish()
    assert code == {signal.SIGTERM: 143, signal.SIGINT: 130}[signum], stderr
    assert stdout == ""
    assert time.monotonic() - sent < 10
    assert stderr.splitlines() == [
        {signal.SIGTERM: "error: terminated (SIGTERM)", signal.SIGINT: "error: interrupted"}[signum]
    ]
    assert run.wait_for("signal") == signal.Signals(signum).name, "the signal was not forwarded to the worker"
    wait_gone(worker, 5)
    assert dest_names(run.out) == [], "the run left what it began (or its lease)"
    rerun = Run(tmp_path, "ok")
    code, _, stderr = rerun.finish(60)
    assert code == 0, stderr
    assert json.loads((run.out / SHARD_MANIFEST_NAME).read_text())["complete"] is True


def test_a_sigkilled_streamctl_takes_its_worker_along(tmp_path: Path) -> None:
    """kill -9 gives streamctl no chance to stop the worker: the kernel does (PR_SET_PDEATHSIG). The DEST it
    left (incomplete manifest, the lease of a process gone from this host) is finished by the same command,
    without --force."""
    run = Run(tmp_path, "stall-write")
    worker = run.worker_pid
    run.wait_for("stalled")
    run.process.kill()
    run.finish()
    assert wait_gone(worker, 5) < 5
    assert json.loads((run.out / SHARD_MANIFEST_NAME).read_text())["complete"] is False
    rerun = Run(tmp_path, "ok")
    code, _, stderr = rerun.finish(60)
    assert code == 0, stderr


def test_a_worker_whose_parent_is_gone_before_it_asked_the_kernel_ends_itself(tmp_path: Path) -> None:
    """The parent died before the worker's prctl (or a wrapper script sits between them): the lifeline sees
    the parent's pid gone and ends the worker at once."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    standin_python(tmp_path / "standin")
    (tmp_path / "state").mkdir()
    started = time.monotonic()
    worker = subprocess.run(
        [str(tmp_path / "standin" / "bin" / "python"), "-P", "-m", "streamctl.shard.engines.vllm_cpu.worker"],
        env={**os.environ, "STANDIN_STATE": str(tmp_path / "state"), "STANDIN_MODE": "ok",
             "STREAMCTL_ENGINE_PARENT_PID": str(gone.pid)},
        stdin=subprocess.PIPE, capture_output=True, timeout=30, check=False,
    )  # fmt: skip
    assert worker.returncode == -signal.SIGKILL, worker
    assert time.monotonic() - started < 10


def _stop_worker(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


@pytest.mark.parametrize(
    ("mode", "stall", "during"),
    [
        ("stall-write", _stop_worker, "its write request (streaming the rank tensors)"),
        ("silent-plan", None, "its plan request (planning the layout)"),
    ],
    ids=["SIGSTOP-mid-write", "asleep-mid-plan"],
)
def test_a_worker_that_stops_answering_is_killed_at_its_deadline(
    tmp_path: Path, mode: str, stall: Callable[[int], None] | None, during: str
) -> None:
    run = Run(tmp_path, mode, "--json", STREAMCTL_DEADLINE_ENGINE_S="2")
    worker = run.worker_pid
    run.wait_for("stalled")
    if stall is not None:
        stall(worker)
    stalled = time.monotonic()
    code, stdout, stderr = run.finish()
    assert code == 6, stdout + stderr
    assert 1.5 < time.monotonic() - stalled < 2 + 6
    error = json.loads(stdout)["error"]
    assert error["code"] == "engine-failed", error
    assert f"stopped answering during {during}: nothing for 2 s" in error["message"], error
    assert "STREAMCTL_DEADLINE_ENGINE_S" in error["hint"], error
    wait_gone(worker, 5)
    assert not (run.out / LEASE_NAME).exists()
    assert not any(run.out.glob("model-rank-*")), dest_names(run.out)


def test_a_slow_worker_that_sends_heartbeats_is_never_cut(tmp_path: Path) -> None:
    """Its plan takes four times the deadline; the heartbeats (every deadline/4) keep it alive."""
    run = Run(tmp_path, "slow-plan", STREAMCTL_DEADLINE_ENGINE_S="1", STANDIN_SLEEP="4")
    code, _, stderr = run.finish(60)
    assert code == 0, stderr
    assert json.loads((run.out / SHARD_MANIFEST_NAME).read_text())["complete"] is True
    assert run_cli("verify-index", str(run.out), "--sharded").exit_code == 0
