"""The `shard --engine vllm-cpu` worker: vLLM's own model code lays out every rank's tensors, on a CPU.

    VLLM_PYTHON -P -m streamctl.shard.vllm_cpu_worker      (PYTHONPATH=<a folder holding streamctl alone>)

stdin/stdout carry the frames of streamctl.shard.vllm_protocol (its docstring is the contract); fd 1 is moved
to stderr first, so vLLM's own prints and logs (at WARNING) go to stderr. One process serves any number of
plan/write/check sequences: vLLM is imported and initialised once (a one-process gloo world with size-1 TP/PP
groups), every rank is EMULATED (the TP/PP group attributes rewritten, tests/vllm_oracle/_harness.py's recipe)
and restored after each build, as is VLLM_PP_LAYER_PARTITION.

plan   `ModelConfig.verify_with_parallel_config` first (vLLM's own refusals, classified into ERROR_KINDS), then a
       `meta`-device build (nothing allocated) of every real rank (pp_rank, tp_rank): its names, dtypes, shapes
       in state-dict order after the alias rule of `ShardedStateLoader._filter_subtensors` (decided by
       parameter identity on meta: whole-tensor aliases keep the smallest name), and a meta build of every
       PSEUDO STAGE of the stage at TP rank 0: a pipeline of L = num_hidden_layers stages of one decoder layer
       each (VLLM_PP_LAYER_PARTITION=1,...,1; `make_layers` builds layer i only, embeddings exist on pseudo
       stage 0 only, norm/head on L-1 only). A name's "layer" is the first pseudo stage that holds it; a name
       no pseudo stage holds is refused here, before anything is written. A model whose vLLM class has no
       pipeline stages (not SupportsPP: BERT and other encoders) cannot be cut into pseudo stages: its names
       get the layer WHOLE_RANK and each rank is built and loaded whole (reply "layerwise": false). A
       weight-only quantized layer (AWQ, GPTQ, compressed-tensors int4) whose rank share is not whole int32
       words or quantization groups is refused here too (streamctl/shard/vllm_wna16.py).
write  per part, consecutive names grouped by layer; the layer's HF tensors read once (memory-mapped from
       local_root with safe_open, or "read" frames answered by the parent) and kept for the next group; per TP
       rank the pseudo stage is built on the CPU, every floating parameter NaN-poisoned, loaded by the model's
       own `load_weights`, `_filter_subtensors`-ed (BEFORE process_weights_after_loading: the state the
       ShardedStateLoader loads) and each tensor streamed as raw bytes + sha256. One model alive at a time,
       gc per layer, gc.freeze after init: peak RSS ~ one layer, whatever the model's size.
check  the FULL rank model (real rank emulated) loaded by vLLM's own ShardedStateLoader (runai_streamer_sharded
       when the Run:ai streamer is importable, else sharded_state) from DEST; every loaded tensor's sha256,
       before post-processing, must equal what write sent.

Outgoing frames go through one writer thread (it hashes and writes while the next pseudo stage loads; at most
INFLIGHT_BYTES queued). One torch thread (OpenMP's spinning workers cost 3-4x the CPU on a busy machine).
vLLM's id(model)-keyed cache of PP-missing layers is emptied after every build (forget_freed_models), and
each vLLM log message reaches stderr once (OncePerMessage). Build-only shims: streamctl/shard/vllm_shims.py.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import IO, Any

from streamctl.shard import vllm_shims, vllm_wna16
from streamctl.shard.vllm_protocol import (
    ERROR_KINDS,
    HEARTBEAT,
    PROTOCOL_VERSION,
    ProtocolError,
    read_header,
    start_lifeline,
    write_frame,
)

# safetensors dtype names <-> torch dtype names
SAFETENSORS_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
TORCH_TO_SAFETENSORS = {torch_name: st_name for st_name, torch_name in SAFETENSORS_DTYPES.items()}

# What checkpoints and vLLM's model classes call the decoder-layer list: `model.layers` (Llama and most),
# `transformer.h` (GPT-2, Falcon, GPT-J, BLOOM, Qwen 1), `transformer.blocks` (MPT, DBRX).
_LAYER_LISTS = ("layers", "h", "blocks")
# The decoder-layer index of an HF tensor name (the language model's layers, not a vision or audio encoder's):
# what a pseudo stage is fed. The NaN poison check catches a tensor this rule fails to feed.
_HF_LAYER = re.compile(r"(?:^|\.)(?:" + "|".join(_LAYER_LISTS) + r")\.(\d+)\.")
_NOT_DECODER = ("vision", "visual", "audio", "encoder", "mm_projector", "multi_modal")
FP8_BLOCK_MISSING = (
    "vLLM's CPU FP8 block kernel needs AMX tiles (Sapphire Rapids or newer) and vllm._C's fp8_scaled_mm_cpu, "
    "which this CPU-only vLLM environment lacks"
)
MESSAGE_LIMIT = 600
LOG_INTERVAL_S = 2.0
INFLIGHT_BYTES = 64 * 1024 * 1024  # tensor payload queued for the writer thread, at most (one tensor always)


class WorkerError(Exception):
    """A refusal with its protocol kind (ERROR_KINDS)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def hf_layer_index(name: str) -> int | None:
    if any(word in name for word in _NOT_DECODER):
        return None
    match = _HF_LAYER.search(name)
    return int(match.group(1)) if match else None


def peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return -1.0


