"""Write vLLM sharded-state files (`model-rank-{rank}-part-{part}.safetensors`) on a CPU, locally or into a bucket.

What gets written is decided by one table, `streamctl.checkpoint.vllm_layouts` (names, sources and splits per vLLM
version range); this module plans, writes and checks by it.

Plan first, then write. Every output file's tensor list, shapes and dtypes follow from the source headers
and config.json alone, so each file's header is known before its first data byte and the file can be
streamed: header, then tensors, through the store's multipart upload (for a local folder, a hidden
temporary file). Nothing is visible under a final name until every file is written: uploads are completed
together at the end, and any failure before that aborts all of them.

Completion is explicit: before its first byte a run writes its manifest with `"complete": false`, then the
small serving files (config, tokenizer), then the weights, removes (with --force) what earlier streamctl
runs wrote and this one does not (streamctl.ownership), checks, and replaces the manifest with the completed
one last. A run killed or out of space anywhere leaves a DEST that `verify-index` (`shard-incomplete`) and
`serve` refuse; one that fails in-process before its weights are committed removes what it began with.

Memory is bounded by buffers, not by tensors (so it stays below the largest tensor plus buffers). Each
tensor is cut into blocks of whole source rows of about `READ_BLOCK` bytes (`tensor_blocks`), each read
with one ranged read of the source (a local file or a bucket object alike; a few reads run ahead) and cut
for the TP ranks that need it: rows a rank holds whole are passed on as read, column slices and casts are
copied. One writer thread per rank appends them to its file in order; a byte budget bounds what is read but
not yet written. The TP ranks of a stage share names, shapes and dtypes, so they are written in lockstep,
part by part, and rows several ranks hold (replicated tensors, shared KV heads) are read once.

Order: tensors are assigned to parts in `model.state_dict()` order after vLLM's `_filter_subtensors` (what
vLLM's `save_model` iterates); within a file they are laid out the way `safetensors.save_file` lays them
out (descending dtype alignment, then name), so a file is byte-identical to what vLLM's save would write.

After writing, two checks fail the run: `verify_checkpoint` on DEST (sharded layout, exact TP/PP and
pattern), and a reconstruction check that reads every rank's tensors back from DEST, block by block from the
offsets the files' own headers state, and compares them bit for bit with the (cast) source rows and columns
they must hold, checking that the ranks together cover every source element and that padding is zero.

The library never prints; it reports through `Progress`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from streamctl import __version__
from streamctl.errors import (
    IntegrityError,
    MissingProgramError,
    NotFoundError,
    StreamctlError,
    UsageError,
    VerificationFailed,
)
from streamctl.checkpoint.index import INDEX_NAME, MAX_INDEX_BYTES, parse_index
from streamctl.checkpoint.files import (
    CONFIG_NAME,
    MAX_CONFIG_BYTES,
    MISTRAL_PARAMS_NAME,
    SHARD_MANIFEST_NAME,
    listing_notes,
    read_config_references,
    log_notes,
    notes_to_json,
    select_serving_files,
    skipped_because,
)
from streamctl.interrupts import Shielded, shielded_calls
from streamctl.locations import check_disjoint
from streamctl.ownership import (
    Cleanup,
    LeftAlone,
    plan_cleanup,
    read_manifests,
    remove_files,
    shard_run_incomplete,
    unfollowed_links,
    written_by_streamctl,
)
from streamctl.limits import check_parallel_sizes, shown_number
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.retry import RetryPolicy, with_retries
from streamctl.checkpoint.safetensors import (
    DTYPE_BITS,
    HEADER_LENGTH_BYTES,
    ParsedHeader,
    decode_json_strictly,
    encode_safetensors_header,
    parse_header,
    read_header,
)
from streamctl.checkpoint.vllm_layouts import (
    EMBED_RULE,
    FINAL_NORM_RULE,
    LM_HEAD_RULE,
    SCALE_BUFFER_DTYPE,
    TIED_LM_HEAD_RULE,
    VOCAB_PADDING,
    ArchitectureLayout,
    LayoutRow,
    Split,
    TensorRule,
    installed_vllm_version,
    layout_row,
    parse_version,
)
from streamctl.lease import Lease, hold_lease
from streamctl.checkpoint.sharded_names import (
    default_pattern,
    format_name,
    pattern_fields,
    validate_pattern,
)
from streamctl.storage.base import ListingNote, Location, MiB, MultipartUpload, ObjectInfo
from streamctl.words import plural
from streamctl.storage.local import LocalMultipartUpload
from streamctl.transfer import SHA256_KEY, ByteBudget, discard_unfinished_uploads, part_size_for, put_json
from streamctl.verify.report import SHARD_INCOMPLETE_CODE, VerifyOptions, VerifyReport
from streamctl.verify.run import verify_checkpoint

if TYPE_CHECKING:
    import numpy as np

GiB = 1024 * MiB
DEFAULT_MAX_PART_SIZE = 5 * GiB  # vLLM's save_sharded_state script default
# Multipart part size (S3 needs >= 5 MiB), and about the size of every block read, copied or cast.
UPLOAD_CHUNK = 8 * MiB  # multipart part size for buckets (fewer, larger requests per rank stream)
# Source rows are read, sliced and written in blocks of about this size. Measured here (3.1 GB, local
# DEST): 4 MiB blocks shard in 2.0-2.2 s at TP 2 where 8 MiB blocks took 3.4-4.1 s, with a third of the
# kernel time; 2 MiB is no faster and costs more Python per byte.
READ_BLOCK = 4 * MiB
READ_AHEAD = 4  # block reads in flight (they also overlap the writes)
MAX_BUFFER = 128 * MiB  # bytes read (and copied) but not yet written, at most
RECONSTRUCTION_THREADS = 2  # tensors checked side by side (each holds ~2 blocks)
SCALE_ONE_BYTES = b"\x00\x00\x80\x3f"  # float32 1.0, little-endian: vLLM's attention scale buffers
# Hugging Face checkpoints of old models carry rotary caches that vLLM's loaders skip.
IGNORED_SOURCE_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

_T = TypeVar("_T")
DtypeChoice = Literal["auto", "bfloat16", "float16", "float32"]
Engine = Literal["offline", "vllm"]
DTYPE_CHOICES: Mapping[str, str | None] = {"auto": None, "bfloat16": "BF16", "float16": "F16", "float32": "F32"}
CASTABLE_DTYPES = frozenset({"BF16", "F16", "F32"})


# =============================================================================================== options


@dataclass(frozen=True)
class ShardOptions:
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    pattern: str | None = None  # None: vLLM's default for the PP size
    max_part_size: int = DEFAULT_MAX_PART_SIZE
    dtype: DtypeChoice = "auto"  # auto keeps each tensor's checkpoint dtype
    vllm_version: str | None = None  # None: the installed vllm's, else the newest layout row
    engine: Engine = "offline"
    force: bool = False
    layer_partition: str | None = None  # VLLM_PP_LAYER_PARTITION, e.g. "5,5,6"
    upload_chunk: int = UPLOAD_CHUNK  # part size of bucket uploads
    read_block: int = READ_BLOCK  # block size of the reads (and of the check's comparisons)
    max_buffer: int = MAX_BUFFER
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def validate(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise UsageError(
                f"parallel sizes must be at least 1 (TP {shown_number(self.tensor_parallel_size)}, "
                f"PP {shown_number(self.pipeline_parallel_size)})",
                code="bad-option-value",
            )
        check_parallel_sizes(self.tensor_parallel_size, self.pipeline_parallel_size)
        if self.vllm_version is not None:
            parse_version(self.vllm_version)  # before any I/O, not when the plan picks the layout row
        if self.max_part_size < 1:
            raise UsageError("--max-part-size must be positive")
        if self.dtype not in DTYPE_CHOICES:
            raise UsageError(f"unknown --dtype {self.dtype!r}", hint=f"use one of {', '.join(DTYPE_CHOICES)}")
        if self.engine not in ("offline", "vllm"):
            raise UsageError(f"unknown --engine {self.engine!r}", hint="use offline or vllm")
        if self.upload_chunk < 1 or self.read_block < 1 or self.max_buffer < self.read_block:
            raise UsageError("the upload chunk and read block must be positive, the block no larger than the buffer")


# =============================================================================================== model


@dataclass(frozen=True)
class ModelDims:
    """The numbers from config.json that decide names and shapes (notation of the spec)."""

    architecture: str
    hidden_size: int  # H
    num_heads: int  # nh
    num_kv_heads: int  # nkv
    head_dim: int  # d
    intermediate_size: int  # I
    vocab_size: int  # V
    num_layers: int
    tied: bool

    @property
    def padded_vocab_size(self) -> int:  # Vp
        return -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING


@dataclass(frozen=True)
class SourceTensor:
    name: str
    file: str  # relative to the source location
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class Segment:
    """One run of a rank's tensor: rows (axis 0) or columns (axis 1) [start, stop) of source `source`,
    `stop - start` zero rows (`source` None), or the whole source (`axis` None)."""

    source: int | None
    axis: int | None
    start: int
    stop: int


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of every TP rank of a stage (same name, shape and dtype on each rank)."""

    name: str
    split: Split
    sources: tuple[SourceTensor, ...]
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        elements = 1
        for dim in self.shape:
            elements *= dim
        return elements * DTYPE_BITS[self.dtype] // 8


@dataclass(frozen=True)
class StagePlan:
    pp_rank: int
    layers: range
    parts: tuple[tuple[PlannedTensor, ...], ...]  # state-dict order, split at max_part_size

    @property
    def tensors(self) -> tuple[PlannedTensor, ...]:
        return tuple(tensor for part in self.parts for tensor in part)


@dataclass(frozen=True)
class PlannedFile:
    name: str
    pp_rank: int
    tp_rank: int
    part: int
    tensors: tuple[PlannedTensor, ...]  # in file (byte) order
    header: bytes  # 8-byte length + padded JSON

    @property
    def size(self) -> int:
        return len(self.header) + sum(tensor.nbytes for tensor in self.tensors)


@dataclass(frozen=True)
class ShardPlan:
    source: str
    dest: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    pattern: str
    vllm_version: str | None  # what picked the row (given or installed); None: newest row by default
    row: LayoutRow
    dims: ModelDims
    dtype: DtypeChoice
    max_part_size: int
    stages: tuple[StagePlan, ...]
    serving_files: tuple[tuple[str, int], ...]  # (path, size) of the non-weight files to copy
    stale: tuple[str, ...]  # DEST files earlier streamctl runs wrote that --force removes (see streamctl.ownership)
    tied_lm_head: SourceTensor | None  # the checkpoint's own lm_head when config says tied: must equal embed
    left_alone: tuple[LeftAlone, ...] = ()  # DEST files this run neither writes nor removes
    # (path, size, etag) of every source weight file: a re-run may reuse DEST files only if none changed.
    source_files: tuple[tuple[str, int, str | None], ...] = ()
    # DEST rank files a completed earlier run of this same plan left, unchanged: path -> their sha256.
    reused: Mapping[str, str] = field(default_factory=dict)

    def files(self) -> list[PlannedFile]:
        return [file for stage in self.stages for file in stage_files(self, stage)]

    @property
    def total_bytes(self) -> int:
        return sum(file.size for file in self.files())


# =============================================================================================== results


@dataclass(frozen=True)
class WrittenFile:
    path: str
    pp_rank: int
    tp_rank: int
    part: int
    size: int
    sha256: str
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape) in file order


@dataclass(frozen=True)
class CopiedFile:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ReconstructionReport:
    ok: bool
    tensors: int  # source tensors reassembled and compared
    bytes_compared: int
    problems: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tensors": self.tensors,
            "bytes_compared": self.bytes_compared,
            "problems": list(self.problems),
        }


