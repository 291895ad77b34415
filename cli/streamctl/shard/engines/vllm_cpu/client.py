"""The parent's side of `--engine vllm-cpu`'s worker (shard/engines/vllm_cpu/worker.py, run by the vLLM environment's
Python): start it, exchange the frames of shard/engines/vllm_cpu/protocol.py, answer its "read" frames, stop it.

One worker serves any number of shard runs one after another (vLLM's import costs ~6-10 s): `start_worker`
once, pass it to each `shard_checkpoint(..., worker=...)`, `close()` at the end. A run interrupted in the
middle of a request (an error of ours, Ctrl-C, a frame that breaks the protocol) leaves unread frames in the
pipe, so the worker is killed then and cannot be used again; a stop signal (SIGINT, SIGTERM) is forwarded to
it first. Every wait on the worker has an inactivity deadline (vllm_protocol's "Neither side outlives...").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from streamctl.errors import EngineFailed, StreamctlError, UsageError
from streamctl.oserrors import mapped
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.shard.engines.vllm_cpu.protocol import (
    DEADLINE_VARIABLE,
    ERROR_KINDS,
    HEARTBEAT_VARIABLE,
    PARENT_VARIABLE,
    PROTOCOL_VERSION,
    UNSUPPORTED_VLLM,
    ProtocolError,
    engine_deadline,
    heartbeat_interval,
    payload_chunks,
    read_header,
    write_frame,
)

WORKER_MODULE = "streamctl.shard.engines.vllm_cpu.worker"
# This streamctl package (cli/streamctl in a checkout, SITE-PACKAGES/streamctl in an install): the worker imports
# its protocol, shims and wna16 modules from it, and nothing else of this environment (package_path_folder).
PACKAGE_DIR = Path(__file__).resolve().parents[3]
PACKAGE_NAME = __name__.partition(".")[0]
PATH_FOLDER_PREFIX = "streamctl-worker-path-"
STDERR_TAIL_LINES = 30  # the worker's last stderr lines, shown when it fails
STOP_TIMEOUT_S = 10.0  # how long a worker may take to exit after EOF on its stdin
FORWARD_WAIT_S = 2.0  # how long a worker may take to exit on a forwarded SIGINT/SIGTERM before it is killed
# What the worker does during each request, for the error that says it stopped answering.
DOING = {
    "plan": "planning the layout",
    "write": "streaming the rank tensors",
    "check": "loading the written ranks with vLLM's ShardedStateLoader",
}
# The worker's refusals of the input: bad usage (exit 2) with vLLM's own words; the rest are its failures.
USAGE_KINDS = frozenset({"unsupported-architecture", "bad-parallel-size", "unsupported-quantization", "bad-checkpoint"})
FINAL_TYPES = frozenset({"plan", "written", "checked", "error"})

# (file relative to SOURCE, offset, length) -> exactly those bytes, in chunks: answers a "read" frame.
ReadSource = Callable[[str, int, int], Iterable[bytes]]


def package_path_folder() -> str:
    """A new private folder (mode 0700) holding only a link to this streamctl package: the worker's first
    PYTHONPATH entry. The folder above the package is, in an install, this environment's whole site-packages:
    on the worker's path its numpy, torch... would shadow the vLLM environment's own (measured: this
    environment's numpy 2.4.6 imported in the worker instead of the vLLM environment's 2.3.5). Removed by
    `remove_path_folder` once the worker has exited (a SIGKILLed streamctl leaves it, as its other temporary
    folders: a link, nothing else). In the temporary folder, not a cache: it works where HOME is read-only."""
    with mapped(tempfile.gettempdir()):
        folder = tempfile.mkdtemp(prefix=PATH_FOLDER_PREFIX)
        try:
            os.symlink(PACKAGE_DIR, os.path.join(folder, PACKAGE_NAME), target_is_directory=True)
        except OSError:
            remove_path_folder(folder)
            raise
    return folder


def remove_path_folder(folder: str) -> None:
    """Remove what `package_path_folder` made: the link (never what it points to), then the folder."""
    try:
        os.unlink(os.path.join(folder, PACKAGE_NAME))
    except FileNotFoundError:
        pass
    except OSError:
        return  # left in the temporary folder: a link, harmless
    try:
        os.rmdir(folder)
    except OSError:
        pass


def worker_environment(base: Mapping[str, str], package_path: str, deadline_s: float | None = None) -> dict[str, str]:
    """The worker's environment: `package_path` (a folder holding this streamctl package alone:
    package_path_folder) first on its path, vLLM's CPU platform, the Hub offline (the
    parent reads every byte of a remote SOURCE; vLLM must not reach anything), and PyTorch's CPU allocator
    asking for transparent huge pages (unless the caller chose): every layer's weights and every checked
    rank are fresh memory, and faulting it in 2 MiB at a time instead of 4 KiB cut the 3.1 GB Mixtral
    bench's run from 20.3 s to 17.3 s (median of 3; the loader check from 8.9 s to 6.1 s). It also tells the
    worker this process's pid and how often to send heartbeats (vllm_protocol: a fraction of `deadline_s`)."""
    environment = dict(base)
    environment[PARENT_VARIABLE] = str(os.getpid())
    environment[HEARTBEAT_VARIABLE] = f"{heartbeat_interval(deadline_s or engine_deadline(base)):g}"
    environment.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    path = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = package_path + (os.pathsep + path if path else "")
    environment["VLLM_TARGET_DEVICE"] = "cpu"
    environment["HF_HUB_OFFLINE"] = "1"
    environment["TRANSFORMERS_OFFLINE"] = "1"
    environment["PYTHONUNBUFFERED"] = "1"
    return environment