def one_line(error: BaseException) -> str:
    """vLLM's own words on one line (a pydantic ValidationError: its messages, not its layout)."""
    errors = getattr(error, "errors", None)
    text = ""
    if callable(errors):
        try:
            text = "; ".join(str(item.get("msg", "")) for item in errors())
        except Exception:  # noqa: BLE001 - not pydantic's errors(): str() below
            text = ""
    if not text and not str(error) and isinstance(error, AssertionError):
        text = _failed_assertion(error)
    text = " ".join((text or str(error) or type(error).__name__).split())
    text = _SUPPORTED_LIST.sub(r"\1 listed in vLLM's docs (Supported Models)", text)
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 1] + "…"


# vLLM's "not supported" error lists all of its ~300 architectures: the user needs the first sentence.
_SUPPORTED_LIST = re.compile(r"(Supported architectures:) dict_keys\(\[.*?\]\)")
_NAME_IN_ASSERTION = re.compile(r"\b(self\.[A-Za-z_]\w*|[A-Za-z_]\w*)\b")


def _failed_assertion(error: AssertionError) -> str:
    """A bare `assert` of vLLM's (no message): its source line and the values of the names in it, from the
    failing frame (e.g. "assert self.intermediate_size % tp_size == 0 (self.intermediate_size=66,
    tp_size=4; fused_moe/config.py:90)"), so the user sees which size does not divide."""
    import linecache

    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "AssertionError"
    frame, lineno = tb.tb_frame, tb.tb_lineno
    line = linecache.getline(frame.f_code.co_filename, lineno).strip() or "assert"
    values = []
    for name in dict.fromkeys(_NAME_IN_ASSERTION.findall(line.removeprefix("assert"))):
        owner, _, attribute = name.partition(".")
        value = frame.f_locals.get(owner, _MISSING)
        if attribute and value is not _MISSING:
            value = getattr(value, attribute, _MISSING)
        if isinstance(value, int | float | str | bool) and not isinstance(value, type):
            values.append(f"{name}={value!r}")
    where = "/".join(frame.f_code.co_filename.split("/")[-2:])
    return f"vLLM's check failed: {line} ({', '.join(values)}{'; ' if values else ''}{where}:{lineno})"


_MISSING = object()


# --- the pipe ---------------------------------------------------------------------------------------------