@dataclass(frozen=True)
class ShardResult:
    plan: ShardPlan
    engine: Engine
    files: tuple[WrittenFile, ...]
    copied: tuple[CopiedFile, ...]
    removed: tuple[str, ...]
    bytes_written: int
    seconds: float  # the whole run: plan, write, copy and both checks
    write_seconds: float  # planning and writing the weights, until every file is complete
    verify: VerifyReport
    reconstruction: ReconstructionReport | None  # None: architecture outside the table (--engine vllm)
    discarded: tuple[str, ...] = ()  # unfinished uploads of earlier runs removed first
    notes: tuple[ListingNote, ...] = ()  # SOURCE entries left out (FIFOs, links not followed) or read through links
    skipped: tuple[str, ...] = ()  # rank files already in DEST from an identical earlier run, not rewritten

    @property
    def ok(self) -> bool:
        return self.verify.ok and (self.reconstruction is None or self.reconstruction.ok)

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_written / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "source": plan.source,
            "dest": plan.dest,
            "tensor_parallel_size": plan.tensor_parallel_size,
            "pipeline_parallel_size": plan.pipeline_parallel_size,
            "pattern": plan.pattern,
            "vllm_version": plan.vllm_version,
            "layout": plan.row.label,
            "engine": self.engine,
            "dtype": plan.dtype,
            "files": [
                {
                    "path": file.path,
                    "rank": file.tp_rank,
                    "tp_rank": file.tp_rank,
                    "pp_rank": file.pp_rank,
                    "part": file.part,
                    "size": file.size,
                    "sha256": file.sha256,
                    "tensors": len(file.tensors),
                }
                for file in self.files
            ],
            "copied": [{"path": file.path, "size": file.size, "sha256": file.sha256} for file in self.copied],
            "removed": list(self.removed),
            "left_alone": [item.to_json() for item in self.plan.left_alone],
            "skipped": list(self.skipped),
            "discarded_uploads": list(self.discarded),
            **notes_to_json(self.notes),
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "write_seconds": round(self.write_seconds, 3),
            "throughput_mb_s": round(self.throughput_mb_s, 2),
            "checks": {
                "verify": self.verify.to_json(),
                "reconstruction": self.reconstruction.to_json() if self.reconstruction else None,
            },
        }


class ShardCheckFailed(VerificationFailed):
    """The files were written, but a post-write check failed (exit 1); `result` says which."""

    code = "shard-check-failed"

    def __init__(self, result: ShardResult) -> None:
        reconstruction_ok = result.reconstruction is None or result.reconstruction.ok
        failed = [name for name, ok in (("verify", result.verify.ok), ("reconstruction", reconstruction_ok)) if not ok]
        super().__init__(
            f"{result.plan.dest}: the {' and '.join(failed)} check failed after writing",
            hint="the files are left in place for inspection, marked incomplete (verify-index and serve refuse "
            "them); see the report",
        )
        self.result = result


# =============================================================================================== pure layout rules