@dataclass
class VllmWorker:
    """A running worker. `progress` and `forward_logs` belong to the run using it (each run sets them)."""

    process: subprocess.Popen[bytes]
    python: str
    progress: Progress = NULL_PROGRESS
    forward_logs: bool = False
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    busy: bool = False  # a request was sent and its final frame not read yet
    broken: str | None = None  # why the worker cannot be used any more
    path_folder: str | None = None  # its PYTHONPATH folder (package_path_folder), removed once it has exited
    deadline_s: float = field(default_factory=engine_deadline)  # silence allowed while this process waits on it
    doing: str = "starting"  # the request in progress (DOING), for the error when it stops answering
    silent: str | None = None  # what this process was waiting for when the deadline killed the worker
    _stderr_thread: threading.Thread | None = None
    _waiting: tuple[str, float] | None = None  # (for what, since when) while this process waits on the worker
    _silence: threading.Condition = field(default_factory=threading.Condition)
    _watchdog: threading.Thread | None = None

    def start_watchdog(self) -> None:
        self._watchdog = threading.Thread(target=self._watch, name="vllm-worker-deadline", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """Kill the worker once this process has waited on it for `deadline_s` without a byte (a heartbeat
        frame is a few bytes: a worker at work is never silent that long; one stopped, hung or dead is)."""
        with self._silence:
            while self.broken is None:
                if self._waiting is None:
                    self._silence.wait()
                    continue
                what, since = self._waiting
                left = since + self.deadline_s - time.monotonic()
                if left > 0:
                    self._silence.wait(left)
                    continue
                self.silent = what
                self._signal_group(signal.SIGKILL)  # the blocked read or write in the other thread ends now
                return

    @contextmanager
    def _exchange(self, what: str) -> Iterator[None]:
        """One blocking read from or write to the worker, under the inactivity deadline."""
        with self._silence:
            self._waiting = (what, time.monotonic())
            self._silence.notify()
        try:
            yield
        finally:
            with self._silence:
                self._waiting = None

    @property
    def stdin(self) -> IO[bytes]:
        assert self.process.stdin is not None
        return self.process.stdin

    @property
    def stdout(self) -> IO[bytes]:
        assert self.process.stdout is not None
        return self.process.stdout

    def request(self, header: Mapping[str, Any]) -> None:
        """Send a request ("plan", "write", "check"); its frames are then read with `receive`."""
        if self.broken is not None:
            raise EngineFailed(f"the vLLM worker cannot be used any more: {self.broken}")
        self.busy = True
        op = str(header.get("op"))
        self.doing = f"its {op} request ({DOING.get(op, op)})"
        self._send(header)

    def receive(self, read_source: ReadSource | None) -> dict[str, Any]:
        """The next frame that is not a "read" (answered here) or a "log" (shown): a "tensor" frame (its
        payload is then read with `payload`) or the request's final frame. An "error" frame raises."""
        while True:
            try:
                with self._exchange("waiting for its next frame"):
                    header = read_header(self.stdout)
            except ProtocolError as error:
                raise self.failure(str(error)) from None
            if header is None:
                raise self.failure("the vLLM worker exited in the middle of a request")
            kind = header.get("type")
            if kind == "heartbeat":
                continue  # alive and at work: the wait for the next frame starts afresh
            if kind == "read":
                self._answer_read(header, read_source)
            elif kind == "log":
                self.progress.log(str(header.get("message", "")))
            elif kind == "tensor":
                return header
            elif kind in FINAL_TYPES:
                self.busy = False
                if kind == "error":
                    raise self._error(header)
                return header
            else:
                raise self.failure(f"the vLLM worker sent a frame of unknown type {kind!r}")

    def payload(self, nbytes: int) -> Iterator[bytes]:
        """A tensor frame's payload in chunks (8 MiB at most)."""
        chunks = payload_chunks(self.stdout, nbytes)
        while True:
            try:
                with self._exchange("receiving a tensor's bytes"):
                    chunk = next(chunks)
            except StopIteration:
                return
            except ProtocolError as error:
                raise self.failure(str(error)) from None
            yield chunk

    def _answer_read(self, header: Mapping[str, Any], read_source: ReadSource | None) -> None:
        file, offset, length = header.get("file"), header.get("offset"), header.get("length")
        if read_source is None or not isinstance(file, str) or not isinstance(offset, int):
            raise self.failure(f"the vLLM worker asked for bytes it was not offered: {dict(header)}")
        if not isinstance(length, int) or offset < 0 or length < 0:
            raise self.failure(f"the vLLM worker asked for a bad byte range: {dict(header)}")
        # The header first, then the bytes as they are read: a large range is never held whole here.
        self._send({"op": "data", "nbytes": length}, streamed=True)
        sent = 0
        try:
            for chunk in read_source(file, offset, length):
                with self._exchange("sending it the source bytes it asked for"):
                    self.stdin.write(chunk)
                sent += len(chunk)
            with self._exchange("sending it the source bytes it asked for"):
                self.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            raise self.failure("the vLLM worker stopped reading the bytes it asked for") from None
        except BaseException:
            self.kill("a read it asked for failed half-way")  # the frame cannot be completed
            raise
        if sent != length:
            raise self.failure(f"answered a read of {length} bytes with {sent}")

    def _send(self, header: Mapping[str, Any], payload: bytes | None = None, *, streamed: bool = False) -> None:
        """One frame; `streamed`: only its header line, the caller writes its `nbytes` bytes after it."""
        try:
            with self._exchange("sending it a frame"):
                if streamed:
                    self.stdin.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
                    return
                write_frame(self.stdin, header, payload)
        except (BrokenPipeError, ValueError, OSError):
            raise self.failure("the vLLM worker stopped reading its requests") from None

    def _error(self, header: Mapping[str, Any]) -> StreamctlError:
        kind = str(header.get("kind", "internal"))
        message = str(header.get("message") or "no message")
        detail = header.get("detail")
        if detail and self.forward_logs:
            self.progress.log(f"vLLM worker ({kind}): {detail}")
        if kind in USAGE_KINDS:
            return UsageError(f"vLLM refused the checkpoint: {message}", code=kind)
        if kind == UNSUPPORTED_VLLM:  # the worker's start-up check (vllm_compat): the environment, not the input
            return UsageError(
                f"the vLLM environment of {self.python}: {message}",
                hint="leave out --vllm-python (streamctl builds a supported environment), or pass one with a "
                "supported vLLM (--vllm-version)",
                code="unsupported-vllm",  # UNSUPPORTED_VLLM, written out: the README's code list is read from here
            )
        what = ERROR_KINDS.get(kind, "an unknown error kind")
        return EngineFailed(f"the vLLM worker failed ({kind}: {what}): {message}", hint=self._tail_hint())

    def failure(self, what: str) -> EngineFailed:
        """The worker broke the protocol, died or went silent: it is killed, and the error names its exit and
        stderr, or what it was doing when it went silent and the deadline."""
        self.kill(what)
        if self.silent is not None:
            return EngineFailed(
                f"the vLLM worker stopped answering during {self.doing}: nothing for {self.deadline_s:g} s "
                f"while streamctl was {self.silent}, so it was killed",
                hint=(
                    f"a worker at work sends a heartbeat every {heartbeat_interval(self.deadline_s):g} s: it was "
                    f"stopped, hung or starved of CPU or memory; {DEADLINE_VARIABLE} sets the deadline in seconds "
                    f"(default {engine_deadline({}):g})" + (f"; {tail}" if (tail := self._tail_hint()) else "")
                ),
            )
        code = self.process.poll()
        exited = "" if code is None else f" (exit {code})"
        return EngineFailed(f"{what}{exited}", hint=self._tail_hint())

    def _tail_hint(self) -> str | None:
        if self._stderr_thread is not None:
            self._stderr_thread.join(timeout=2)
        lines = [line for line in self.tail if line.strip()][-5:]
        return "its last log lines: " + " | ".join(lines) if lines else None

    def _signal_group(self, signum: int) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self, why: str = "it was stopped", forward: int | None = None) -> None:
        """Kill the worker's whole process group (vLLM may have started helpers) and reap it. `forward`: the
        stop signal (SIGINT, SIGTERM) this process got, sent to the group first, SIGKILL if it lingers."""
        with self._silence:
            self.broken = self.broken or why
            self._silence.notify()  # the deadline's watchdog ends
        if forward is not None and forward != signal.SIGKILL:
            self._signal_group(forward)
            try:
                self.process.wait(timeout=FORWARD_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.process.stdin, self.process.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if self.path_folder is not None and self.process.poll() is not None:
            remove_path_folder(self.path_folder)
            self.path_folder = None

    def close(self, forward: int | None = None) -> None:
        """End the worker: EOF on its stdin (it exits 0), killed if it does not exit in time; `forward`: as for
        `kill`, when this process is being stopped by that signal."""
        if forward is not None:
            self.kill("it was stopped", forward)
            return
        if self.broken is None and self.process.poll() is None:
            try:
                self.stdin.close()
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill("it was closed")

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _drain_stderr(stream: IO[bytes], worker: VllmWorker) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        worker.tail.append(line)
        if worker.forward_logs:
            worker.progress.log(f"vllm: {line}")
    stream.close()


def start_worker(
    python: str, progress: Progress = NULL_PROGRESS, *, forward_logs: bool = False, module: str = WORKER_MODULE
) -> VllmWorker:
    """Start `python -P -m module` (`module`: the worker; tests name a hostile stand-in) in its own session,
    so that a terminal's Ctrl-C reaches streamctl alone, which then stops it (forwarding the signal). Start it
    from a thread that outlives it (the main thread): the worker dies with the thread that started it."""
    deadline_s = engine_deadline()
    path_folder = package_path_folder()
    try:
        process = subprocess.Popen(
            [python, "-P", "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=worker_environment(os.environ, path_folder, deadline_s),
            start_new_session=True,
        )
    except OSError as error:
        remove_path_folder(path_folder)
        raise UsageError(
            f"cannot run the vLLM environment's python {python}: {error.strerror or error}",
            hint="pass --vllm-python with the python of a CPU vLLM environment, or leave it out to make one",
        ) from None
    worker = VllmWorker(process, python, progress, forward_logs, deadline_s=deadline_s, path_folder=path_folder)
    worker.start_watchdog()
    _widen_pipe(worker.stdout)
    assert process.stderr is not None
    worker._stderr_thread = threading.Thread(
        target=_drain_stderr, args=(process.stderr, worker), name="vllm-worker-stderr", daemon=True
    )
    worker._stderr_thread.start()
    return worker


PIPE_SIZE = 1024 * 1024  # Linux's default limit for an unprivileged process (/proc/sys/fs/pipe-max-size)


def _widen_pipe(stream: IO[bytes]) -> None:
    """Give the tensor pipe 1 MiB instead of Linux's 64 KiB: every GB of weights then crosses in 16x fewer
    wake-ups of both processes (measured: the parent's pipe reads took about half the write phase)."""
    import fcntl

    try:
        fcntl.fcntl(stream.fileno(), fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    except (OSError, AttributeError):  # another kernel's limit, or no F_SETPIPE_SZ: the default still works
        pass


def plan_request(
    model_dir: str,
    tensors: Mapping[str, Mapping[str, Any]],
    local_root: str | None,
    tp: int,
    pp: int,
    ep: bool,
    dtype: str,
    layer_partition: str | None,
) -> dict[str, Any]:
    return {
        "op": "plan",
        "protocol": PROTOCOL_VERSION,
        "model_dir": model_dir,
        "tensors": dict(tensors),
        "local_root": local_root,
        "tp": tp,
        "pp": pp,
        "ep": ep,
        "dtype": dtype,
        "layer_partition": layer_partition,
    }