class Channel:
    """The protocol streams: frames in from the parent, frames out to it. Outgoing frames go through one
    writer thread, in order: it hashes a tensor's bytes and writes them (both release the GIL) while the
    main thread builds and loads the next pseudo stage; at most INFLIGHT_BYTES of payload wait for it."""

    def __init__(self, inp: IO[bytes], out: IO[bytes]) -> None:
        self.inp, self.out = inp, out
        self.last_log = 0.0
        self._queue: queue.Queue[tuple[dict[str, Any], Any, Callable[[dict[str, Any]], None] | None] | None]
        self._queue = queue.Queue()
        self._inflight = 0
        self._changed = threading.Condition()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._write_frames, name="frame-writer", daemon=True)
        self._thread.start()

    def _write_frames(self) -> None:
        while (item := self._queue.get()) is not None:
            header, payload, on_sent = item
            try:
                if self._failure is None:
                    view = payload[0] if isinstance(payload, tuple) else payload  # (bytes, what keeps them alive)
                    if header.get("sha256", "") is None:
                        header["sha256"] = hashlib.sha256(view).hexdigest()
                    write_frame(self.out, header, view)
                    if on_sent is not None:
                        on_sent(header)
            except BaseException as error:  # noqa: BLE001 - re-raised in the main thread by the next send
                self._failure = error
            finally:
                with self._changed:
                    self._inflight -= int(header.get("nbytes", 0))
                    self._changed.notify_all()
                self._queue.task_done()
        self._queue.task_done()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def send(
        self,
        header: dict[str, Any],
        payload: Any = None,
        on_sent: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Queue one frame (a "sha256": None header gets the payload's sha256 filled in before it is written)."""
        self._raise_failure()
        size = int(header.get("nbytes", 0))
        with self._changed:
            self._changed.wait_for(  # a frame without payload (a heartbeat, a log) never waits for room
                lambda: (
                    size == 0
                    or self._inflight == 0
                    or self._inflight + size <= INFLIGHT_BYTES
                    or self._failure is not None
                )
            )
            self._inflight += size
        self._queue.put((header, payload, on_sent))

    def flush(self) -> None:
        """Every queued frame written (or the writer's failure raised)."""
        self._queue.join()
        self._raise_failure()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def log(self, message: str, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_log >= LOG_INTERVAL_S:
            self.last_log = now
            self.send({"type": "log", "message": message})

    def read_range(self, file: str, offset: int, length: int) -> bytearray:
        """`length` bytes of the source's FILE at OFFSET, asked from the parent (one "read", one "data")."""
        self.send({"type": "read", "file": file, "offset": offset, "length": length})
        self.flush()
        header = read_header(self.inp)
        if header is None:
            raise ProtocolError("stdin ended while waiting for a data frame")
        nbytes = int(header.get("nbytes", 0))
        if header.get("op") != "data" or nbytes != length:
            raise ProtocolError(f"expected a data frame of {length} bytes, got {json.dumps(header)[:200]}")
        buffer = bytearray(length)
        view, filled = memoryview(buffer), 0
        while filled < length:
            got = self.inp.readinto(view[filled:])  # type: ignore[attr-defined]
            if not got:
                raise ProtocolError(f"a data frame ended {length - filled} bytes early")
            filled += got
        return buffer


# --- vLLM set-up and rank emulation ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_vllm() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        initialize_model_parallel(1, 1)


@contextmanager
def emulate_rank(tp_size: int, tp_rank: int, pp_size: int, pp_rank: int) -> Iterator[None]:
    """Every vLLM TP/PP/EP query answers as rank (pp_rank, tp_rank) of (pp_size, tp_size); restored after.
    The EP group is the TP group's ranks (vLLM's with data and context parallel at 1): model code that slices
    experts by `get_ep_group()` itself (gpt-oss) must see the same rank as FusedMoE does."""
    from vllm.distributed import parallel_state

    tp, pp, ep = parallel_state._TP, parallel_state._PP, getattr(parallel_state, "_EP", None)
    tp_like = (tp,) if ep is None else (tp, ep)
    groups = (*tp_like, pp)
    fields = ("world_size", "rank_in_group", "ranks", "rank")
    saved = [{name: getattr(group, name) for name in fields} for group in groups]
    global_rank = pp_rank * tp_size + tp_rank
    for group in tp_like:
        group.world_size, group.rank_in_group, group.rank = tp_size, tp_rank, global_rank
        group.ranks = [pp_rank * tp_size + i for i in range(tp_size)]
    pp.world_size, pp.rank_in_group, pp.rank = pp_size, pp_rank, global_rank
    pp.ranks = [stage * tp_size + tp_rank for stage in range(pp_size)]
    try:
        yield
    finally:
        for group, values in zip(groups, saved, strict=True):
            for name, value in values.items():
                setattr(group, name, value)


@contextmanager
def pp_partition(value: str | None) -> Iterator[None]:
    """VLLM_PP_LAYER_PARTITION (read at call time by vLLM's get_pp_indices) set or unset, then restored."""
    key = "VLLM_PP_LAYER_PARTITION"
    old = os.environ.get(key)
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


# --- the plan ----------------------------------------------------------------------------------------------


WHOLE_RANK = -2  # the "layer" of every name of a model built a whole rank at a time (no pipeline stages)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors name
    shape: tuple[int, ...]  # TP rank 0's
    layer: int = -1
    rank_shapes: tuple[tuple[int, ...], ...] = ()  # every TP rank's, where they differ (EP over uneven experts)

    def shape_on(self, tp_rank: int) -> tuple[int, ...]:
        return self.rank_shapes[tp_rank] if self.rank_shapes else self.shape


@dataclass
class Plan:
    """The last plan: what write and check refer to."""

    request: dict[str, Any]
    tp: int
    pp: int
    ep: bool
    partition: str | None
    num_layers: int
    stage_layers: list[tuple[int, int]]
    stages: list[dict[str, PlannedTensor]]  # per pp_rank: name -> tensor, in state-dict order
    hf_tensors: dict[str, dict[str, Any]]
    quantization: str | None = None
    sent: dict[tuple[int, int], dict[str, str]] = field(default_factory=dict)  # (pp, tp) -> name -> sha256
    global_feeders: set[int] = field(default_factory=set)  # pseudo stages fed the non-layer HF tensors too
    layerwise: bool = True  # False: the model has no pipeline stages, every rank is built whole (WHOLE_RANK)

    hf_by_layer: dict[int | None, list[str]] = field(default_factory=dict)  # HF names by decoder layer

    def __post_init__(self) -> None:
        for name in self.hf_tensors:
            self.hf_by_layer.setdefault(hf_layer_index(name), []).append(name)

    def hf_names_of_layer(self, layer: int) -> list[str]:
        """The HF tensors pseudo stage `layer` is fed: its decoder layer's, and on the first and last pseudo
        stage (and any other that produces a non-layer name) every tensor outside the decoder layers
        (embeddings, vision tower, norm, head)."""
        if layer == WHOLE_RANK:
            return list(self.hf_tensors)
        names = list(self.hf_by_layer.get(layer, []))
        if layer in (0, self.num_layers - 1) or layer in self.global_feeders:
            names += self.hf_by_layer.get(None, [])
        return names


def make_vllm_config(
    request: dict[str, Any], load_format: str = "auto", pattern: str | None = None, model_weights: str = ""
) -> Any:
    """A fresh VllmConfig (one per model instance: attention layers register their names in it), compilation
    off: otherwise every model registers a bound method as a global torch._dynamo bytecode hook that is never
    removed (vllm/compilation/wrapper.py), and no built model is ever freed."""
    from vllm.config import CompilationConfig, CompilationMode, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    model_config = ModelConfig(
        model=request["model_dir"],
        skip_tokenizer_init=True,
        dtype=request.get("dtype") or "auto",
        model_weights=model_weights,
    )
    extra = {"pattern": pattern} if pattern else {}
    return VllmConfig(
        model_config=model_config,
        load_config=LoadConfig(load_format=load_format, model_loader_extra_config=extra, use_tqdm_on_load=False),
        parallel_config=ParallelConfig(enable_expert_parallel=bool(request.get("ep"))),
        compilation_config=CompilationConfig(mode=CompilationMode.NONE),
    )


def build_model(vllm_config: Any, device: str = "cpu") -> Any:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device(device),
    ):
        model = initialize_model(vllm_config=vllm_config)
    forget_freed_models()
    return model


def forget_freed_models() -> None:
    """vLLM caches each model's PP-missing layer names by id(model) and never forgets them
    (models/utils.py `_model_to_pp_missing_layer_names`): a new pseudo stage that reuses a freed one's id
    then skips the wrong layers in load_weights (seen: DeepSeek-V2 TP 2 leaving random tensors NaN, 11 runs
    in 40). One model is loaded at a time here, so the cache is emptied after every build."""
    from vllm.model_executor.models import utils as model_utils

    cache = getattr(model_utils, "_model_to_pp_missing_layer_names", None)
    if isinstance(cache, dict):
        cache.clear()


def _classify_build_error(error: Exception, quantization: str | None) -> WorkerError:
    message = one_line(error)
    if isinstance(error, WorkerError):
        return error
    if "divisible" in message or (
        isinstance(error, AssertionError) and any(word in message for word in _PARALLEL_WORDS)
    ):
        return WorkerError("bad-parallel-size", message)
    if quantization and ("kernel" in message.lower() or "quantiz" in message.lower()):
        extra = f" ({FP8_BLOCK_MISSING})" if "ScaledMM" in message or "Fp8" in message else ""
        return WorkerError("unsupported-quantization", message + extra)
    if "meta tensor" in message:  # e.g. BLOOM's ALiBi slopes, computed and copied while it is constructed
        return WorkerError(
            "unsupported-architecture",
            f"vLLM's model class computes tensors while it is constructed, so it cannot be built on the meta "
            f"device, which streamctl's vllm-cpu planning needs (no weights allocated): {message}",
        )
    return WorkerError("internal", f"building the model: {message}")


# What a bare assertion about the parallel layout mentions (vLLM's `assert x % tp_size == 0` style checks).
_PARALLEL_WORDS = ("tp_size", "ep_size", "world_size", "tp_rank", "ep_rank", "parallel", "num_experts")


def _config_or_refusal(request: dict[str, Any]) -> Any:
    try:
        return make_vllm_config(request)
    except Exception as error:
        message = one_line(error)
        lowered = message.lower()
        if "architecture" in lowered and ("not supported" in lowered or "failed to be inspected" in lowered):
            raise WorkerError("unsupported-architecture", message) from error
        if "quantiz" in lowered:
            raise WorkerError("unsupported-quantization", message) from error
        if "divisible" in lowered:
            raise WorkerError("bad-parallel-size", message) from error
        # Anything else vLLM's ModelConfig raised is its verdict on config.json (a field this vLLM reads and
        # the file lacks, a value it rejects): the checkpoint's to fix, in vLLM's words.
        raise WorkerError("bad-checkpoint", f"vLLM's ModelConfig does not accept config.json: {message}") from error


def meta_tensors(vllm_config: Any) -> tuple[list[PlannedTensor], Any]:
    """The tensors `_filter_subtensors` keeps for the emulated rank, in its order, from a meta build (no
    memory). data_ptr() is 0 on meta, so aliases (tied embeddings) are decided by parameter identity, the
    filter's rule for whole-tensor aliases: the group sits where its first name is, and keeps its smallest."""
    model = build_model(vllm_config, "meta")
    groups: dict[int, list[tuple[str, Any]]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.numel():
            groups.setdefault(id(tensor), []).append((name, tensor))
    kept = []
    for group in groups.values():
        name, tensor = min(group, key=lambda item: item[0])
        dtype = TORCH_TO_SAFETENSORS.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise WorkerError("internal", f"{name}: dtype {tensor.dtype} has no safetensors name")
        kept.append(PlannedTensor(name, dtype, tuple(int(n) for n in tensor.shape)))
    return kept, model


def _decoder_layers_built(model: Any) -> int:
    """How many decoder layers a (pseudo-stage) model really built (the longest `layers` ModuleList)."""
    import torch

    lists = [
        module
        for name, module in model.named_modules()
        if (name.endswith("layers") or name.rsplit(".", 1)[-1] in _LAYER_LISTS)
        and isinstance(module, torch.nn.ModuleList)
        and not any(word in name for word in _NOT_DECODER)
    ]
    if not lists:
        return 0
    return sum(1 for layer in max(lists, key=len) if type(layer).__name__ != "PPMissingLayer")


def _describe_difference(first: list[PlannedTensor], other: list[PlannedTensor]) -> str:
    a, b = {t.name: t for t in first}, {t.name: t for t in other}
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        return f"names only on TP rank 0: {only_a[:5]}, only on this rank: {only_b[:5]}"
    changed = [n for n in a if a[n] != b[n]][:3]
    if changed:
        return "; ".join(f"{n}: {a[n].dtype}{list(a[n].shape)} vs {b[n].dtype}{list(b[n].shape)}" for n in changed)
    return "the same names in a different order"


def plan_stage_names(
    request: dict[str, Any], plan: Plan, pp_rank: int, quantization: str | None
) -> tuple[list[PlannedTensor], set[str]]:
    """Meta builds of every TP rank of real stage pp_rank: one list (TP rank 0's), and the build-only shims
    the builds looked up. Every rank must hold the same names and dtypes in the same order; shapes may differ
    only under expert parallelism (vLLM gives the first ranks one expert more when EP does not divide the
    experts, determine_expert_map), and then the tensor carries every rank's (rank_shapes)."""
    ranks: list[list[PlannedTensor]] = []
    shims: set[str] = set()
    for tp_rank in range(plan.tp):
        with pp_partition(plan.partition), emulate_rank(plan.tp, tp_rank, plan.pp, pp_rank):
            try:
                tensors, model = meta_tensors(make_vllm_config(request))
            except Exception as error:
                raise _classify_build_error(error, quantization) from error
        if quantization and tp_rank == 0:
            refuse_unsplittable(model, plan.tp)
        shims.update(vllm_shims.used_by(model))
        del model
        same_names = [(t.name, t.dtype) for t in tensors] == [(t.name, t.dtype) for t in ranks[0]] if ranks else True
        if ranks and (not same_names or (tensors != ranks[0] and not plan.ep)):
            raise WorkerError(
                "internal",
                f"stage {pp_rank}: TP rank {tp_rank}'s tensors differ from TP rank 0's: "
                + _describe_difference(ranks[0], tensors),
            )
        ranks.append(tensors)
    merged = []
    for index, tensor in enumerate(ranks[0]):
        shapes = tuple(rank[index].shape for rank in ranks)
        merged.append(replace(tensor, rank_shapes=shapes) if len(set(shapes)) > 1 else tensor)
    return merged, shims


def refuse_unsplittable(model: Any, tp: int) -> None:
    """A quantized layer whose TP share is not whole int32 words or quantization groups (vllm_wna16)."""
    problems = vllm_wna16.split_problems(model, tp)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise WorkerError("bad-parallel-size", problems[0] + more)


def _choose_layer(name: str, candidates: list[int], num_layers: int) -> int:
    """The producing pseudo stage of a name more than one holds (Mixtral builds its norm on every stage): the
    name's own decoder layer, else a first/last pseudo stage (they are fed the non-layer HF tensors), else
    the first (it is then fed them too: Plan.global_feeders)."""
    index = hf_layer_index(name)
    if index in candidates:
        return index
    edges = [layer for layer in candidates if layer in (0, num_layers - 1)]
    return (edges or candidates)[0]


def producing_layers(request: dict[str, Any], plan: Plan, pp_rank: int, tensors: list[PlannedTensor]) -> dict[str, int]:
    """name -> the pseudo stage (decoder layer) that produces it, from meta builds of the stage's pseudo
    stages at TP rank 0; every pseudo stage must build exactly one decoder layer."""
    start, end = plan.stage_layers[pp_rank]
    ones = ",".join(["1"] * plan.num_layers)
    wanted = {t.name: t for t in tensors}
    candidates: dict[str, list[int]] = {}
    for layer in range(start, end):
        with pp_partition(ones), emulate_rank(plan.tp, 0, plan.num_layers, layer):
            try:
                pseudo, model = meta_tensors(make_vllm_config(request))
            except Exception as error:
                raise _classify_build_error(error, plan.quantization) from error
        built = _decoder_layers_built(model)
        del model
        if built != 1:
            raise WorkerError(
                "internal",
                f"pseudo stage {layer} of {plan.num_layers} built {built} decoder layers, not 1: this model's "
                "layer count is not its config's num_hidden_layers",
            )
        for tensor in pseudo:
            real = wanted.get(tensor.name)
            if real is not None:
                if (real.dtype, real.shape) != (tensor.dtype, tensor.shape):
                    raise WorkerError("internal", f"{tensor.name}: pseudo stage {layer} has a different shape")
                candidates.setdefault(tensor.name, []).append(layer)
    missing = [name for name in wanted if name not in candidates]
    if missing:
        raise WorkerError(
            "internal", f"stage {pp_rank}: no pseudo stage of one layer produces {missing[:5]} (of {len(missing)})"
        )
    return {name: _choose_layer(name, layers, plan.num_layers) for name, layers in candidates.items()}


def _checked_hf_tensors(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    import torch

    tensors = request.get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise WorkerError("bad-checkpoint", "the plan request lists no source tensors")
    for name, entry in tensors.items():
        if not isinstance(entry, dict) or not {"file", "dtype", "shape", "offset", "nbytes"} <= set(entry):
            raise WorkerError("protocol", f"plan: tensor {name!r} needs file, dtype, shape, offset and nbytes")
        torch_name = SAFETENSORS_DTYPES.get(str(entry.get("dtype")))
        if torch_name is None:
            raise WorkerError("bad-checkpoint", f"{name}: dtype {entry.get('dtype')!r} is not a safetensors dtype")
        count = 1
        for size in entry["shape"]:
            count *= int(size)
        if count * getattr(torch, torch_name).itemsize != int(entry["nbytes"]):
            raise WorkerError("bad-checkpoint", f"{name}: {entry['nbytes']} bytes do not fit {entry['shape']}")
    return tensors


def op_plan(channel: Channel, request: dict[str, Any]) -> Plan:
    from vllm.config import ParallelConfig
    from vllm.distributed.utils import get_pp_indices

    if request.get("protocol") != PROTOCOL_VERSION:
        raise WorkerError("protocol", f"protocol {request.get('protocol')!r}, this worker speaks {PROTOCOL_VERSION}")
    vllm_shims.install()
    hf_tensors = _checked_hf_tensors(request)
    tp, pp, ep = int(request.get("tp", 1)), int(request.get("pp", 1)), bool(request.get("ep"))
    partition = request.get("layer_partition")
    if isinstance(partition, list):
        partition = ",".join(str(int(n)) for n in partition)
    config = _config_or_refusal(request)
    model_config = config.model_config
    quantization = model_config.quantization
    try:
        model_config.verify_with_parallel_config(
            ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep)
        )
        layerwise = bool(model_config.is_pp_supported)  # pp > 1 without it: vLLM refused just above
        num_layers = int(getattr(model_config.hf_text_config, "num_hidden_layers", 0) or 0)
        if layerwise and num_layers < 1:
            raise WorkerError("bad-checkpoint", "config.json gives no num_hidden_layers for the model's layers")
        with pp_partition(partition):
            stage_layers = [get_pp_indices(num_layers, rank, pp) for rank in range(pp)]
    except Exception as error:
        raise WorkerError("bad-parallel-size", one_line(error)) from error
    plan = Plan(
        request, tp, pp, ep, partition, num_layers, stage_layers, [], hf_tensors, quantization, layerwise=layerwise
    )
    used: set[str] = set()
    for pp_rank in range(pp):
        tensors, stage_shims = plan_stage_names(request, plan, pp_rank, quantization)
        used |= stage_shims
        if layerwise:
            layer_of = producing_layers(request, plan, pp_rank, tensors)
        else:
            layer_of = dict.fromkeys((t.name for t in tensors), WHOLE_RANK)
        plan.stages.append({t.name: replace(t, layer=layer_of[t.name]) for t in tensors})
        plan.global_feeders |= {layer_of[t.name] for t in tensors if hf_layer_index(t.name) is None}
    gc.collect()
    channel.send(_plan_reply(plan, config, quantization, sorted(used)))
    return plan


def _tensor_entry(tensor: PlannedTensor) -> dict[str, Any]:
    entry = {"name": tensor.name, "dtype": tensor.dtype, "shape": list(tensor.shape), "layer": tensor.layer}
    if tensor.rank_shapes:
        entry["rank_shapes"] = [list(shape) for shape in tensor.rank_shapes]
    return entry


def _plan_reply(plan: Plan, config: Any, quantization: str | None, shims: list[str]) -> dict[str, Any]:
    import torch
    import vllm

    served = TORCH_TO_SAFETENSORS[str(config.model_config.dtype).removeprefix("torch.")]
    architecture = config.model_config.architectures[0] if config.model_config.architectures else None
    return {
        "type": "plan",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "architecture": architecture,
        "served_dtype": served,
        "num_layers": plan.num_layers,
        "layerwise": plan.layerwise,
        "quantization": quantization,
        "shims": shims,
        "stages": [
            {
                "pp_rank": pp_rank,
                "layers": list(plan.stage_layers[pp_rank]),
                "tensors": [_tensor_entry(t) for t in stage.values()],
            }
            for pp_rank, stage in enumerate(plan.stages)
        ],
    }


# --- write -------------------------------------------------------------------------------------------------


@dataclass
class LayerCache:
    """One layer's HF tensors, kept for the next group (the safetensors handles open while they live:
    get_tensor is a zero-copy view of the file's mmap)."""

    layer: int = -1
    tensors: dict[str, Any] = field(default_factory=dict)
    stack: ExitStack = field(default_factory=ExitStack)

    def drop(self) -> None:
        self.tensors = {}
        self.stack.close()
        self.stack = ExitStack()
        self.layer = -1


def _local_tensors(plan: Plan, names: list[str], stack: ExitStack) -> dict[str, Any]:
    from safetensors import safe_open

    root = plan.request["local_root"]
    handles: dict[str, Any] = {}
    tensors = {}
    for name in names:
        entry = plan.hf_tensors[name]
        file = entry["file"]
        try:
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(os.path.join(root, file), framework="pt"))
            tensor = handles[file].get_tensor(name)
        except Exception as error:
            raise WorkerError("bad-checkpoint", f"{file}: {name}: {one_line(error)}") from error
        got = (TORCH_TO_SAFETENSORS.get(str(tensor.dtype).removeprefix("torch.")), list(tensor.shape))
        if got != (entry["dtype"], list(entry["shape"])):
            raise WorkerError(
                "bad-checkpoint", f"{file}: {name} is {got}, the plan says {entry['dtype']}{entry['shape']}"
            )
        tensors[name] = tensor
    return tensors


def _remote_tensors(channel: Channel, plan: Plan, names: list[str]) -> dict[str, Any]:
    """The layer's tensors through "read" frames, one read per run of adjacent tensors of one file."""
    import torch

    entries = sorted(names, key=lambda n: (plan.hf_tensors[n]["file"], int(plan.hf_tensors[n]["offset"])))
    runs: list[list[str]] = []
    for name in entries:
        entry, last = plan.hf_tensors[name], runs[-1][-1] if runs else None
        if last is not None:
            prev = plan.hf_tensors[last]
            if prev["file"] == entry["file"] and int(prev["offset"]) + int(prev["nbytes"]) == int(entry["offset"]):
                runs[-1].append(name)
                continue
        runs.append([name])
    tensors = {}
    for run in runs:
        first, end = plan.hf_tensors[run[0]], plan.hf_tensors[run[-1]]
        start = int(first["offset"])
        buffer = channel.read_range(first["file"], start, int(end["offset"]) + int(end["nbytes"]) - start)
        for name in run:
            entry = plan.hf_tensors[name]
            at, nbytes = int(entry["offset"]) - start, int(entry["nbytes"])
            raw = (
                torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=at)
                if nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            tensors[name] = raw.view(getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])).view(entry["shape"])
    return tensors


