"""The pipe protocol between `shard --engine vllm-cpu` (the parent: streamctl's own Python) and its worker
(shard/engines/vllm_cpu/worker.py, run by the vLLM environment's Python). Standard library only: both sides import it
(the worker runs as `VLLM_PYTHON -P -m streamctl.shard.engines.vllm_cpu.worker` with a folder holding this streamctl
package alone on PYTHONPATH: shard/engines/vllm_cpu/client.py's package_path_folder).

Every message is a FRAME: one JSON object on one line (UTF-8, ending in b"\\n"), then exactly `nbytes` raw
bytes when the object has a positive "nbytes" field. The parent writes frames to the worker's stdin; the worker
writes frames to its stdout (vLLM's own prints go to stderr: the worker moves fd 1 there first).

parent -> worker ("op"):
  plan     {"op": "plan", "protocol": PROTOCOL_VERSION, "model_dir", "tensors", "local_root", "tp", "pp",
            "ep", "dtype", "layer_partition"}
           model_dir: a local folder with config.json and the other small files vLLM's ModelConfig reads;
           tensors: {hf_name: {"file": path relative to the source, "dtype": "BF16", "shape": [...],
                     "offset": absolute byte offset in the file, "nbytes": n}}  (the parent read the headers);
           local_root: the source folder when it is local (the worker memory-maps the files itself), else
                     null (the worker asks for every byte range it needs with "read" frames).
           -> one "plan" frame (or "error").
  write    {"op": "write", "stages": [{"pp_rank": p, "parts": [[name, ...], ...]}]}
           the parts to write, each part's names in FILE order (the order the parent's header lays them out);
           parts a re-run reuses are simply left out.
           -> "tensor" frames, then one "written" frame (or "error").
  check    {"op": "check", "dest_dir", "pattern"}
           vLLM's own ShardedStateLoader loads each written rank (local DEST only) and every loaded tensor's
           sha256 must equal what the write sent; a tensor at a time, so every rank is loaded, of any size.
           -> one "checked" frame (or "error").
  data     {"op": "data", "nbytes": n} + n bytes: ONLY as the answer to a "read" frame, exactly `length` bytes.
  EOF on stdin: the worker exits 0.
  One worker serves any number of plan/write/check sequences, one model after another (vLLM is imported
  and initialised once per process, ~6 s): each "plan" starts afresh; "write" and "check" refer to the last plan.

worker -> parent ("type"):
  read     {"type": "read", "file", "offset", "length"}: the parent answers with one "data" frame at once.
  log      {"type": "log", "message"}: one line for the user (progress), not an error.
  plan     {"type": "plan", "vllm_version", "torch_version", "architecture" (vLLM's class), "served_dtype"
            ("BF16", ...), "num_layers", "layerwise" (false: no pipeline stages, each rank built whole),
            "quantization" (method or null), "shims": [build-only stand-ins used],
            "stages": [{"pp_rank", "layers": [first, end), "tensors": [{"name", "dtype", "shape", "layer",
            "rank_shapes" (only where the TP ranks differ: every rank's shape, rank 0 first; expert parallelism
            over experts it does not divide)}]}]}
           each stage's tensors in state-dict order after ShardedStateLoader._filter_subtensors, the same for
           every TP rank of the stage; "layer" is the pseudo stage that produces the tensor (a decoder layer
           index, or the first/last layer for embeddings, vision tower, norm and head).
  tensor   {"type": "tensor", "pp_rank", "tp_rank", "name", "dtype", "shape", "nbytes", "sha256"} + raw bytes
           (C order, little-endian, exactly as a safetensors file holds them). Order: stage by stage, part by
           part; within a part, the worker may interleave TP ranks, but each (pp_rank, tp_rank) receives its
           part's names in exactly the order the write request listed them.
  written  {"type": "written", "seconds", "peak_rss_mib", "kept_construction_value": [names], "phases": {step: s}}
  checked  {"type": "checked", "loader": "runai_streamer_sharded", "ranks": [{"pp_rank", "tp_rank", "ok",
            "tensors" (hashed against the written bytes), "problems": [...], "rss_before_mib", "rss_peak_mib"
            (the worker's resident memory before the rank's load, and its largest right after a copy)}],
            "peak_rss_mib"}
  error    {"type": "error", "kind": one of ERROR_KINDS, "message": one line (vLLM's own words where it
            refused), "detail": the traceback's last lines}
  heartbeat {"type": "heartbeat"}: the worker is alive and at work; it carries nothing (see below).

Neither side outlives or waits forever on the other:
  - the parent gives every wait on the worker (the next frame, a payload chunk, room in the worker's stdin)
    an INACTIVITY deadline, STREAMCTL_DEADLINE_ENGINE_S (DEFAULT_DEADLINE_S), and kills the worker past it
    (EngineFailed, exit 6, naming what it was doing). So a long request is never cut, the worker sends a
    "heartbeat" every STREAMCTL_ENGINE_HEARTBEAT_S (the parent sets it, a fraction of the deadline) from a
    thread of its own while it starts up or serves a request (`start_lifeline`): only a worker that is
    stopped (SIGSTOP), hung or dead goes silent. Heartbeats may also arrive between requests: ignore them.
  - the worker asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG: a SIGKILLed parent too),
    and its lifeline thread checks the parent's pid (STREAMCTL_ENGINE_PARENT_PID) every heartbeat, for a
    parent gone before that or a wrapper script between the two; then it kills its process group. A parent
    stopped by SIGINT or SIGTERM forwards the signal to the worker's group, then kills it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

PROTOCOL_VERSION = 1

DEADLINE_VARIABLE = "STREAMCTL_DEADLINE_ENGINE_S"
DEFAULT_DEADLINE_S = 120.0  # silence the parent accepts: far beyond a GIL-holding step of the worker (a gc, a big JSON)
HEARTBEAT_VARIABLE = "STREAMCTL_ENGINE_HEARTBEAT_S"
PARENT_VARIABLE = "STREAMCTL_ENGINE_PARENT_PID"
HEARTBEAT = {"type": "heartbeat"}

UNSUPPORTED_VLLM = "unsupported-vllm"  # the worker's start-up check refused the environment's vLLM (vllm_compat)
# What an "error" frame's kind may be, and what it means for the parent.
ERROR_KINDS: Mapping[str, str] = {
    "unsupported-architecture": "vLLM has no model class for config.json's architecture",
    "bad-parallel-size": "TP/PP/EP does not divide the model (heads, experts, layers)",
    "unsupported-quantization": "vLLM's CPU platform cannot build this checkpoint's quantization method",
    "bad-checkpoint": "the checkpoint's tensors do not fit the model (missing, extra, wrong shape, unreadable)",
    UNSUPPORTED_VLLM: "the environment's vLLM is not a supported release, or an internal the worker uses moved",
    "protocol": "a frame that breaks this protocol",
    "internal": "anything else the worker hit",
}

MAX_HEADER_LINE = 64 * 1024 * 1024  # a plan or write frame for a 1,000-layer MoE stays far below this


class ProtocolError(Exception):
    """The other side broke the protocol or went away (EOF in the middle of a frame)."""


def write_frame(stream: IO[bytes], header: Mapping[str, Any], payload: bytes | memoryview | None = None) -> None:
    """Write one frame; `header["nbytes"]` must equal the payload's length when there is one."""
    size = 0 if payload is None else memoryview(payload).nbytes
    if int(header.get("nbytes", 0)) != size:
        raise ProtocolError(f"frame says nbytes {header.get('nbytes', 0)}, payload has {size}")
    stream.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
    if payload is not None and size:
        stream.write(payload)
    stream.flush()


