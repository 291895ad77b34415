"""The pipe protocol between `shard --engine vllm-cpu` (the parent: streamctl's own Python) and its worker
(shard/vllm_cpu_worker.py, run by the vLLM environment's Python). Standard library only: both sides import it
(the worker runs as `VLLM_PYTHON -P -m streamctl.shard.vllm_cpu_worker` with this package's folder on PYTHONPATH).

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
  check    {"op": "check", "dest_dir", "pattern", "max_rank_bytes"}
           vLLM's own ShardedStateLoader loads each written rank (local DEST only) and every loaded tensor's
           sha256 must equal what the write sent; ranks over max_rank_bytes are skipped (memory).
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
  written  {"type": "written", "seconds", "peak_rss_mib", "kept_construction_value": [names]}
  checked  {"type": "checked", "loader": "runai_streamer_sharded", "ranks": [{"pp_rank", "tp_rank", "ok",
            "tensors", "problems": [...], "skipped": reason or null}], "peak_rss_mib"}
  error    {"type": "error", "kind": one of ERROR_KINDS, "message": one line (vLLM's own words where it
            refused), "detail": the traceback's last lines}
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import IO, Any

PROTOCOL_VERSION = 1

# What an "error" frame's kind may be, and what it means for the parent.
ERROR_KINDS: Mapping[str, str] = {
    "unsupported-architecture": "vLLM has no model class for config.json's architecture",
    "bad-parallel-size": "TP/PP/EP does not divide the model (heads, experts, layers)",
    "unsupported-quantization": "vLLM's CPU platform cannot build this checkpoint's quantization method",
    "bad-checkpoint": "the checkpoint's tensors do not fit the model (missing, extra, wrong shape, unreadable)",
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