def layer_hf_tensors(channel: Channel, plan: Plan, layer: int, cache: LayerCache) -> dict[str, Any]:
    if cache.layer != layer:
        cache.drop()
        names = plan.hf_names_of_layer(layer)
        if plan.request.get("local_root"):
            cache.tensors = _local_tensors(plan, names, cache.stack)
        else:
            cache.tensors = _remote_tensors(channel, plan, names)
        cache.layer = layer
    return cache.tensors


def _must_be_loaded(name: str) -> bool:
    """A model's weights proper (`load_weights` must write them); other parameters (compressed-tensors' scales,
    zero points absent from a checkpoint) may keep their construction value, as in a full build."""
    last = name.rsplit(".", 1)[-1]
    return last in ("weight", "bias") or last.endswith(("_weight", "_bias"))


def _poison(model: Any) -> dict[str, Any]:
    """NaN into every floating parameter, so nothing `load_weights` left unwritten passes as loaded; returns
    the construction values of the (small) parameters that may legitimately keep them."""
    import torch

    saved = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point():
                if not _must_be_loaded(name):
                    saved[name] = param.detach().clone()
                param.fill_(float("nan"))
    return saved


def load_pseudo_stage(
    plan: Plan, layer: int, tp_rank: int, hf: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Pseudo stage `layer` at `tp_rank`, built on the CPU and loaded by its own load_weights: its filtered
    state dict (before post-processing), the construction values of its poisoned small parameters, the model."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    if layer == WHOLE_RANK:  # the real (only) stage, every layer at once
        partition, stages, stage = plan.partition, plan.pp, 0
    else:
        partition, stages, stage = ",".join(["1"] * plan.num_layers), plan.num_layers, layer
    with pp_partition(partition), emulate_rank(plan.tp, tp_rank, stages, stage):
        config = make_vllm_config(plan.request)
        model = build_model(config)
        saved = _poison(model)
        try:
            with set_current_vllm_config(config), torch.no_grad():
                model.load_weights(iter(hf.items()))
        except KeyError as error:  # vLLM's `params_dict[name]` on a checkpoint tensor its model did not build
            raise WorkerError(
                "bad-checkpoint",
                f"layer {layer}, TP rank {tp_rank}: vLLM's model has no parameter for the checkpoint's tensor "
                f"{error.args[0] if error.args else error!r} (a config.json field decides which parameters exist: "
                "does it match the weights?)",
            ) from error
        except Exception as error:
            raise WorkerError("bad-checkpoint", f"layer {layer}, TP rank {tp_rank}: {one_line(error)}") from error
    state = ShardedStateLoader._filter_subtensors(model.state_dict())
    return state, saved, model


def release_weights(model: Any) -> None:
    """Drop a sent model's parameter and buffer storage now (the frames still queued keep theirs until they
    are written): its module objects sit in reference cycles until the per-layer gc, its weights need not."""
    import torch

    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                param.data = torch.empty(0, dtype=param.dtype)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.empty(0, dtype=buffer.dtype)


def raw_bytes(tensor: Any) -> memoryview:
    """The tensor's bytes as safetensors holds them (C order), a view, no copy when already contiguous."""
    import torch

    flat = tensor.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if not flat.numel():
        return memoryview(b"")
    return memoryview(flat.reshape(-1).view(torch.uint8).numpy())


def has_nan(tensor: Any) -> bool:
    """Whether a floating tensor holds a NaN: max propagates NaN, one read pass and no bool tensor the size of
    the input (8x faster than isnan().any()); float8 has no CPU max, so it takes the long way."""
    import torch

    if not tensor.is_floating_point() or not tensor.numel():
        return False
    if tensor.element_size() == 1:
        return bool(torch.isnan(tensor).any())
    return bool(torch.isnan(tensor.amax()))


def send_group(
    channel: Channel,
    plan: Plan,
    pp_rank: int,
    tp_rank: int,
    names: list[str],
    state: dict[str, Any],
    saved: dict[str, Any],
    kept: list[str],
) -> None:
    """Check and send one rank's names of one layer group, in the request's order."""
    import torch

    stage = plan.stages[pp_rank]
    sent = plan.sent.setdefault((pp_rank, tp_rank), {})
    for name in names:
        tensor, want = state.get(name), stage[name]
        if tensor is None:
            raise WorkerError("internal", f"pseudo stage {want.layer} (TP rank {tp_rank}) holds no {name}")
        got = (TORCH_TO_SAFETENSORS.get(str(tensor.dtype).removeprefix("torch.")), tuple(tensor.shape))
        shape = want.shape_on(tp_rank)
        if got != (want.dtype, shape):
            raise WorkerError("internal", f"{name}: built {got}, planned {(want.dtype, shape)}")
        if has_nan(tensor):
            if name not in saved:
                raise WorkerError(
                    "bad-checkpoint",
                    f"TP rank {tp_rank}: load_weights left {name} (partly) unwritten: the checkpoint lacks it",
                )
            with torch.no_grad():
                tensor.copy_(saved[name])
            kept.append(name)
        raw = raw_bytes(tensor)
        header = {
            "type": "tensor",
            "pp_rank": pp_rank,
            "tp_rank": tp_rank,
            "name": name,
            "dtype": want.dtype,
            "shape": list(shape),
            "nbytes": raw.nbytes,
            "sha256": None,  # the writer thread hashes the very bytes it writes
        }
        channel.send(header, (raw, tensor), lambda done: sent.__setitem__(done["name"], done["sha256"]))


def _layer_groups(plan: Plan, pp_rank: int, part: list[str]) -> list[tuple[int, list[str]]]:
    stage = plan.stages[pp_rank]
    groups: list[tuple[int, list[str]]] = []
    for name in part:
        if not isinstance(name, str) or name not in stage:
            raise WorkerError("protocol", f"write: {name!r} is not a tensor of stage {pp_rank} in the plan")
        layer = stage[name].layer
        if groups and groups[-1][0] == layer:
            groups[-1][1].append(name)
        else:
            groups.append((layer, [name]))
    return groups


def op_write(channel: Channel, plan: Plan | None, request: dict[str, Any]) -> None:
    if plan is None:
        raise WorkerError("protocol", "write before a successful plan")
    started = time.perf_counter()
    cache = LayerCache()
    kept: list[str] = []
    try:
        for stage in request.get("stages", []):
            pp_rank = int(stage["pp_rank"])
            if not 0 <= pp_rank < plan.pp:
                raise WorkerError("protocol", f"write: pp_rank {pp_rank} is not a stage of the plan")
            for part in stage.get("parts", []):
                for layer, names in _layer_groups(plan, pp_rank, part):
                    where = "every layer at once" if layer == WHOLE_RANK else f"layer {layer + 1} of {plan.num_layers}"
                    channel.log(f"stage {pp_rank}: {where}")
                    hf = layer_hf_tensors(channel, plan, layer, cache)
                    for tp_rank in range(plan.tp):
                        state, saved, model = load_pseudo_stage(plan, layer, tp_rank, hf)
                        send_group(channel, plan, pp_rank, tp_rank, names, state, saved, kept)
                        release_weights(model)  # one rank's weights alive at a time, without a gc per rank
                        del state, saved, model
                    gc.collect()  # a built vLLM model sits in reference cycles: once per layer group
    finally:
        cache.drop()
        gc.collect()
    channel.send(
        {
            "type": "written",
            "seconds": round(time.perf_counter() - started, 3),
            "peak_rss_mib": peak_rss_mib(),
            "kept_construction_value": sorted(set(kept)),
        }
    )


# --- check -------------------------------------------------------------------------------------------------


def check_loader() -> str:
    try:
        import runai_model_streamer  # noqa: F401
    except ImportError:
        return "sharded_state"
    return "runai_streamer_sharded"


def check_rank(plan: Plan, pp_rank: int, tp_rank: int, request: dict[str, Any], loader_name: str) -> list[str]:
    """The full rank model loaded by vLLM's own ShardedStateLoader from DEST: the problems found."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    problems = []
    with pp_partition(plan.partition), emulate_rank(plan.tp, tp_rank, plan.pp, pp_rank):
        config = make_vllm_config(plan.request, loader_name, request.get("pattern"), str(request["dest_dir"]))
        model = build_model(config)
        loader = get_model_loader(config.load_config)
        try:  # load_weights only: process_weights_after_loading is load_model's, after it
            with set_current_vllm_config(config), torch.no_grad():
                loader.load_weights(model, config.model_config)
        except Exception as error:  # noqa: BLE001 - vLLM's verdict on the files
            return [f"vLLM {type(loader).__name__}.load_weights: {one_line(error)}"]
    state = ShardedStateLoader._filter_subtensors(model.state_dict())
    sent = plan.sent.get((pp_rank, tp_rank), {})
    for name in plan.stages[pp_rank]:
        if name not in state:
            problems.append(f"{name}: not in the loaded model")
        elif name in sent and hashlib.sha256(raw_bytes(state[name])).hexdigest() != sent[name]:
            problems.append(f"{name}: loaded bytes differ from the written ones (sha256)")
    problems += [f"{name}: loaded but not planned" for name in state if name not in plan.stages[pp_rank]]
    release_weights(model)  # its storage outlives the module objects otherwise: each rank's would add up
    del model, state
    gc.collect()
    return problems


def op_check(channel: Channel, plan: Plan | None, request: dict[str, Any]) -> None:
    if plan is None or not request.get("dest_dir"):
        raise WorkerError("protocol", "check needs a plan and a dest_dir")
    loader_name, limit = check_loader(), request.get("max_rank_bytes")
    ranks = []
    for pp_rank, tp_rank in sorted(plan.sent):
        size = sum(planned_nbytes(t) for t in plan.stages[pp_rank].values())
        entry: dict[str, Any] = {"pp_rank": pp_rank, "tp_rank": tp_rank, "ok": False, "tensors": 0, "problems": []}
        if limit is not None and size > int(limit):
            entry.update(ok=True, skipped=f"the rank holds {size} bytes, over max_rank_bytes {limit}")
        else:
            channel.log(f"checking rank (pp {pp_rank}, tp {tp_rank}) with vLLM's {loader_name} loader", force=True)
            entry["problems"] = check_rank(plan, pp_rank, tp_rank, request, loader_name)
            entry.update(ok=not entry["problems"], tensors=len(plan.sent[(pp_rank, tp_rank)]), skipped=None)
        ranks.append(entry)
    channel.send({"type": "checked", "loader": loader_name, "ranks": ranks, "peak_rss_mib": peak_rss_mib()})


def planned_nbytes(tensor: PlannedTensor) -> int:
    import torch

    count = 1
    for size in tensor.shape:
        count *= size
    return count * int(getattr(torch, SAFETENSORS_DTYPES[tensor.dtype]).itemsize)


# --- the loop ----------------------------------------------------------------------------------------------


def _drain(channel: Channel, header: dict[str, Any]) -> None:
    left = int(header.get("nbytes", 0) or 0)
    while left > 0:
        chunk = channel.inp.read(min(left, 1 << 20))
        if not chunk:
            raise ProtocolError("stdin ended inside a frame")
        left -= len(chunk)


def error_frame(error: BaseException) -> dict[str, Any]:
    kind = (
        error.kind if isinstance(error, WorkerError) else "protocol" if isinstance(error, ProtocolError) else "internal"
    )
    if kind not in ERROR_KINDS:
        kind = "internal"
    message = one_line(error)
    if kind == "internal" and not isinstance(error, WorkerError):
        message = f"{type(error).__name__}: {message}"
    detail = "".join(traceback.format_exception(error)[-6:])[-4000:]
    return {"type": "error", "kind": kind, "message": message, "detail": detail}


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
        vllm_shims.install()
        quiet_repeated_vllm_logs()
        init_vllm()
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