def read_header(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next frame's JSON object; None at a clean end of stream (EOF before any byte)."""
    line = stream.readline(MAX_HEADER_LINE + 1)
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise ProtocolError("a frame header was cut off (the other side went away)")
    try:
        header = json.loads(line)
    except ValueError:
        raise ProtocolError(f"not a frame header: {line[:120]!r}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"not a frame header: {line[:120]!r}")
    return header


def payload_chunks(stream: IO[bytes], nbytes: int, chunk: int = 8 * 1024 * 1024) -> Iterator[bytes]:
    """A frame's payload in chunks of at most `chunk` bytes (nothing larger is ever held)."""
    left = nbytes
    while left:
        data = stream.read(min(chunk, left))
        if not data:
            raise ProtocolError(f"a frame's payload ended {left} bytes early (the other side went away)")
        left -= len(data)
        yield data


def read_payload(stream: IO[bytes], nbytes: int) -> bytes:
    """A whole (small) payload."""
    return b"".join(payload_chunks(stream, nbytes))


def read_frame(stream: IO[bytes]) -> tuple[dict[str, Any], bytes] | None:
    """A whole frame (header, payload); None at a clean end of stream. For small frames only: tensor
    payloads are read with `payload_chunks`."""
    header = read_header(stream)
    if header is None:
        return None
    return header, read_payload(stream, int(header.get("nbytes", 0)))


# --- life and death (see the module's doc) ------------------------------------------------------------------


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    try:
        value = float(environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


def engine_deadline(environ: Mapping[str, str] = os.environ) -> float:
    """The parent's inactivity deadline for the worker, in seconds."""
    return _seconds(environ, DEADLINE_VARIABLE, DEFAULT_DEADLINE_S)


def heartbeat_interval(deadline_s: float) -> float:
    """How often the worker says it is alive: several times per deadline, at most every 5 s."""
    return min(5.0, deadline_s / 4)


def _process_gone(pid: int) -> bool:
    """Whether `pid` no longer runs: absent, or a zombie no one has reaped yet (a SIGKILLed parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[:1]
        return state in ([b"Z"], [b"X"])
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


def _die_with_group() -> None:
    """Kill this worker and whatever it started (it leads its own process group when the parent made it so)."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def start_lifeline(
    send_heartbeat: Callable[[], None], working: threading.Event, environ: Mapping[str, str] = os.environ
) -> threading.Thread:
    """The worker's side: die with the parent (PR_SET_PDEATHSIG, and its pid checked every interval), and
    call `send_heartbeat` every interval while `working` is set. Call it first thing, from the main thread."""
    from streamctl.common.libc import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)
    parent = int(environ.get(PARENT_VARIABLE, "0") or 0) or os.getppid()
    interval = _seconds(environ, HEARTBEAT_VARIABLE, heartbeat_interval(DEFAULT_DEADLINE_S))
    if _process_gone(parent):  # it died before the kernel could be asked to tell us
        _die_with_group()

    def run() -> None:
        while True:
            threading.Event().wait(interval)
            if _process_gone(parent):
                _die_with_group()
            if working.is_set():
                try:
                    send_heartbeat()
                except Exception:  # noqa: BLE001 - the pipe's own failure reaches the main thread anyway
                    pass

    thread = threading.Thread(target=run, name="lifeline", daemon=True)
    thread.start()
    return thread
