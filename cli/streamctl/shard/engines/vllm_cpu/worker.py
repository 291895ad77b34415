"""The `shard --engine vllm-cpu` worker: vLLM's own model code lays out every rank's tensors, on a CPU.

    VLLM_PYTHON -P -m streamctl.shard.engines.vllm_cpu.worker      (PYTHONPATH=<a folder holding streamctl alone>)

stdin/stdout carry the frames of streamctl.shard.engines.vllm_cpu.protocol (its docstring is the contract); fd 1 is moved
to stderr first, so vLLM's own prints and logs (at WARNING) go to stderr. One process serves any number of
plan/write/check sequences: vLLM is imported, checked (vllm_compat.startup_check: a release outside its
SUPPORTED table, or a private touch point that moved, and every request is answered with one "unsupported-vllm"
error naming what) and initialised once (a one-process gloo world with size-1 TP/PP groups); every rank is
EMULATED (the TP/PP group attributes rewritten, tests/vllm_oracle/_harness.py's recipe) and restored after each
build, as is VLLM_PP_LAYER_PARTITION.

plan   (worker_plan.py) `ModelConfig.verify_with_parallel_config` first (vLLM's own refusals, classified
       into ERROR_KINDS), then a `meta`-device build (nothing allocated) of every real rank (pp_rank, tp_rank):
       its names, dtypes, shapes in state-dict order after the alias rule of
       `ShardedStateLoader._filter_subtensors` (decided by parameter identity on meta: whole-tensor aliases
       keep the smallest name), and a meta build of every PSEUDO STAGE of the stage at TP rank 0: a pipeline of
       L = num_hidden_layers stages of one decoder layer each (VLLM_PP_LAYER_PARTITION=1,...,1; `make_layers`
       builds layer i only, embeddings exist on pseudo stage 0 only, norm/head on L-1 only). A name's "layer"
       is the first pseudo stage that holds it; a name no pseudo stage holds is refused here, before anything
       is written. A model whose vLLM class has no pipeline stages (not SupportsPP: BERT and other encoders)
       cannot be cut into pseudo stages: its names get the layer WHOLE_RANK and each rank is built and loaded
       whole (reply "layerwise": false). A weight-only quantized layer (AWQ, GPTQ, compressed-tensors int4)
       whose rank share is not whole int32 words or quantization groups is refused here too (wna16.py), as is
       an FP8 block-quantized one whose share is not whole blocks, and MXFP4 before any build (quantized.py).
write  (worker_write.py) per part, consecutive names grouped by layer; the layer's HF tensors read once
       and kept for the next group; per TP rank the pseudo stage is built on the CPU, every floating parameter
       it sends NaN-poisoned (the rest set aside on the meta device), loaded by the model's own `load_weights`,
       `_filter_subtensors`-ed (BEFORE process_weights_after_loading: the state the ShardedStateLoader loads)
       and each tensor streamed as raw bytes + sha256. One model alive at a time, gc per layer, gc.freeze after init: peak RSS ~ one layer.
check  (worker_check.py) the rank model loaded by vLLM's own ShardedStateLoader from DEST; every loaded
       tensor's sha256, before post-processing, must equal what write sent; each parameter's memory given
       back once it is checked, so a rank of any size loads in about one tensor's memory.

Outgoing frames go through one writer thread (worker_channel.py). One torch thread (OpenMP's spinning
workers cost 3-4x the CPU on a busy machine). Each vLLM log message reaches stderr once (OncePerMessage).
Refusals and the error frame: worker_errors.py. Build-only stand-ins: shims.py. Every private vLLM
access: compat.py. This module and those import the standard library, torch, vllm and this package's
worker modules only.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from streamctl.shard.engines.vllm_cpu import compat as vllm_compat
from streamctl.shard.engines.vllm_cpu import shims as vllm_shims
from streamctl.shard.engines.vllm_cpu.protocol import HEARTBEAT, ProtocolError, read_header, start_lifeline
from streamctl.shard.engines.vllm_cpu.worker_channel import Channel
from streamctl.shard.engines.vllm_cpu.worker_check import op_check
from streamctl.shard.engines.vllm_cpu.worker_errors import WorkerError, error_frame
from streamctl.shard.engines.vllm_cpu.worker_plan import Plan, op_plan
from streamctl.shard.engines.vllm_cpu.worker_write import op_write


def _drain(channel: Channel, header: dict[str, Any]) -> None:
    left = int(header.get("nbytes", 0) or 0)
    while left > 0:
        chunk = channel.inp.read(min(left, 1 << 20))
        if not chunk:
            raise ProtocolError("stdin ended inside a frame")
        left -= len(chunk)


def refuse_every_request(channel: Channel, refusal: vllm_compat.VllmMoved, working: threading.Event) -> int:
    """The start-up check failed: every request is answered with its one-line refusal, until EOF."""
    while True:
        working.clear()
        header = read_header(channel.inp)
        working.set()
        if header is None:
            channel.flush()
            return 0
        _drain(channel, header)
        channel.send(error_frame(refusal))
        channel.flush()


def serve(channel: Channel, working: threading.Event | None = None) -> int:
    """Frames until EOF; one error frame per failed op, then the next op. `working` is set while an op runs
    (the lifeline's heartbeats go out then)."""
    plan: Plan | None = None
    working = working or threading.Event()
    handlers: dict[str, Callable[[dict[str, Any]], Any]] = {
        "write": lambda request: op_write(channel, plan, request),
        "check": lambda request: op_check(channel, plan, request),
    }
    while True:
        working.clear()  # idle: the parent is not waiting for anything
        header = read_header(channel.inp)
        working.set()
        if header is None:
            channel.flush()
            return 0
        op = header.get("op")
        quiet_repeated_vllm_logs()
        try:
            if op == "plan":
                plan = None  # nothing of the last plan survives a new one, even a failed one
                plan = op_plan(channel, header)
                gc.collect()
                gc.freeze()  # what a plan imported (model modules) stays: keep it out of every per-layer gc
            elif op in handlers:
                handlers[op](header)
            else:
                _drain(channel, header)
                raise WorkerError("protocol", f"unexpected frame {json.dumps(header)[:200]}")
        except (BrokenPipeError, ProtocolError):
            raise
        except Exception as error:  # noqa: BLE001 - one error frame per failed op; the worker serves on
            channel.send(error_frame(error))
        channel.flush()  # the op's last frame is out before the next request is read


class OncePerMessage(logging.Filter):
    """vLLM warns per model built ("Reset SSM cache type...", "Attempted to load weight ... with dtype"): with
    a pseudo stage per layer and rank that floods stderr. Each message template passes once; errors always."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        key = (record.name, str(record.msg))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


ONCE = OncePerMessage()


def quiet_repeated_vllm_logs() -> None:
    """ONCE on vLLM's log handlers (idempotent: every op calls it, in case vLLM configured its logging since);
    when vLLM's logging is not configured (its records reach Python's last-resort handler), a stderr handler
    of our own, with ONCE, takes their place."""
    vllm_logger = logging.getLogger("vllm")
    handlers = vllm_logger.handlers + logging.getLogger().handlers
    if not handlers:
        own = logging.StreamHandler(sys.stderr)
        own.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        vllm_logger.addHandler(own)
        handlers = [own]
    for handler in handlers:
        if ONCE not in handler.filters:
            handler.addFilter(ONCE)


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # One torch thread (before torch is imported): the work is memory-bound copies, and OpenMP's spinning
    # workers cost 3-4x the CPU time on a busy machine (measured: 8.8 s -> 2.4 s of CPU for 1.1 GB, TP 2);
    # the frame-writer thread hashes and writes alongside.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # A forwarded Ctrl-C ends the worker as SIGTERM does (nothing here needs cleaning up), without a traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    channel = Channel(sys.stdin.buffer, out)
    working = threading.Event()
    working.set()  # starting up (vLLM's import takes seconds): the parent is waiting for the plan's answer
    start_lifeline(lambda: channel.send(dict(HEARTBEAT)), working)
    try:
        vllm_shims.install_torchvision()  # before vLLM imports transformers, which decides once what exists
        try:
            vllm_compat.startup_check()
            vllm_shims.install()
            quiet_repeated_vllm_logs()
            vllm_compat.init_vllm()
        except vllm_compat.VllmMoved as refusal:
            return refuse_every_request(channel, refusal, working)
        gc.collect()
        gc.freeze()  # vLLM's import graph is ~1M objects: keep it out of every per-layer collection
        return serve(channel, working)
    except BrokenPipeError:
        return 0
    except ProtocolError as error:  # the stream itself broke: one last word, if the parent still listens
        try:
            channel.send(error_frame(error))
            channel.flush()
        except OSError:
            pass
        return 2
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