def pipeline_stages(
    num_layers: int, pipeline_parallel_size: int, layer_partition: str | None = None
) -> tuple[range, ...]:
    """The layers of each stage, as vLLM 0.33's `get_pp_indices` assigns them.

    Even split; a remainder goes one layer each to the stages just before the last (p-2, then p-3, ...).
    `layer_partition` ("a,b,...", vLLM's VLLM_PP_LAYER_PARTITION) overrides it.
    """
    size = pipeline_parallel_size
    if layer_partition is not None:
        try:
            counts = [int(item) for item in layer_partition.split(",")]
        except ValueError:
            raise UsageError(
                f"invalid VLLM_PP_LAYER_PARTITION {layer_partition!r}", hint="write layer counts like 5,5,6"
            ) from None
        if len(counts) != size:
            raise UsageError(
                f"VLLM_PP_LAYER_PARTITION {layer_partition!r} has {len(counts)} stages; "
                f"--pipeline-parallel-size is {size}"
            )
        if sum(counts) != num_layers or any(count < 0 for count in counts):
            raise UsageError(
                f"VLLM_PP_LAYER_PARTITION {layer_partition!r} sums to {sum(counts)}; the model has {num_layers} layers"
            )
    else:
        counts = [num_layers // size] * size
        for index in range(2, num_layers % size + 2):
            counts[-index] += 1
    starts = [sum(counts[:stage]) for stage in range(size)]
    return tuple(range(start, start + count) for start, count in zip(starts, counts))


def rank_segments(
    split: Split, source_shapes: Sequence[tuple[int, ...]], dims: ModelDims, tp: int, rank: int
) -> tuple[Segment, ...]:
    """Which rows or columns of which source tensor make up rank `rank`'s tensor, in order (the spec's table)."""
    if split is Split.SCALE_ONE:
        return ()
    if split is Split.REPLICATED:
        shape = source_shapes[0]
        return (Segment(0, 0, 0, shape[0]),) if shape else (Segment(0, None, 0, 0),)
    if split is Split.VOCAB_ROWS:
        per_rank = dims.padded_vocab_size // tp
        start = rank * per_rank
        real = max(0, min(start + per_rank, dims.vocab_size) - start)
        segments = [Segment(0, 0, start, start + real)] if real else []
        if real < per_rank:
            segments.append(Segment(None, 0, 0, per_rank - real))  # padding rows, zero
        return tuple(segments)
    if split is Split.QKV_ROWS:
        q_rows = dims.num_heads // tp * dims.head_dim
        kv_rows = max(1, dims.num_kv_heads // tp) * dims.head_dim
        block = rank // max(1, tp // dims.num_kv_heads)  # ranks share a KV head when TP > nkv
        return (
            Segment(0, 0, rank * q_rows, (rank + 1) * q_rows),
            Segment(1, 0, block * kv_rows, (block + 1) * kv_rows),
            Segment(2, 0, block * kv_rows, (block + 1) * kv_rows),
        )
    if split is Split.MERGED_ROWS:
        return tuple(
            Segment(index, 0, rank * (shape[0] // tp), (rank + 1) * (shape[0] // tp))
            for index, shape in enumerate(source_shapes)
        )
    if split is Split.COLUMNS:
        columns = source_shapes[0][1] // tp
        return (Segment(0, 1, rank * columns, (rank + 1) * columns),)
    raise AssertionError(f"unknown split {split}")


def segments_shape(segments: Sequence[Segment], source_shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of the tensor the segments make up."""
    if not segments:
        return ()
    first = segments[0]
    if first.axis is None:
        return source_shapes[0]
    if first.axis == 1:
        shape = source_shapes[0]
        return (shape[0], first.stop - first.start, *shape[2:])
    return (sum(segment.stop - segment.start for segment in segments), *source_shapes[0][1:])


def _check_source_shapes(
    rule: TensorRule, name: str, shapes: Sequence[tuple[int, ...]], dims: ModelDims, tp: int
) -> None:
    """The source tensors must have the shapes config.json implies; otherwise the split would be wrong."""

    def refuse(expected: str) -> UsageError:
        got = ", ".join(f"{source} {list(shape)}" for source, shape in zip(rule.sources, shapes))
        return UsageError(f"{name}: source tensors have shapes {got}; config.json implies {expected}")

    if rule.split is Split.VOCAB_ROWS:
        if len(shapes[0]) != 2 or shapes[0][0] != dims.vocab_size:
            raise refuse(f"[vocab_size={dims.vocab_size}, hidden_size={dims.hidden_size}]")
    elif rule.split is Split.QKV_ROWS:
        q_rows, kv_rows = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
        if (
            not all(shapes)
            or [shape[0] for shape in shapes] != [q_rows, kv_rows, kv_rows]
            or len({shape[1:] for shape in shapes}) != 1
        ):
            raise refuse(f"{q_rows}, {kv_rows} and {kv_rows} rows (heads x head_dim {dims.head_dim})")
    elif rule.split is Split.MERGED_ROWS:
        if not all(shapes) or len({shape[1:] for shape in shapes}) != 1 or any(shape[0] % tp for shape in shapes):
            raise refuse(f"rows divisible by TP {tp} and equal trailing dimensions")
    elif rule.split is Split.COLUMNS and (len(shapes[0]) != 2 or shapes[0][1] % tp):
        raise refuse(f"2 dimensions with the second divisible by TP {tp}")


def safetensors_order(tensors: Sequence[PlannedTensor]) -> list[PlannedTensor]:
    """The order `safetensors.save_file` lays tensors out in: descending dtype alignment, then by name."""
    return sorted(tensors, key=lambda tensor: (-_SAFETENSORS_DTYPE_RANK.get(tensor.dtype, 0), tensor.name))


# safetensors' Dtype enum is declared in increasing alignment order; sort keys follow its position.
_SAFETENSORS_DTYPE_ORDER = (
    "BOOL F4 F6_E2M3 F6_E3M2 U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ I16 U16 F16 BF16 I32 U32 F32 "
    "C64 F64 I64 U64"
)
_SAFETENSORS_DTYPE_RANK: Mapping[str, int] = {name: rank for rank, name in enumerate(_SAFETENSORS_DTYPE_ORDER.split())}


def split_into_parts(tensors: Sequence[PlannedTensor], max_part_size: int) -> tuple[tuple[PlannedTensor, ...], ...]:
    """vLLM's rule: a new part when adding the next tensor would exceed the limit; never an empty part
    (so a tensor larger than the limit goes alone)."""
    parts: list[list[PlannedTensor]] = []
    total = 0
    for tensor in tensors:
        if not parts or total + tensor.nbytes > max_part_size:  # the current part is never empty
            parts.append([])
            total = 0
        parts[-1].append(tensor)
        total += tensor.nbytes
    return tuple(tuple(part) for part in parts)


def stage_files(plan: ShardPlan, stage: StagePlan) -> list[PlannedFile]:
    files = []
    for part_index, part in enumerate(stage.parts):
        ordered = tuple(safetensors_order(part))
        header, _ = encode_safetensors_header(
            [(tensor.name, tensor.dtype, tensor.shape, tensor.nbytes) for tensor in ordered]
        )
        for tp_rank in range(plan.tensor_parallel_size):
            name = format_name(plan.pattern, tp_rank=tp_rank, pp_rank=stage.pp_rank, part=part_index)
            files.append(PlannedFile(name, stage.pp_rank, tp_rank, part_index, ordered, header))
    return files


# =============================================================================================== planning


def _read_small(location: Location, name: str, size: int, limit: int = MAX_CONFIG_BYTES) -> bytes:
    if size > limit:
        raise UsageError(f"{location.store.url(location.key(name))} is {size:,} bytes; refusing to read it as JSON")
    return location.store.read_range(location.key(name), 0, size)


def _read_json_object(location: Location, name: str, size: int) -> dict[str, Any]:
    document = decode_json_strictly(_read_small(location, name, size), what=name)
    if document.error is not None or not isinstance(document.value, dict):
        raise UsageError(f"{location.store.url(location.key(name))} is not a JSON object")
    return document.value


def _engine_hint() -> str:
    return "use --engine vllm, which runs vLLM's own save path (needs vllm and GPUs)"


def _int_field(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def read_dims(config: Mapping[str, Any], layout: ArchitectureLayout, architecture: str) -> ModelDims:
    hidden = _int_field(config, "hidden_size")
    heads = _int_field(config, "num_attention_heads")
    kv_heads = _int_field(config, "num_key_value_heads", heads)
    configured_head_dim = config.get("head_dim")
    derived_head_dim = hidden // heads
    if layout.head_dim_from_config and configured_head_dim is not None:
        head_dim = _int_field(config, "head_dim")
    else:
        if configured_head_dim not in (None, derived_head_dim):
            raise UsageError(
                f"config.json: head_dim {configured_head_dim} differs from hidden_size / num_attention_heads "
                f"({derived_head_dim}), which vLLM's {architecture} always uses",
                hint=_engine_hint(),
            )
        head_dim = derived_head_dim
    if heads % kv_heads:
        raise UsageError(
            f"config.json: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
        )
    return ModelDims(
        architecture=architecture,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_int_field(config, "intermediate_size"),
        vocab_size=_int_field(config, "vocab_size"),
        num_layers=_int_field(config, "num_hidden_layers"),
        tied=bool(config.get("tie_word_embeddings", False)),  # False is the default of all four configs
    )


def check_tensor_parallel(dims: ModelDims, tp: int) -> None:
    """vLLM's constraints on the TP size; UsageError naming the constraint and the values."""
    if dims.num_heads % tp:
        raise UsageError(f"--tensor-parallel-size {tp} does not divide num_attention_heads ({dims.num_heads})")
    if dims.num_kv_heads % tp and tp % dims.num_kv_heads:
        raise UsageError(
            f"--tensor-parallel-size {tp} must divide num_key_value_heads ({dims.num_kv_heads}) or be a multiple of it"
        )
    if dims.intermediate_size % tp:
        raise UsageError(f"--tensor-parallel-size {tp} does not divide intermediate_size ({dims.intermediate_size})")
    if dims.padded_vocab_size % tp:
        raise UsageError(
            f"--tensor-parallel-size {tp} does not divide the padded vocabulary ({dims.padded_vocab_size}: "
            f"vocab_size {dims.vocab_size} rounded up to a multiple of {VOCAB_PADDING})"
        )


def _check_supported(config: Mapping[str, Any], row: LayoutRow) -> tuple[str, ArchitectureLayout]:
    if config.get("quantization_config") is not None:
        method = (
            config["quantization_config"].get("quant_method")
            if isinstance(config["quantization_config"], dict)
            else None
        )
        raise UsageError(
            f"the checkpoint is quantized ({method or 'quantization_config'}); the offline writer handles "
            "unquantized checkpoints only",
            hint=_engine_hint(),
        )
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1 or not isinstance(architectures[0], str):
        raise UsageError(
            f"config.json: architectures must name one model class, not {architectures!r}", hint=_engine_hint()
        )
    architecture = architectures[0]
    layout = row.architecture(architecture)
    if layout is None:
        raise UsageError(
            f"{architecture} is not supported by the offline writer ({', '.join(row.supported_architectures)})",
            hint=_engine_hint(),
        )
    if config.get("hidden_act", "silu") != "silu":
        raise UsageError(
            f"config.json: hidden_act {config.get('hidden_act')!r}; vLLM's {architecture} supports silu only"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("use_fope"):
        raise UsageError(
            "Fourier rotary embeddings (use_fope) carry parameters the offline writer does not lay out",
            hint=_engine_hint(),
        )
    if config.get("ada_rms_norm_t_cond"):
        raise UsageError("ada_rms_norm_t_cond layers are not laid out by the offline writer", hint=_engine_hint())
    if "text_config" in config:
        raise UsageError(
            f"{architecture} with a nested text_config is not supported by the offline writer", hint=_engine_hint()
        )
    return architecture, layout


@dataclass(frozen=True)
class _SourceListing:
    sizes: Mapping[str, int]  # every object, by path relative to the source
    etags: Mapping[str, str | None] = field(default_factory=dict)


def _serving_files(
    source: Location, listing: _SourceListing, config: Mapping[str, Any]
) -> tuple[tuple[str, int], ...]:
    """(path, size) of what DEST gets beside the weights (config, tokenizer, custom code when auto_map, and
    what the configs reference, such as sentence-transformers module folders)."""
    referenced = read_config_references(source, listing.sizes, {"config.json": config} if config else {})
    paths = select_serving_files(listing.sizes, has_auto_map=bool(config.get("auto_map")), referenced=referenced)
    return tuple((path, listing.sizes[path]) for path in paths)


def _list_source(source: Location) -> _SourceListing:
    infos = {source.relative(info.key): info for info in source.list()}
    infos = {name: info for name, info in infos.items() if name}
    if not infos:
        raise NotFoundError(f"nothing found under {source.url}")
    return _SourceListing({name: info.size for name, info in infos.items()}, {name: info.etag for name, info in infos.items()})


def _weight_files(source: Location, listing: _SourceListing) -> list[str]:
    top = {name: size for name, size in listing.sizes.items() if "/" not in name}
    if INDEX_NAME in top:
        files = parse_index(INDEX_NAME, _read_small(source, INDEX_NAME, top[INDEX_NAME], MAX_INDEX_BYTES)).files
        missing = [file for file in files if file not in top]
        if missing:
            raise NotFoundError(f"{INDEX_NAME} names {missing[0]}, which is not in {source.url}")
        return files
    files = sorted(name for name in top if name.endswith(".safetensors") and not name.startswith("consolidated"))
    if files:
        return files
    if any(name.startswith("consolidated") and name.endswith(".safetensors") for name in top) or MISTRAL_PARAMS_NAME in top:
        raise UsageError(
            f"{source.url} holds Mistral-format consolidated weights, not Hugging Face safetensors", hint=_engine_hint()
        )
    if any(name.startswith("original/") for name in listing.sizes):
        raise UsageError(
            f"{source.url} holds only Meta original/ weights, not Hugging Face safetensors", hint=_engine_hint()
        )
    raise NotFoundError(f"no .safetensors files under {source.url}")


def _read_source_tensors(source: Location, listing: _SourceListing, files: Sequence[str]) -> dict[str, SourceTensor]:
    tensors: dict[str, SourceTensor] = {}
    for file in files:
        size = listing.sizes[file]
        read = read_header(source.store, source.key(file), size)
        if read.header_json is None:
            assert read.problem is not None
            raise UsageError(f"{source.store.url(source.key(file))}: {read.problem.message}")
        header = parse_header(read.header_json, size)
        if not header.ok:
            problem = next(problem for problem in header.problems if problem.severity == "error")
            raise UsageError(f"{source.store.url(source.key(file))}: {problem.message}")
        data_start = HEADER_LENGTH_BYTES + header.header_length
        for info in header.tensors:
            if info.name in tensors:
                raise UsageError(f"tensor {info.name} is in both {tensors[info.name].file} and {file}")
            tensors[info.name] = SourceTensor(
                info.name, file, info.dtype, info.shape, data_start + info.begin, info.nbytes
            )
    return tensors


def _output_dtype(name: str, sources: Sequence[SourceTensor], choice: DtypeChoice) -> str:
    dtypes = {source.dtype for source in sources}
    target = DTYPE_CHOICES[choice]
    if target is None:
        if len(dtypes) != 1:
            raise UsageError(
                f"{name}: its sources have different dtypes ({', '.join(sorted(dtypes))})", hint="pass --dtype"
            )
        return dtypes.pop()
    uncastable = sorted(dtypes - CASTABLE_DTYPES)
    if uncastable:
        raise UsageError(f"{name}: cannot cast {uncastable[0]} to {target}; --dtype handles BF16, F16 and F32 sources")
    return target


def _stage_rules(
    row: LayoutRow,
    layout: ArchitectureLayout,
    config: Mapping[str, Any],
    dims: ModelDims,
    layers: range,
    first: bool,
    last: bool,
) -> Iterator[tuple[str, TensorRule]]:
    """(vLLM name, rule) for every tensor of one stage, in the order vLLM's save iterates them."""
    if last and dims.tied:
        # The embedding and lm_head share storage: `_filter_subtensors` keeps lm_head.weight, at the
        # position of the shared storage's first name (the embedding's, first in the state dict).
        yield TIED_LM_HEAD_RULE.name, TIED_LM_HEAD_RULE
    elif first:
        yield EMBED_RULE.name, EMBED_RULE
    for layer in layers:
        prefix = f"model.layers.{layer}."
        for rule in layout.layer_rules:
            if rule.split is Split.SCALE_ONE:
                for buffer in row.attention_scale_buffers:
                    yield f"{prefix}{rule.name}.{buffer}", rule
            elif rule.when is None or layout.features[rule.when](config):
                sources = tuple(prefix + source for source in rule.sources)
                yield prefix + rule.name, TensorRule(prefix + rule.name, rule.split, sources)
    if last:
        yield FINAL_NORM_RULE.name, FINAL_NORM_RULE
        if not dims.tied:
            yield LM_HEAD_RULE.name, LM_HEAD_RULE


def _plan_tensor(
    name: str, rule: TensorRule, tensors: Mapping[str, SourceTensor], dims: ModelDims, tp: int, dtype: DtypeChoice
) -> PlannedTensor:
    if rule.split is Split.SCALE_ONE:
        return PlannedTensor(name, rule.split, (), SCALE_BUFFER_DTYPE, ())
    missing = [source for source in rule.sources if source not in tensors]
    if missing:
        raise UsageError(f"the checkpoint lacks {missing[0]}, which {name} is built from")
    sources = tuple(tensors[source] for source in rule.sources)
    quantized = sorted({source.dtype for source in sources if source.dtype.startswith(("F8", "F6", "F4"))})
    if quantized:
        raise UsageError(
            f"{name}: {quantized[0]} weights are quantized; the offline writer handles unquantized ones only",
            hint=_engine_hint(),
        )
    shapes = [source.shape for source in sources]
    _check_source_shapes(rule, name, shapes, dims, tp)
    shape = segments_shape(rank_segments(rule.split, shapes, dims, tp, 0), shapes)
    return PlannedTensor(name, rule.split, sources, _output_dtype(name, sources, dtype), shape)


def _check_every_source_used(tensors: Mapping[str, SourceTensor], stages: Sequence[StagePlan], tied: bool) -> None:
    used = {source.name for stage in stages for tensor in stage.tensors for source in tensor.sources}
    ignorable = {"lm_head.weight"} if tied else set()
    unknown = sorted(
        name
        for name in tensors
        if name not in used and name not in ignorable and not name.endswith(IGNORED_SOURCE_SUFFIXES)
    )
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise UsageError(
            f"the checkpoint holds tensors the layout table has no place for: {shown}", hint=_engine_hint()
        )


def _list_dest(dest: Location) -> dict[str, ObjectInfo]:
    try:
        return {dest.relative(info.key): info for info in dest.list()}
    except NotFoundError:
        if dest.store.scheme == "file":
            return {}  # a local folder is created on the first write
        raise


@dataclass(frozen=True)
class _DestState:
    """One listing of DEST and the streamctl manifests in it, read once per decision about DEST."""

    existing: dict[str, ObjectInfo]
    manifests: dict[str, dict[str, Any] | None]


def _read_dest(dest: Location) -> _DestState:
    existing = _list_dest(dest)
    return _DestState(existing, read_manifests(dest, {name: info.size for name, info in existing.items()}))


def _check_dest(
    dest: Location, pattern: str, writes: set[str], force: bool, state: _DestState | None = None
) -> Cleanup:
    """UsageError when DEST holds files and --force is not given; with it, what --force removes there (files
    a streamctl manifest of DEST names, and files matching `pattern`) and what it leaves alone."""
    state = state or _read_dest(dest)
    existing, manifests = state.existing, state.manifests
    candidates = [*existing, *unfollowed_links(listing_notes(dest))]
    written_before = written_by_streamctl(manifests, candidates)
    from streamctl.checkpoint.sharded_names import parse_sharded_name

    def own_output(name: str) -> bool:
        return parse_sharded_name(pattern, name) is not None

    if existing and not force:
        shown = ", ".join(sorted(existing)[:3]) + (", ..." if len(existing) > 3 else "")
        raise UsageError(
            f"{dest.url} already holds {plural(len(existing), 'file')} ({shown})",
            hint=(
                "these look like an interrupted shard run (its manifest is missing or incomplete); "
                "pass --force to write them again"
                if _looks_interrupted(existing, manifests.get(SHARD_MANIFEST_NAME), own_output)
                else "choose an empty destination, or pass --force to replace what streamctl wrote there"
            ),
        )
    return plan_cleanup(candidates, writes | {SHARD_MANIFEST_NAME}, written_before, own_output, force)


def _looks_interrupted(
    existing: Mapping[str, ObjectInfo], manifest: Mapping[str, Any] | None, own_output: Callable[[str], bool]
) -> bool:
    """A shard run that did not finish: its manifest says so, or there is none and DEST holds rank files of
    our pattern (a folder holding only other things, a Hugging Face checkpoint say, is not one)."""
    if SHARD_MANIFEST_NAME in existing:
        return shard_run_incomplete(manifest)
    return any(own_output(name) for name in existing)


def plan_shard(source: Location, dest: Location, options: ShardOptions, source_id: str | None = None) -> ShardPlan:
    """Read config.json and the source headers, check every constraint, and lay out every output file.

    Reads only small objects and headers; writes nothing.
    """
    options.validate()
    tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
    version = options.vllm_version if options.vllm_version is not None else installed_vllm_version()
    row = layout_row(version)
    if pp > 1 and not row.pipeline_parallel:
        raise UsageError(f"vLLM {version} ({row.label}) saves sharded state without pipeline parallelism; use PP 1")
    pattern = options.pattern or default_pattern(pp)
    unsupported = set(pattern_fields(pattern)) - row.pattern_fields
    if unsupported:
        raise UsageError(
            f"pattern {pattern!r} uses {{{min(unsupported)}}}, which vLLM {version} ({row.label}) does not fill in",
            hint="that vLLM fills in " + ", ".join(f"{{{name}}}" for name in sorted(row.pattern_fields)),
        )
    validate_pattern(pattern, tp, pp)
    check_disjoint(source, dest)

    listing = _list_source(source)
    if CONFIG_NAME not in listing.sizes:
        _weight_files(source, listing)  # a Mistral or Meta layout explains the missing config better
        raise NotFoundError(f"no {CONFIG_NAME} under {source.url}{skipped_because(source, CONFIG_NAME)}")
    config = _read_json_object(source, CONFIG_NAME, listing.sizes[CONFIG_NAME])
    architecture, layout = _check_supported(config, row)
    dims = read_dims(config, layout, architecture)
    check_tensor_parallel(dims, tp)
    stage_layers = pipeline_stages(dims.num_layers, pp, options.layer_partition)
    for pp_rank, layers in enumerate(stage_layers):
        if not layers and 0 < pp_rank < pp - 1:
            raise UsageError(
                f"pipeline stage {pp_rank} of {pp} gets no layers ({dims.num_layers} layers), "
                "so it would hold no tensors",
                hint="use fewer stages or set VLLM_PP_LAYER_PARTITION",
            )

    tensors = _read_source_tensors(source, listing, _weight_files(source, listing))
    stages = []
    for pp_rank, layers in enumerate(stage_layers):
        rules = _stage_rules(row, layout, config, dims, layers, pp_rank == 0, pp_rank == pp - 1)
        planned = [_plan_tensor(name, rule, tensors, dims, tp, options.dtype) for name, rule in rules]
        stages.append(StagePlan(pp_rank, layers, split_into_parts(planned, options.max_part_size)))
    _check_every_source_used(tensors, stages, dims.tied)

    plan = ShardPlan(
        source=source_id or source.url,
        dest=dest.url,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        pattern=pattern,
        vllm_version=version,
        row=row,
        dims=dims,
        dtype=options.dtype,
        max_part_size=options.max_part_size,
        stages=tuple(stages),
        serving_files=_serving_files(source, listing, config),
        stale=(),
        tied_lm_head=tensors.get("lm_head.weight") if dims.tied else None,
        source_files=tuple(
            (name, listing.sizes[name], listing.etags.get(name)) for name in sorted({t.file for t in tensors.values()})
        ),
    )
    return _plan_dest(dest, plan, options.force)


def _output_names(plan: ShardPlan) -> set[str]:
    return {file.name for file in plan.files()} | {path for path, _ in plan.serving_files}


def _plan_dest(dest: Location, plan: ShardPlan, force: bool) -> ShardPlan:
    """`plan` with what DEST holds decided: without --force, a DEST holding this very plan's completed output
    (unchanged source) keeps its right rank files and replaces the rest, as transfer does; any other
    non-empty DEST is refused. With --force, what streamctl wrote there is replaced (see _check_dest)."""
    state = _read_dest(dest)
    rerun = None if force else _same_plan_before(dest, plan, state)
    if rerun is None:
        cleanup = _check_dest(dest, plan.pattern, _output_names(plan), force, state)
        return replace(plan, stale=cleanup.to_remove, left_alone=cleanup.left_alone, reused={})
    cleanup = _check_dest(dest, plan.pattern, _output_names(plan), True, state)
    return replace(plan, stale=cleanup.to_remove, left_alone=cleanup.left_alone, reused=rerun)


def skipped_files(plan: ShardPlan) -> frozenset[str]:
    """The rank files a re-run leaves as they are: every TP rank of a part reused (they are cut from the
    same reads, so a part is skipped or written for all ranks together)."""
    if not plan.reused:
        return frozenset()
    skipped: set[str] = set()
    for stage in plan.stages:
        files = stage_files(plan, stage)
        for part_index in range(len(stage.parts)):
            names = [file.name for file in files if file.part == part_index]
            if all(name in plan.reused for name in names):
                skipped.update(names)
    return frozenset(skipped)


def _planned_ranks(plan: ShardPlan) -> list[dict[str, Any]]:
    """The rank files of `plan` as the manifest lists them, without the sha256 only writing learns."""
    return [
        {
            "path": file.name,
            "pp_rank": file.pp_rank,
            "tp_rank": file.tp_rank,
            "part": file.part,
            "size": file.size,
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in file.tensors],
        }
        for file in plan.files()
    ]


def _same_plan_before(dest: Location, plan: ShardPlan, state: _DestState) -> dict[str, str] | None:
    """When DEST holds the manifest of a completed run of the same plan from the same, unchanged source
    files: the rank files still there with the planned size and the manifest's sha256 (path -> sha256,
    possibly empty). None otherwise: then DEST is treated as any other non-empty destination."""
    existing = state.existing
    manifest = state.manifests.get(SHARD_MANIFEST_NAME)
    if manifest is None or shard_run_incomplete(manifest) or not plan.source_files:
        return None
    if any(etag is None for _, _, etag in plan.source_files):
        return None  # no way to tell that the source did not change
    same_settings = all(
        manifest.get(key) == value
        for key, value in (
            ("source", plan.source),
            ("engine", "offline"),
            ("tensor_parallel_size", plan.tensor_parallel_size),
            ("pipeline_parallel_size", plan.pipeline_parallel_size),
            ("pattern", plan.pattern),
            ("vllm_version", plan.vllm_version),
            ("layout", plan.row.label),
            ("dtype", plan.dtype),
            ("max_part_size", plan.max_part_size),
            ("source_files", [list(entry) for entry in plan.source_files]),
        )
    )
    if not same_settings:
        return None
    recorded: dict[str, dict[str, Any]] = {}
    for rank in manifest.get("ranks") or []:
        for file in (rank.get("files") or []) if isinstance(rank, dict) else []:
            if isinstance(file, dict) and isinstance(file.get("path"), str):
                recorded[file["path"]] = {**file, "pp_rank": rank.get("pp_rank"), "tp_rank": rank.get("tp_rank")}
    planned = _planned_ranks(plan)
    if sorted(recorded) != sorted(entry["path"] for entry in planned):
        return None
    for entry in planned:
        if any(recorded[entry["path"]].get(key) != value for key, value in entry.items()):
            return None
    reused: dict[str, str] = {}
    for entry in planned:
        found = existing.get(entry["path"])
        sha256 = recorded[entry["path"]].get("sha256")
        if found is None or found.size != entry["size"] or not isinstance(sha256, str):
            continue
        if found.metadata.get(SHA256_KEY) is None:
            found = dest.store.stat(found.key)  # S3 listings carry no user metadata
        if found.metadata.get(SHA256_KEY) == sha256:
            reused[entry["path"]] = sha256
    return reused


# =============================================================================================== casting


def _numpy() -> Any:
    import numpy  # lazily: `streamctl --help` and the other commands never load it

    return numpy


def storage_dtype(dtype: str) -> Any:
    """The unsigned integer numpy dtype with the element size of a safetensors dtype (data is moved as bits)."""
    np_ = _numpy()
    bits = DTYPE_BITS[dtype]
    if bits not in (8, 16, 32, 64):
        raise UsageError(f"{dtype} has {bits}-bit elements; the offline writer handles whole-byte dtypes only")
    return {8: np_.uint8, 16: np_.dtype("<u2"), 32: np_.dtype("<u4"), 64: np_.dtype("<u8")}[bits]


def _to_float32(bits: np.ndarray, dtype: str) -> np.ndarray:
    np_ = _numpy()
    if dtype == "F32":
        return bits.view(np_.float32)
    if dtype == "F16":
        return bits.view(np_.float16).astype(np_.float32)
    return (bits.astype(np_.uint32) << 16).view(np_.float32)  # BF16 is the top half of an F32: exact


def _from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    np_ = _numpy()
    if dtype == "F32":
        return values.view(np_.uint32)
    if dtype == "F16":
        with np_.errstate(over="ignore", invalid="ignore"):
            return values.astype(np_.float16).view(np_.uint16)  # IEEE round-to-nearest-even
    bits = values.view(np_.uint32)
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then drop the low half.
    rounded = ((bits + (np_.uint32(0x7FFF) + ((bits >> 16) & np_.uint32(1)))) >> 16).astype(np_.uint16)
    nan = np_.isnan(values)
    if nan.any():
        # Truncating a NaN whose payload sits in the low half would give infinity: keep it a quiet NaN.
        rounded[nan] = ((bits[nan] >> 16) | np_.uint32(0x0040)).astype(np_.uint16)
    return rounded


def cast_bits(bits: np.ndarray, source_dtype: str, target_dtype: str) -> np.ndarray:
    """Convert an array of raw `source_dtype` elements (unsigned ints) to raw `target_dtype` elements.

    BF16, F16 and F32 only, without torch: through F32 (exact for BF16 and F16), then one rounding to
    nearest even; NaN stays NaN, overflow becomes infinity.
    """
    if source_dtype == target_dtype:
        return bits
    return _from_float32(_to_float32(bits, source_dtype), target_dtype)


# =============================================================================================== blocks


def _row_bytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of one row (dim 0) of a tensor; of the whole tensor when it is a scalar."""
    elements = 1
    for dim in shape[1:]:
        elements *= dim
    return elements * DTYPE_BITS[dtype] // 8


def _row_blocks(rows: int, row_bytes: int, chunk: int) -> Iterator[tuple[int, int]]:
    """Row blocks [a, b) of `rows` rows small enough (about `chunk` bytes) to read, copy or cast at once."""
    step = max(1, chunk // max(1, row_bytes))
    for begin in range(0, rows, step):
        yield begin, min(rows, begin + step)


def segments_by_source(segments: Sequence[Segment]) -> dict[int, list[Segment]]:
    """The segments of each source, in order; zero padding goes with the source it follows (or the first)."""
    groups: dict[int, list[Segment]] = {}
    owner = 0
    for segment in segments:
        owner = segment.source if segment.source is not None else owner
        groups.setdefault(owner, []).append(segment)
    return groups


@dataclass(frozen=True)
class Delivery:
    """Where a block goes: one rank's tensor, whole rows or columns [start, stop) of them."""

    rank: int
    columns: tuple[int, int] | None = None


@dataclass(frozen=True)
class Block:
    """Rows [start, stop) of one source tensor (`whole`: all of a scalar), read with one ranged read, or
    constant bytes (zero padding, scale buffers), and the ranks it goes to."""

    source: SourceTensor | None
    start: int
    stop: int
    deliveries: tuple[Delivery, ...]
    constant: bytes | None = None
    whole: bool = False

    @property
    def byte_range(self) -> tuple[int, int]:
        """(offset in the source file, length) of the bytes to read."""
        assert self.source is not None
        if self.whole:
            return self.source.offset, self.source.nbytes
        row_bytes = _row_bytes(self.source.shape, self.source.dtype)
        return self.source.offset + self.start * row_bytes, (self.stop - self.start) * row_bytes


def tensor_blocks(tensor: PlannedTensor, dims: ModelDims, tp: int, chunk: int) -> Iterator[Block]:
    """The blocks that make up every TP rank's copy of `tensor`, in an order that writes each rank's bytes
    in sequence: source by source (the segments of a rank are grouped by source, in order), row block by
    row block, ranks interleaved. A row range that several ranks hold (replicated tensors, shared KV heads)
    is read once. Memory per block stays near `chunk`, whatever the tensor's size.
    """
    if tensor.split is Split.SCALE_ONE:
        yield Block(None, 0, 1, tuple(Delivery(rank) for rank in range(tp)), constant=SCALE_ONE_BYTES)
        return
    shapes = [source.shape for source in tensor.sources]
    per_rank = [segments_by_source(rank_segments(tensor.split, shapes, dims, tp, rank)) for rank in range(tp)]
    out_row_bytes = _row_bytes(tensor.shape, tensor.dtype)
    for index, source in enumerate(tensor.sources):
        row_bytes = _row_bytes(source.shape, source.dtype)
        data: dict[int, Segment] = {}
        for rank in range(tp):
            runs = [segment for segment in per_rank[rank].get(index, []) if segment.source is not None]
            assert len(runs) <= 1, "every split gives a rank at most one run of each source"
            if runs:
                data[rank] = runs[0]
        axes = {segment.axis for segment in data.values()}
        if axes == {None}:
            yield Block(source, 0, 1, tuple(Delivery(rank) for rank in data), whole=True)
        elif axes == {1}:
            for begin, end in _row_blocks(source.shape[0], row_bytes, chunk):
                yield Block(
                    source, begin, end, tuple(Delivery(rank, (run.start, run.stop)) for rank, run in data.items())
                )
        elif axes:
            sharing: dict[tuple[int, int], list[int]] = {}
            for rank, run in data.items():
                sharing.setdefault((run.start, run.stop), []).append(rank)
            blocks = {rows: list(_row_blocks(rows[1] - rows[0], row_bytes, chunk)) for rows in sharing}
            for number in range(max(len(items) for items in blocks.values())):
                for (start, _), ranks in sharing.items():
                    if number < len(blocks[(start, _)]):
                        begin, end = blocks[(start, _)][number]
                        yield Block(source, start + begin, start + end, tuple(Delivery(rank) for rank in ranks))
        for rank in range(tp):  # zero padding follows a rank's rows of the source
            for segment in per_rank[rank].get(index, []):
                if segment.source is None:
                    for begin, end in _row_blocks(segment.stop - segment.start, out_row_bytes, chunk):
                        zeros = bytes((end - begin) * out_row_bytes)
                        yield Block(None, begin, end, (Delivery(rank),), constant=zeros)


def block_chunks(block: Block, data: bytes | None, out_dtype: str) -> list[tuple[int, memoryview]]:
    """(rank, bytes) for every delivery of a block, from the block's read `data`: whole rows are sent as
    they were read when no cast is needed; columns and casts are copied (contiguous, C order)."""
    if block.source is None:
        assert block.constant is not None
        constant = memoryview(block.constant)
        return [(delivery.rank, constant) for delivery in block.deliveries]
    assert data is not None
    source = block.source
    if source.dtype == out_dtype and all(delivery.columns is None for delivery in block.deliveries):
        view = memoryview(data)
        return [(delivery.rank, view) for delivery in block.deliveries]
    np_ = _numpy()
    shape = source.shape if block.whole else (block.stop - block.start, *source.shape[1:])
    array = np_.frombuffer(data, dtype=storage_dtype(source.dtype)).reshape(shape)
    chunks: list[tuple[int, memoryview]] = []
    whole_rows: memoryview | None = None
    for delivery in block.deliveries:
        if delivery.columns is None:
            if whole_rows is None:
                whole_rows = np_.ascontiguousarray(cast_bits(array, source.dtype, out_dtype)).data
            chunks.append((delivery.rank, whole_rows))
        else:
            start, stop = delivery.columns
            columns = cast_bits(array[:, start:stop], source.dtype, out_dtype)
            chunks.append((delivery.rank, np_.ascontiguousarray(columns).data))
    return chunks


def _block_budget(block: Block, out_dtype: str) -> int:
    """Bytes a block holds until every rank has written it: what is read, plus the copies made of it."""
    if block.source is None:
        return max(1, len(block.constant or b""))
    read = block.byte_range[1]
    if block.source.dtype == out_dtype and all(delivery.columns is None for delivery in block.deliveries):
        return max(1, read)
    # Column slices partition the block, and a cast of whole rows is shared: one copy in all.
    scale = DTYPE_BITS[out_dtype] / DTYPE_BITS[block.source.dtype]
    return max(1, read + int(read * scale))


def read_block(location: Location, block: Block, policy: RetryPolicy) -> bytes:
    assert block.source is not None
    offset, length = block.byte_range
    key = location.key(block.source.file)
    data = with_retries(partial(location.store.read_range, key, offset, length), policy)
    if len(data) != length:
        raise IntegrityError(f"{location.store.url(key)} ended inside {block.source.name} (changed while sharding?)")
    return data


# =============================================================================================== writing


class _Cancelled(Exception):
    pass


class PartStream:
    """One output object: bytes written in order, cut into fixed-size multipart parts, sha256 in flight.

    A part is assembled with one copy (`b"".join` of the pieces that fill it); only a tail shorter than a
    part is copied on its own, because the caller may reuse its buffer once `write` returns. `finish()`
    sends the last part but does not complete the upload: completing is the caller's commit step, so that
    nothing appears under a final name before every file is written.
    """

    def __init__(self, location: Location, name: str, size: int, chunk: int, policy: RetryPolicy) -> None:
        store = location.store
        self.name = name
        self.size = size
        self.part_size = part_size_for(size, chunk, store.min_part_size, store.max_parts)
        self.policy = policy
        key = location.key(name)
        self.upload: MultipartUpload = with_retries(partial(store.start_multipart, key, self.part_size), policy)
        self.digest = hashlib.sha256()
        self.pending: list[bytes | memoryview] = []
        self.pending_bytes = 0
        self.next_part = 0
        self.written = 0
        # A local file: write each chunk in place at its offset (the store's part layout is only offsets),
        # which spares the copy that assembling a part takes. The upload still owns the file: complete()
        # fsyncs and renames it, abort() removes it.
        self._local: LocalMultipartUpload | None = (
            self.upload if isinstance(self.upload, LocalMultipartUpload) else None
        )

    def write(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk).cast("B")
        self.digest.update(view)
        if self._local is not None:
            self._local.write_at(self.written, view)
            self.written += len(view)
            return
        self.written += len(view)
        while view:
            room = self.part_size - self.pending_bytes
            if len(view) < room:
                self.pending.append(bytes(view))  # keep only what we own past this call
                self.pending_bytes += len(view)
                return
            self.pending.append(view[:room])
            view = view[room:]
            self._send(b"".join(self.pending))
            self.pending.clear()
            self.pending_bytes = 0

    def finish(self) -> str:
        if self._local is None and (self.pending or self.next_part == 0):
            self._send(b"".join(self.pending))
            self.pending.clear()
            self.pending_bytes = 0
        if self.written != self.size:
            raise AssertionError(f"{self.name}: wrote {self.written} bytes, planned {self.size}")
        return self.digest.hexdigest()

    def _send(self, data: bytes) -> None:
        with_retries(partial(self.upload.upload_part, self.next_part, data), self.policy)
        self.next_part += 1


@dataclass
class _Countdown:
    """Calls `done` once `count` writes have finished (the block's memory can then be given back)."""

    count: int
    done: Callable[[], None]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finished_one(self) -> None:
        with self.lock:
            self.count -= 1
            last = self.count == 0
        if last:
            self.done()


@dataclass
class _Writer:
    """Writes the files of one stage's TP ranks in lockstep: a pool reads blocks ahead, the main thread
    cuts them per rank, and one writer thread per rank appends them to its file in order."""

    source: Location
    dest: Location
    plan: ShardPlan
    options: ShardOptions
    progress: Progress
    task: int
    budget: ByteBudget
    shielded: Shielded  # starts uploads: an interrupt must not lose one (see write_sharded)
    cancelled: threading.Event = field(default_factory=threading.Event)
    open_streams: list[PartStream] = field(default_factory=list)
    written: list[WrittenFile] = field(default_factory=list)
    bytes_written: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def write_stage(self, stage: StagePlan) -> None:
        tp = self.plan.tensor_parallel_size
        files = stage_files(self.plan, stage)
        skip = skipped_files(self.plan)
        writers = [ThreadPoolExecutor(1, thread_name_prefix=f"shard-rank{rank}") for rank in range(tp)]
        readers = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="shard-read")
        futures: list[Future[None]] = []
        try:
            for part_index in range(len(stage.parts)):
                part_files = [file for file in files if file.part == part_index]
                if all(file.name in skip for file in part_files):
                    # The TP ranks of one part are cut from the same reads: skipped together, or written together.
                    for file in part_files:
                        tensors = tuple((tensor.name, tensor.dtype, tensor.shape) for tensor in file.tensors)
                        sha256 = self.plan.reused[file.name]
                        self.written.append(
                            WrittenFile(file.name, file.pp_rank, file.tp_rank, file.part, file.size, sha256, tensors)
                        )
                        self.progress.log(f"{file.name}: unchanged since the previous run (size and sha256), skipped")
                    self.progress.advance(self.task, sum(file.size for file in part_files))
                    continue
                streams = [self._open(file) for file in part_files]
                for rank, stream in enumerate(streams):
                    futures.append(self._submit(writers[rank], stream, memoryview(part_files[rank].header), None))
                self._write_tensors(part_files[0].tensors, streams, writers, readers, futures)
                finishers = [writers[rank].submit(stream.finish) for rank, stream in enumerate(streams)]
                self._wait(futures)
                futures.clear()
                for file, finisher in zip(part_files, finishers):
                    tensors = tuple((tensor.name, tensor.dtype, tensor.shape) for tensor in file.tensors)
                    self.written.append(
                        WrittenFile(
                            file.name, file.pp_rank, file.tp_rank, file.part, file.size, finisher.result(), tensors
                        )
                    )
        except BaseException as error:
            self.cancelled.set()
            readers.shutdown(wait=True, cancel_futures=True)
            for executor in writers:
                executor.shutdown(wait=True, cancel_futures=True)
            cause = _first_error(futures)
            if cause is not None and cause is not error and not isinstance(cause, _Cancelled):
                raise cause from None  # what a writer thread hit, not the cancellation it caused here
            raise
        finally:
            readers.shutdown(wait=True)
            for executor in writers:
                executor.shutdown(wait=True)

    def _write_tensors(
        self,
        tensors: Sequence[PlannedTensor],
        streams: Sequence[PartStream],
        writers: Sequence[ThreadPoolExecutor],
        readers: ThreadPoolExecutor,
        futures: list[Future[None]],
    ) -> None:
        """Read blocks up to READ_AHEAD ahead (within the byte budget) and hand them out in order."""
        in_flight: deque[tuple[Block, Future[bytes] | None, int, str]] = deque()
        for tensor in tensors:
            if self.plan.tied_lm_head is not None and tensor.name == TIED_LM_HEAD_RULE.name:
                _check_tied_lm_head(self.source, self.plan.tied_lm_head, tensor.sources[0], self.options.retry)
            blocks = tensor_blocks(tensor, self.plan.dims, self.plan.tensor_parallel_size, self.options.read_block)
            for block in blocks:
                if self.cancelled.is_set():
                    self._wait(futures)  # raises the writer's error
                    raise _Cancelled()
                need = min(_block_budget(block, tensor.dtype), self.options.max_buffer)
                # Blocks read but not handed out yet hold budget that only the writers give back, once they
                # have them: hand out enough first, or waiting for budget would be waiting for ourselves.
                while in_flight and sum(entry[2] for entry in in_flight) + need > self.options.max_buffer:
                    self._deliver(*in_flight.popleft(), streams, writers, futures)
                held = self.budget.acquire(need, self.cancelled)
                read = (
                    None if block.source is None else readers.submit(read_block, self.source, block, self.options.retry)
                )
                in_flight.append((block, read, held, tensor.dtype))
                while len(in_flight) > READ_AHEAD:
                    self._deliver(*in_flight.popleft(), streams, writers, futures)
        while in_flight:
            self._deliver(*in_flight.popleft(), streams, writers, futures)

    def _deliver(
        self,
        block: Block,
        read: Future[bytes] | None,
        held: int,
        out_dtype: str,
        streams: Sequence[PartStream],
        writers: Sequence[ThreadPoolExecutor],
        futures: list[Future[None]],
    ) -> None:
        try:
            chunks = block_chunks(block, read.result() if read is not None else None, out_dtype)
        except BaseException:
            self.budget.release(held)
            raise
        countdown = _Countdown(len(chunks), partial(self.budget.release, held))
        for rank, chunk in chunks:
            futures.append(self._submit(writers[rank], streams[rank], chunk, countdown))

    def _open(self, file: PlannedFile) -> PartStream:
        chunk, policy = self.options.upload_chunk, self.options.retry
        start = partial(_start_recorded, self.open_streams, self.dest, file.name, file.size, chunk, policy)
        return self.shielded(start)

    def _submit(
        self, executor: ThreadPoolExecutor, stream: PartStream, chunk: memoryview, countdown: _Countdown | None
    ) -> Future[None]:
        def write() -> None:
            try:
                if self.cancelled.is_set():
                    raise _Cancelled()
                stream.write(chunk)
                with self._lock:
                    self.bytes_written += chunk.nbytes
                self.progress.advance(self.task, chunk.nbytes)
            except BaseException:
                self.cancelled.set()  # stop the main thread and the other ranks early
                raise
            finally:
                if countdown is not None:
                    countdown.finished_one()

        return executor.submit(write)

    def _wait(self, futures: Sequence[Future[None]]) -> None:
        wait(futures)
        error = _first_error(futures)
        if error is not None:
            raise error


def _first_error(futures: Sequence[Future[None]]) -> BaseException | None:
    """The first real error among finished writes (a cancellation only echoes another error)."""
    errors = [future.exception() for future in futures if future.done() and not future.cancelled()]
    errors = [error for error in errors if error is not None]
    return next((error for error in errors if not isinstance(error, _Cancelled)), errors[0] if errors else None)


def _check_tied_lm_head(source: Location, lm_head: SourceTensor, embed: SourceTensor, policy: RetryPolicy) -> None:
    """config.json says tied, yet the checkpoint has its own lm_head: sharded state can only hold one, so
    the two must be the same (vLLM re-ties them only when identical). Compared in chunks."""
    same = lm_head.shape == embed.shape and lm_head.dtype == embed.dtype
    for start in range(0, lm_head.nbytes if same else 0, READ_BLOCK):
        length = min(READ_BLOCK, lm_head.nbytes - start)
        ours = with_retries(
            partial(source.store.read_range, source.key(lm_head.file), lm_head.offset + start, length), policy
        )
        theirs = with_retries(
            partial(source.store.read_range, source.key(embed.file), embed.offset + start, length), policy
        )
        if ours != theirs:
            same = False
            break
    if not same:
        raise UsageError(
            "config.json says tie_word_embeddings, but the checkpoint's lm_head.weight differs from "
            "model.embed_tokens.weight; sharded state keeps only one of them",
            hint="set tie_word_embeddings to false in config.json if the model really has its own lm_head",
        )


def _abort_all(streams: Sequence[PartStream], progress: Progress) -> None:
    for stream in streams:
        try:
            stream.upload.abort()
        except StreamctlError as error:
            progress.log(f"could not abort the upload of {stream.name}: {error.message}")


def _commit(streams: Sequence[PartStream], dest: Location, policy: RetryPolicy, progress: Progress) -> None:
    """Complete every upload; if one fails (or Ctrl-C), remove the ones already completed and abort the rest."""
    completed: list[PartStream] = []

    def complete_and_record(stream: PartStream) -> None:
        # The sha256 is known only now: every object streamctl writes carries it (re-runs compare it).
        with_retries(partial(stream.upload.complete, {SHA256_KEY: stream.digest.hexdigest()}), policy)
        completed.append(stream)  # in the same shielded call: the clean-up below must see it

    try:
        with shielded_calls() as shielded:
            for stream in streams:
                shielded(partial(complete_and_record, stream))
    except BaseException:
        for stream in completed:
            try:
                dest.store.delete(dest.key(stream.name))
            except StreamctlError as error:
                progress.log(f"could not remove {stream.name}: {error.message}")
        _abort_all([stream for stream in streams if stream not in completed], progress)
        raise


def write_sharded(
    plan: ShardPlan, source: Location, dest: Location, options: ShardOptions, progress: Progress = NULL_PROGRESS
) -> tuple[tuple[WrittenFile, ...], int]:
    """Write every planned file and complete them all at the end; a failure aborts every upload."""
    task = progress.task("Writing sharded state", plan.total_bytes)
    open_streams: list[PartStream] = []
    cancelled = threading.Event()
    try:
        # Leaving this block waits for an upload being started, so the abort below sees it too.
        with shielded_calls() as shielded:
            budget = ByteBudget(options.max_buffer)
            writer = _Writer(
                source, dest, plan, options, progress, task, budget, shielded, cancelled, open_streams=open_streams
            )
            for stage in plan.stages:
                writer.write_stage(stage)
        _commit(open_streams, dest, options.retry, progress)
    except BaseException:
        cancelled.set()
        _abort_all(open_streams, progress)
        raise
    finally:
        progress.done(task)
    return tuple(writer.written), writer.bytes_written


# =============================================================================================== copying serving files


def copy_serving_files(
    source: Location, dest: Location, files: Sequence[tuple[str, int]], policy: RetryPolicy
) -> tuple[CopiedFile, ...]:
    """config.json, generation config, tokenizer and custom code: small files, read whole and put."""
    copied = []
    for path, size in files:
        key = source.key(path)
        data = with_retries(partial(source.store.read_range, key, 0, size), policy)
        if len(data) != size:
            raise IntegrityError(f"{source.store.url(key)} is shorter than its listed size {size}")
        sha256 = hashlib.sha256(data).hexdigest()
        with_retries(partial(dest.store.put, dest.key(path), data, {SHA256_KEY: sha256}), policy)
        copied.append(CopiedFile(path, size, sha256))
    return tuple(copied)


# =============================================================================================== checks


def check_verify(dest: Location, plan: ShardPlan, progress: Progress) -> VerifyReport:
    options = VerifyOptions(
        sharded=True,
        tensor_parallel_size=plan.tensor_parallel_size,
        pipeline_parallel_size=plan.pipeline_parallel_size,
        pattern=plan.pattern,
    )
    report = verify_checkpoint(dest, options, progress)
    # The run's own "incomplete" manifest is still in place while it checks: that finding is not the files'.
    return replace(report, findings=tuple(f for f in report.findings if f.code != SHARD_INCOMPLETE_CODE))


@dataclass(frozen=True)
class _WrittenTensor:
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _read_written_headers(
    dest: Location, pattern: str, problems: list[str]
) -> dict[tuple[int, int], dict[str, _WrittenTensor]]:
    """(pp_rank, tp_rank) -> tensor name -> where DEST's files hold it, from the headers of every file
    that fits the pattern (what vLLM would load), not from the plan."""
    from streamctl.checkpoint.sharded_names import parse_sharded_name

    by_rank: dict[tuple[int, int], dict[str, _WrittenTensor]] = {}
    for info in dest.list():
        name = dest.relative(info.key)
        parsed = parse_sharded_name(pattern, name)
        if parsed is None:
            continue
        read = read_header(dest.store, info.key, info.size)
        rank = by_rank.setdefault((parsed.pp_rank, parsed.tp_rank), {})
        if read.header_json is None:
            problems.append(f"{name}: {read.problem.message if read.problem else 'unreadable header'}")
            continue
        header = parse_header(read.header_json, info.size)
        start = HEADER_LENGTH_BYTES + header.header_length
        for tensor in header.tensors:
            if tensor.name in rank:
                problems.append(f"{tensor.name}: in both {rank[tensor.name].file} and {name}")
            rank[tensor.name] = _WrittenTensor(name, tensor.dtype, tensor.shape, start + tensor.begin, tensor.nbytes)
    return by_rank


def same_bytes(ours: bytes | memoryview, theirs: bytes | memoryview) -> bool:
    """Bitwise equality of two buffers, compared 8 bytes at a time (~29 GB/s here, against ~7 GB/s for
    bytes and ~1 GB/s for memoryview ==) with the GIL released, so check threads run side by side."""
    if len(ours) != len(theirs):
        return False
    np_ = _numpy()
    left, right = np_.frombuffer(ours, np_.uint8), np_.frombuffer(theirs, np_.uint8)
    bulk = len(left) - len(left) % 8
    return bool(np_.array_equal(left[:bulk].view(np_.uint64), right[:bulk].view(np_.uint64))) and bool(
        np_.array_equal(left[bulk:], right[bulk:])
    )


def _covers(intervals: Sequence[tuple[int, int]], extent: int) -> bool:
    position = 0
    for start, stop in sorted(intervals):
        if start > position:
            return False
        position = max(position, stop)
    return position >= extent


def check_reconstruction(
    source: Location,
    dest: Location,
    plan: ShardPlan,
    policy: RetryPolicy,
    progress: Progress = NULL_PROGRESS,
    *,
    dtype_from_files: bool = False,
    chunk: int = READ_BLOCK,
) -> ReconstructionReport:
    """Reassemble every source tensor from DEST's rank files and compare it bit for bit with the source.

    Block by block (the writer's blocks, so memory stays near `chunk`): each source block is read once,
    then the bytes each rank's file holds for it at that point of the rank's tensor (located from the
    file's own header) are read back and compared with the (cast) source rows or columns; padding must be
    zero, every rank's tensor must be consumed exactly, and the rows and columns of all ranks together must
    cover every source element. `dtype_from_files` compares in the dtype the files hold (vLLM's own writer
    picks its served dtype).
    """
    problems: list[str] = []
    written = _read_written_headers(dest, plan.pattern, problems)
    checker = _Reconstruction(source, dest, plan, policy, written, dtype_from_files, chunk)
    task = progress.task("Checking reconstruction", sum(len(stage.tensors) for stage in plan.stages))
    work = [(stage.pp_rank, tensor) for stage in plan.stages for tensor in stage.tensors]
    sources_checked: set[str] = set()
    bytes_compared = 0
    # Tensors are checked side by side: reads and comparisons release the GIL, and one thread alone
    # leaves a core idle (measured on 3.1 GB at TP 2: ~1.0 s on one thread, ~0.6 s on this pool).
    with ThreadPoolExecutor(RECONSTRUCTION_THREADS, thread_name_prefix="shard-check") as pool:
        try:
            for checked in pool.map(lambda item: checker.check(*item), work):
                progress.advance(task, 1)
                problems.extend(checked.problems)
                sources_checked.update(checked.sources)
                bytes_compared += checked.bytes_compared
        except BaseException:
            checker.cancelled.set()
            raise
        finally:
            progress.done(task)
    shown = tuple(problems[:50]) + ((f"... and {len(problems) - 50} more",) if len(problems) > 50 else ())
    return ReconstructionReport(not problems, len(sources_checked), bytes_compared, shown)


@dataclass(frozen=True)
class _TensorCheck:
    """What checking one planned tensor found: problems (empty: bit-identical), sources it covers, bytes read back."""

    problems: tuple[str, ...]
    sources: tuple[str, ...]
    bytes_compared: int


@dataclass(frozen=True)
class _Reconstruction:
    source: Location
    dest: Location
    plan: ShardPlan
    policy: RetryPolicy
    written: Mapping[tuple[int, int], Mapping[str, _WrittenTensor]]
    dtype_from_files: bool
    chunk: int
    cancelled: threading.Event = field(default_factory=threading.Event)

    def _ranks(self, pp_rank: int, tensor: PlannedTensor, problems: list[str]) -> dict[int, _WrittenTensor]:
        """The ranks whose file holds the tensor with the expected dtype and shape (others are reported)."""
        ranks = {}
        for rank in range(self.plan.tensor_parallel_size):
            label = f"{tensor.name} (PP stage {pp_rank}, TP rank {rank})"
            where = self.written.get((pp_rank, rank), {}).get(tensor.name)
            if where is None:
                problems.append(f"{label}: missing from the written files")
                continue
            dtype = where.dtype if self.dtype_from_files else tensor.dtype
            if where.dtype != dtype or where.shape != tensor.shape:
                problems.append(
                    f"{label}: written as {where.dtype} {list(where.shape)}, expected {dtype} {list(tensor.shape)}"
                )
                continue
            ranks[rank] = where
        return ranks

    def check(self, pp_rank: int, tensor: PlannedTensor) -> _TensorCheck:
        problems: list[str] = []
        ranks = self._ranks(pp_rank, tensor, problems)
        cursors = dict.fromkeys(ranks, 0)  # bytes of each rank's tensor accounted for so far
        covered: dict[tuple[str, int | None], list[tuple[int, int]]] = {}
        failed: set[int] = set()
        compared = 0
        blocks = tensor_blocks(tensor, self.plan.dims, self.plan.tensor_parallel_size, self.chunk)
        for block in blocks:
            if self.cancelled.is_set():
                raise _Cancelled()
            data = None if block.source is None else read_block(self.source, block, self.policy)
            for delivery in block.deliveries:
                where = ranks.get(delivery.rank)
                if where is None:
                    continue
                expected = self._expected(block, data, delivery, where.dtype)
                got = self._read(where, cursors[delivery.rank], len(expected))
                cursors[delivery.rank] += len(expected)
                compared += len(got)
                if delivery.rank not in failed and not same_bytes(got, expected):
                    failed.add(delivery.rank)
                    problems.append(self._difference(tensor, block, delivery, pp_rank))
                if block.source is not None:
                    axis = None if block.whole else (0 if delivery.columns is None else 1)
                    span = (0, 1) if axis is None else (delivery.columns or (block.start, block.stop))
                    covered.setdefault((block.source.name, axis), []).append(span)
        for rank, where in ranks.items():
            if cursors[rank] != where.nbytes and rank not in failed:
                problems.append(f"{tensor.name} (PP stage {pp_rank}, TP rank {rank}): size does not add up")
        if len(ranks) == self.plan.tensor_parallel_size:
            for item in tensor.sources:
                for (name, axis), spans in covered.items():
                    extent = 1 if axis is None else item.shape[axis]
                    if name == item.name and not _covers(spans, extent):
                        problems.append(f"{tensor.name}: the ranks together miss part of {item.name}")
        return _TensorCheck(tuple(problems), tuple(item.name for item in tensor.sources), compared)

    def _expected(self, block: Block, data: bytes | None, delivery: Delivery, dtype: str) -> memoryview:
        """The bytes `delivery`'s rank must hold for this block (a view of `data` when no copy is needed)."""
        if block.source is None:
            return memoryview(block.constant or b"")
        assert data is not None
        source = block.source
        if delivery.columns is None and source.dtype == dtype:
            return memoryview(data)
        np_ = _numpy()
        shape = source.shape if block.whole else (block.stop - block.start, *source.shape[1:])
        array = np_.frombuffer(data, dtype=storage_dtype(source.dtype)).reshape(shape)
        if delivery.columns is not None:
            array = array[:, delivery.columns[0] : delivery.columns[1]]
        return memoryview(np_.ascontiguousarray(cast_bits(array, source.dtype, dtype))).cast("B")

    def _read(self, where: _WrittenTensor, start: int, nbytes: int) -> bytes:
        key = self.dest.key(where.file)
        return with_retries(partial(self.dest.store.read_range, key, where.offset + start, nbytes), self.policy)

    @staticmethod
    def _difference(tensor: PlannedTensor, block: Block, delivery: Delivery, pp_rank: int) -> str:
        label = f"{tensor.name} (PP stage {pp_rank}, TP rank {delivery.rank})"
        if block.source is None:
            what = "padding rows are not zero" if block.constant and not any(block.constant) else "is not float32 1.0"
            return f"{label}: {what}"
        columns = f", columns {delivery.columns[0]}:{delivery.columns[1]}" if delivery.columns else ""
        return f"{label}: rows {block.start}:{block.stop}{columns} of {block.source.name} differ from the source"


# =============================================================================================== manifest


def write_manifest(dest: Location, result: ShardResult) -> None:
    plan = result.plan
    ranks: dict[tuple[int, int], list[WrittenFile]] = {}
    for file in result.files:
        ranks.setdefault((file.pp_rank, file.tp_rank), []).append(file)
    manifest = {
        "tool": "streamctl",
        "version": __version__,
        "complete": True,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": plan.source,
        "engine": result.engine,
        "architecture": plan.dims.architecture,
        "tensor_parallel_size": plan.tensor_parallel_size,
        "pipeline_parallel_size": plan.pipeline_parallel_size,
        "pattern": plan.pattern,
        "vllm_version": plan.vllm_version,
        "layout": plan.row.label,
        "dtype": plan.dtype,
        "max_part_size": plan.max_part_size,
        "source_files": [list(entry) for entry in plan.source_files],
        "ranks": [
            {
                "pp_rank": pp_rank,
                "tp_rank": tp_rank,
                "files": [
                    {
                        "path": file.path,
                        "part": file.part,
                        "size": file.size,
                        "sha256": file.sha256,
                        "tensors": [
                            {"name": name, "dtype": dtype, "shape": list(shape)} for name, dtype, shape in file.tensors
                        ],
                    }
                    for file in sorted(files, key=lambda item: item.part)
                ],
            }
            for (pp_rank, tp_rank), files in sorted(ranks.items())
        ],
        "files": [{"path": file.path, "size": file.size, "sha256": file.sha256} for file in result.copied],
        "older_files": [item.path for item in plan.left_alone if item.streamctl],
    }
    put_json(dest, SHARD_MANIFEST_NAME, manifest)


def write_incomplete_manifest(
    dest: Location,
    *,
    source: str,
    engine: Engine,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    pattern: str,
    planned: Sequence[str],
    older_files: Sequence[str],
) -> None:
    """Mark DEST as a shard run in progress, before its first byte: the manifest's own name with
    `"complete": false`, replaced (atomically: one put) by the completed manifest at the very end.

    Why one name and not a separate marker: a reader finds the state in one place, and there is never a
    moment with both a marker and a manifest (or neither) to reconcile. `verify-index` reports such a DEST
    (`shard-incomplete`) and `serve` refuses it, whatever else a killed or out-of-space run left there. It
    also names what the run writes and what it will remove, so a later `--force` still knows them.
    """
    put_json(
        dest,
        SHARD_MANIFEST_NAME,
        {
            "tool": "streamctl",
            "version": __version__,
            "complete": False,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "source": source,
            "engine": engine,
            "tensor_parallel_size": tensor_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
            "pattern": pattern,
            "planned": sorted(planned),
            "older_files": sorted(older_files),
        },
    )


def _begin(
    source: Location,
    dest: Location,
    plan: ShardPlan,
    engine: Engine,
    planned: Sequence[str],
    options: ShardOptions,
    progress: Progress,
) -> tuple[tuple[CopiedFile, ...], tuple[str, ...]]:
    """Before the weights: the "incomplete" manifest, then the small serving files (config, tokenizer,
    ...), so a run that stops in the weights never leaves weights without them. Returns the copies and
    the names this created (none of them was in DEST before), which `_undo_on_failure` removes again."""
    before = set(_list_dest(dest))
    names = (SHARD_MANIFEST_NAME, *(path for path, _ in plan.serving_files))
    created = tuple(name for name in names if name not in before)
    older = [*plan.stale, *(item.path for item in plan.left_alone if item.streamctl)]

    def begin() -> tuple[CopiedFile, ...]:
        write_incomplete_manifest(
            dest,
            source=plan.source,
            engine=engine,
            tensor_parallel_size=plan.tensor_parallel_size,
            pipeline_parallel_size=plan.pipeline_parallel_size,
            pattern=plan.pattern,
            planned=planned,
            older_files=older,
        )
        return copy_serving_files(source, dest, plan.serving_files, options.retry)

    return _undo_on_failure(dest, created, progress, begin), created


def _undo_on_failure(dest: Location, created: Sequence[str], progress: Progress, step: Callable[[], _T]) -> _T:
    """Run `step`; if it fails before any weight is under its final name (the uploads were aborted), remove
    what `_begin` created, so a failed run into a new DEST leaves it as it was. What `_begin` replaced stays,
    marked incomplete. (A killed run cannot do this: its "incomplete" manifest says what happened.)"""
    try:
        return step()
    except BaseException:
        for name in created:
            try:
                dest.store.delete(dest.key(name))
            except StreamctlError as error:
                progress.log(f"could not remove {name}: {error.message}")
        raise


# =============================================================================================== entry points


def shard_checkpoint(
    source: Location,
    dest: Location,
    options: ShardOptions,
    progress: Progress = NULL_PROGRESS,
    source_id: str | None = None,
) -> ShardResult:
    """Plan, write, copy the serving files, check, and write the manifest.

    Raises UsageError/NotFoundError before writing anything when the input or the options are wrong, and
    ShardCheckFailed (exit 1) when the files were written but a check failed (then no manifest is written).
    """
    if options.engine == "vllm":
        return shard_with_vllm(source, dest, options, progress, source_id)
    started = time.monotonic()
    notes = listing_notes(source)
    log_notes(notes, progress)
    plan = plan_shard(source, dest, options, source_id)
    if plan.dtype == "auto" and any(
        source_tensor.dtype == "F32"
        for stage in plan.stages
        for tensor in stage.tensors
        for source_tensor in tensor.sources
    ):
        progress.log(
            "note: the checkpoint has float32 weights; vLLM serves those as bfloat16/float16 with --dtype auto, "
            "so consider --dtype"
        )
    with hold_lease(dest, f"streamctl shard {plan.source}", progress) as lease:
        # Planning ran before the lease: another run may have written here since.
        plan = _plan_dest(dest, plan, options.force)
        return _shard_offline(source, lease.fenced(dest), options, progress, plan, started, lease, notes)


def _shard_offline(
    source: Location,
    dest: Location,
    options: ShardOptions,
    progress: Progress,
    plan: ShardPlan,
    started: float,
    lease: Lease,
    notes: tuple[ListingNote, ...],
) -> ShardResult:
    discarded = discard_unfinished_uploads(
        dest, partial(_ours, plan.pattern, plan.serving_files), progress, lease.acquired_at
    )
    planned = [file.name for file in plan.files()] + [path for path, _ in plan.serving_files]
    copied, created = _begin(source, dest, plan, "offline", planned, options, progress)
    files, bytes_written = _undo_on_failure(
        dest, created, progress, partial(write_sharded, plan, source, dest, options, progress)
    )
    write_seconds = time.monotonic() - started
    removed = remove_files(dest, plan.stale, progress)
    verify, reconstruction = _check_written(source, dest, plan, options, progress, dtype_from_files=False)
    result = ShardResult(
        plan,
        "offline",
        files,
        copied,
        removed,
        bytes_written,
        time.monotonic() - started,
        write_seconds,
        verify,
        reconstruction,
        discarded,
        notes,
        tuple(sorted(skipped_files(plan))),
    )
    return _record(dest, result, lease)


def _check_written(
    source: Location,
    dest: Location,
    plan: ShardPlan,
    options: ShardOptions,
    progress: Progress,
    *,
    dtype_from_files: bool,
) -> tuple[VerifyReport, ReconstructionReport | None]:
    """After the weights: both checks (no reconstruction without a layout)."""
    verify = check_verify(dest, plan, progress)
    reconstruction = (
        check_reconstruction(
            source, dest, plan, options.retry, progress, dtype_from_files=dtype_from_files, chunk=options.read_block
        )
        if plan.stages
        else None
    )
    return verify, reconstruction


def _record(dest: Location, result: ShardResult, lease: Lease) -> ShardResult:
    """The manifest, once both checks passed; ShardCheckFailed (exit 1, no manifest) otherwise."""
    if not result.ok:
        raise ShardCheckFailed(result)
    lease.ensure_held()  # after this renewal nobody can take DEST over before the manifest is written
    write_manifest(dest, result)
    return result


def _ours(pattern: str, serving_files: Sequence[tuple[str, int]], name: str) -> bool:
    """Whether `name` (relative to DEST) is a file `shard` writes there: rank files, serving files, manifest."""
    from streamctl.checkpoint.sharded_names import parse_sharded_name

    return (
        name == SHARD_MANIFEST_NAME
        or any(name == path for path, _ in serving_files)
        or parse_sharded_name(pattern, name) is not None
    )


# ----------------------------------------------------------------------------------------------- --engine vllm

VLLM_SAVE_SCRIPT = r"""
import json, sys
args = json.loads(sys.argv[1])
import torch
needed = args["tensor_parallel_size"] * args["pipeline_parallel_size"]
if not torch.cuda.is_available() or torch.cuda.device_count() < needed:
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"needs {needed} CUDA GPUs, found {found}", file=sys.stderr)
    sys.exit(3)
from vllm import LLM
llm = LLM(
    model=args["model"],
    tensor_parallel_size=args["tensor_parallel_size"],
    pipeline_parallel_size=args["pipeline_parallel_size"],
    dtype=args["dtype"],
    enforce_eager=True,
)
# As vLLM's examples/features/sharded_state/save_sharded_state_offline.py does.
llm.llm_engine.engine_core.save_sharded_state(path=args["output"], pattern=args["pattern"], max_size=args["max_size"])
"""


def _find_gpus() -> bool:
    """Whether this machine has NVIDIA GPUs, without importing torch."""
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


def check_vllm_engine_available() -> None:
    """The error naming what is missing for --engine vllm: the vllm package (exit 127, as for every missing
    program or extra), or CUDA GPUs (exit 2: nothing to install fixes that here)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise MissingProgramError(
            "--engine vllm needs the vllm package in this Python environment, and it is not installed",
            hint="pip install 'streamctl[vllm]' on a machine with GPUs, or use --engine offline",
        )
    if not _find_gpus():
        raise UsageError(
            "--engine vllm needs CUDA GPUs (one per TP x PP rank), and this machine has none",
            hint="run it on a GPU machine, or use --engine offline",
        )


def shard_with_vllm(
    source: Location,
    dest: Location,
    options: ShardOptions,
    progress: Progress = NULL_PROGRESS,
    source_id: str | None = None,
    runner: Callable[[list[str]], subprocess.CompletedProcess[str]] | None = None,
) -> ShardResult:
    """vLLM's own save path: an engine at the requested TP/PP saves into a temporary folder (a subprocess,
    so the GPUs and torch are released afterwards), then the same copy to DEST, manifest and checks."""
    options.validate()
    if source.store.scheme != "file":
        raise UsageError("--engine vllm needs SOURCE as a local folder", hint="copy it first with `streamctl transfer`")
    check_disjoint(source, dest)
    check_vllm_engine_available()
    started = time.monotonic()
    version = options.vllm_version or installed_vllm_version()
    pattern = options.pattern or default_pattern(options.pipeline_parallel_size)
    validate_pattern(pattern, options.tensor_parallel_size, options.pipeline_parallel_size)
    listing = _list_source(source)
    notes = listing_notes(source)
    log_notes(notes, progress)
    config = _read_json_object(source, CONFIG_NAME, listing.sizes[CONFIG_NAME]) if CONFIG_NAME in listing.sizes else {}
    serving = _serving_files(source, listing, config)
    with hold_lease(dest, f"streamctl shard {source_id or source.url}", progress) as lease:
        return _shard_with_vllm_leased(
            source, lease.fenced(dest), options, progress, source_id, runner, started, version, pattern, serving,
            config, lease, notes,
        )  # fmt: skip


def _shard_with_vllm_leased(
    source: Location,
    dest: Location,
    options: ShardOptions,
    progress: Progress,
    source_id: str | None,
    runner: Callable[[list[str]], subprocess.CompletedProcess[str]] | None,
    started: float,
    version: str,
    pattern: str,
    serving: tuple[tuple[str, int], ...],
    config: dict[str, Any],
    lease: Lease,
    notes: tuple[ListingNote, ...],
) -> ShardResult:
    # Under the lease (nobody writes meanwhile), and before the engine runs: a refusal costs nothing.
    cleanup = _check_dest(dest, pattern, {path for path, _ in serving}, options.force)
    with tempfile.TemporaryDirectory(prefix="streamctl-vllm-save-") as folder:
        arguments = {
            "model": source.url,
            "output": folder,
            "tensor_parallel_size": options.tensor_parallel_size,
            "pipeline_parallel_size": options.pipeline_parallel_size,
            "dtype": options.dtype,
            "pattern": pattern,
            "max_size": options.max_part_size,
        }
        command = [sys.executable, "-c", VLLM_SAVE_SCRIPT, json.dumps(arguments)]
        progress.log("running vLLM's save_sharded_state (this starts a full engine)")
        completed = (runner or _run)(command)
        if completed.returncode != 0:
            tail = (completed.stderr or "").strip().splitlines()[-5:]
            raise UsageError(f"vLLM's save failed (exit {completed.returncode}): {' | '.join(tail)}")
        from streamctl.storage import open_location

        saved = open_location(folder)
        discarded = discard_unfinished_uploads(dest, partial(_ours, pattern, serving), progress, lease.acquired_at)
        architecture = str((config.get("architectures") or ["?"])[0])
        plan = _plan_for_saved(source, dest, options, serving, version, pattern, source_id, cleanup, architecture)
        copied, created = _begin(source, dest, plan, "vllm", [path for path, _ in serving], options, progress)
        files = _undo_on_failure(
            dest, created, progress, partial(_copy_saved_files, saved, dest, pattern, options, progress)
        )
    write_seconds = time.monotonic() - started
    written = {file.path for file in files}
    removed = remove_files(dest, tuple(name for name in plan.stale if name not in written), progress)
    verify, reconstruction = _check_written(source, dest, plan, options, progress, dtype_from_files=True)
    result = ShardResult(
        plan,
        "vllm",
        files,
        copied,
        removed,
        sum(file.size for file in files),
        time.monotonic() - started,
        write_seconds,
        verify,
        reconstruction,
        discarded,
        notes,
    )
    return _record(dest, result, lease)


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)


def _copy_saved_files(
    saved: Location, dest: Location, pattern: str, options: ShardOptions, progress: Progress
) -> tuple[WrittenFile, ...]:
    """Stream vLLM's files to DEST (sha256 in flight), completing them all at the end.

    vLLM 0.33 writes an empty part file when a rank's first tensor exceeds max_size, and the Run:ai
    streamer fails on such a file: empty parts are left out and the rank's parts renumbered from 0.
    """
    from streamctl.checkpoint.sharded_names import parse_sharded_name

    ranks: dict[tuple[int, int], list[tuple[int, ObjectInfo, ParsedHeader]]] = {}
    for info in saved.list():
        parsed = parse_sharded_name(pattern, saved.relative(info.key))
        if parsed is None:
            continue
        read = read_header(saved.store, info.key, info.size)
        header = parse_header(read.header_json or b"{}", info.size)
        if header.tensors:
            ranks.setdefault((parsed.pp_rank, parsed.tp_rank), []).append((parsed.part, info, header))
    streams: list[PartStream] = []
    written: list[WrittenFile] = []
    try:
        with shielded_calls() as shielded:  # see write_sharded
            for (pp_rank, tp_rank), parts in sorted(ranks.items()):
                for part, (_, info, header) in enumerate(sorted(parts, key=lambda item: item[0])):
                    name = format_name(pattern, tp_rank=tp_rank, pp_rank=pp_rank, part=part)
                    stream = shielded(
                        partial(_start_recorded, streams, dest, name, info.size, options.upload_chunk, options.retry)
                    )
                    for start in range(0, info.size, options.read_block):
                        length = min(options.read_block, info.size - start)
                        data = with_retries(partial(saved.store.read_range, info.key, start, length), options.retry)
                        stream.write(data)
                    tensors = tuple((tensor.name, tensor.dtype, tensor.shape) for tensor in header.tensors)
                    written.append(WrittenFile(name, pp_rank, tp_rank, part, info.size, stream.finish(), tensors))
        _commit(streams, dest, options.retry, progress)
    except BaseException:
        _abort_all(streams, progress)
        raise
    return tuple(written)


def _start_recorded(
    streams: list[PartStream], dest: Location, name: str, size: int, chunk: int, policy: RetryPolicy
) -> PartStream:
    stream = PartStream(dest, name, size, chunk, policy)
    streams.append(stream)  # before anything can interrupt: the abort path must see it
    return stream


def _plan_for_saved(
    source: Location,
    dest: Location,
    options: ShardOptions,
    serving_files: tuple[tuple[str, int], ...],
    version: str | None,
    pattern: str,
    source_id: str | None,
    cleanup: Cleanup,
    architecture: str,
) -> ShardPlan:
    """A plan describing vLLM's files; it carries the table's layout (for the reconstruction check) when
    the architecture is in the table, and no stages otherwise."""
    try:
        plan = plan_shard(source, dest, replace(options, engine="offline", force=True), source_id)
        return replace(plan, pattern=pattern, stale=cleanup.to_remove, left_alone=cleanup.left_alone)
    except UsageError:
        pass
    row = layout_row(version)
    dims = ModelDims(architecture, 0, 0, 0, 0, 0, 0, 0, False)
    return ShardPlan(
        source=source_id or source.url,
        dest=dest.url,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        pattern=pattern,
        vllm_version=version,
        row=row,
        dims=dims,
        dtype=options.dtype,
        max_part_size=options.max_part_size,
        stages=(),
        serving_files=serving_files,
        stale=cleanup.to_remove,
        tied_lm_head=None,
        left_alone=cleanup.left_alone,
    )


__all__ = [
    "DEFAULT_MAX_PART_SIZE",
    "SHARD_MANIFEST_NAME",
    "ModelDims",
    "PlannedFile",
    "PlannedTensor",
    "ReconstructionReport",
    "Segment",
    "ShardCheckFailed",
    "ShardOptions",
    "ShardPlan",
    "ShardResult",
    "StagePlan",
    "WrittenFile",
    "cast_bits",
    "check_reconstruction",
    "pipeline_stages",
    "plan_shard",
    "rank_segments",
    "shard_checkpoint",
    "split_into_parts",
]
