"""What a shard run is to produce: the options, the model's dimensions, the plan of every output file, and
the pure layout rules (pipeline stages, each rank's rows and columns, parts, file order) that decide it."""

# Order: tensors are assigned to parts in `model.state_dict()` order after vLLM's `_filter_subtensors` (what
# vLLM's `save_model` iterates); within a file they are laid out the way `safetensors.save_file` lays them
# out (descending dtype alignment, then name), so a file is byte-identical to what vLLM's save would write.

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from streamctl.checkpoint.header_types import DTYPE_ALIGNMENT_RANK
from streamctl.checkpoint.safetensors import DTYPE_BITS, encode_safetensors_header
from streamctl.checkpoint.sharded_names import default_pattern, format_name, validate_pattern
from streamctl.checkpoint.vllm_layouts import VOCAB_PADDING, LayoutRow, Split, parse_version
from streamctl.common.limits import check_parallel_sizes, shown_number
from streamctl.common.sizes import GiB, MiB
from streamctl.dest.ownership import LeftAlone
from streamctl.dest.shares import Worker
from streamctl.errors import UsageError
from streamctl.retry import RetryPolicy

DEFAULT_MAX_PART_SIZE = 5 * GiB  # vLLM's save_sharded_state script default
# Multipart part size (S3 needs >= 5 MiB), and about the size of every block read, copied or cast.
UPLOAD_CHUNK = 8 * MiB  # multipart part size for buckets (fewer, larger requests per rank stream)
# Source rows are read, sliced and written in blocks of about this size. Measured here (3.1 GB, local
# DEST): 4 MiB blocks shard in 2.0-2.2 s at TP 2 where 8 MiB blocks took 3.4-4.1 s, with a third of the
# kernel time; 2 MiB is no faster and costs more Python per byte.
READ_BLOCK = 4 * MiB
MAX_BUFFER = 128 * MiB  # bytes read (and copied) but not yet written, at most

DtypeChoice = Literal["auto", "bfloat16", "float16", "float32"]
# The engine that made a run's files (recorded in its manifest), and what --engine may name ("auto" picks
# one of them from config.json; "vllm" is accepted as the old name of "vllm-gpu").
Engine = Literal["offline", "vllm-cpu", "vllm-gpu"]
EngineChoice = Literal["auto", "offline", "vllm-cpu", "vllm-gpu"]
ENGINE_CHOICES: tuple[str, ...] = ("auto", "offline", "vllm-cpu", "vllm-gpu")
ENGINE_ALIASES: Mapping[str, str] = {"vllm": "vllm-gpu"}
DTYPE_CHOICES: Mapping[str, str | None] = {"auto": None, "bfloat16": "BF16", "float16": "F16", "float32": "F32"}


# =============================================================================================== options


@dataclass(frozen=True)
class ShardOptions:
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    pattern: str | None = None  # None: vLLM's default for the PP size
    max_part_size: int = DEFAULT_MAX_PART_SIZE
    dtype: DtypeChoice = "auto"  # auto keeps each tensor's checkpoint dtype
    # offline: the layout row's vLLM (None: the installed vllm's, else the newest row); vllm-cpu: the vLLM
    # environment's version (None: the newest layout row's, built and cached once).
    vllm_version: str | None = None
    engine: EngineChoice = "auto"
    vllm_python: str | None = None  # vllm-cpu: an existing vLLM environment's python (else one is made)
    enable_expert_parallel: bool = False  # vLLM's --enable-expert-parallel: experts split over the TP ranks
    data_parallel_size: int = 1  # only 1: see validate
    engine_logs: bool = False  # vllm-cpu: forward vLLM's own log lines (the worker's stderr) to the progress log
    force: bool = False
    worker: Worker | None = None  # `--worker K/N`: write share K of N (streamctl.shard.shares)
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
        if self.engine not in ENGINE_CHOICES:
            raise UsageError(f"unknown --engine {self.engine!r}", hint=f"use one of {', '.join(ENGINE_CHOICES)}")
        self._validate_parallel_engine()
        if self.upload_chunk < 1 or self.read_block < 1 or self.max_buffer < self.read_block:
            raise UsageError("the upload chunk and read block must be positive, the block no larger than the buffer")

    def file_pattern(self) -> str:
        """The rank files' name pattern: --pattern, else vLLM's default for the PP size; UsageError when it
        does not name every rank's files apart."""
        pattern = self.pattern or default_pattern(self.pipeline_parallel_size)
        validate_pattern(pattern, self.tensor_parallel_size, self.pipeline_parallel_size)
        return pattern

    def _validate_parallel_engine(self) -> None:
        if self.data_parallel_size < 1:
            raise UsageError(
                f"--data-parallel-size must be at least 1, not {shown_number(self.data_parallel_size)}",
                code="bad-option-value",
            )
        if self.data_parallel_size > 1:
            # vllm/model_executor/model_loader/sharded_state_loader.py (0.33), _render_default_pattern: a file
            # name is `pattern.format(pp_rank=..., tp_rank=..., rank=tp_rank, part=...)` and any other field
            # is refused, so two DP replicas' ranks with the same TP rank load the same files, while under
            # expert parallelism (EP world = DP x TP) they hold different experts.
            raise UsageError(
                f"--data-parallel-size {self.data_parallel_size}: vLLM's sharded-state file names carry the TP "
                "(and PP) rank only, not the data-parallel rank, so every DP replica loads the same rank files "
                "and ranks of different replicas cannot hold different experts",
                hint="shard for one replica (--data-parallel-size 1) and serve every replica from the same files",
                code="bad-option-value",
            )
        if self.worker is not None and self.engine == "vllm-gpu":
            raise UsageError(
                f"--worker {self.worker} with --engine vllm-gpu: vLLM's own save names its files as it writes "
                "them, so they cannot be split between workers beforehand",
                hint="use --engine vllm-cpu or offline (or auto) for a split run",
            )
        if self.enable_expert_parallel and self.engine == "offline":
            raise UsageError(
                "--enable-expert-parallel: the offline writer lays out no experts",
                hint="use --engine vllm-cpu (or auto)",
            )


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
    """One tensor of every TP rank of a stage (same name and dtype on each rank; the same shape, except where
    `rank_shapes` gives every rank's: vLLM's expert parallelism over experts it does not divide)."""

    name: str
    split: Split
    sources: tuple[SourceTensor, ...]
    dtype: str
    shape: tuple[int, ...]
    rank_shapes: tuple[tuple[int, ...], ...] = ()  # empty: `shape` on every rank

    def on_rank(self, tp_rank: int) -> PlannedTensor:
        """This tensor as TP rank `tp_rank`'s file holds it."""
        if not self.rank_shapes or self.rank_shapes[tp_rank] == self.shape:
            return self
        return replace(self, shape=self.rank_shapes[tp_rank], rank_shapes=())

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
    stale: tuple[
        str, ...
    ]  # DEST files earlier streamctl runs wrote that --force removes (see streamctl.dest.ownership)
    tied_lm_head: SourceTensor | None  # the checkpoint's own lm_head when config says tied: must equal embed
    left_alone: tuple[LeftAlone, ...] = ()  # DEST files this run neither writes nor removes
    # (path, size, etag) of every source weight file: a re-run may reuse DEST files only if none changed.
    source_files: tuple[tuple[str, int, str | None], ...] = ()
    # DEST rank files a completed earlier run of this same plan left, unchanged: path -> their sha256.
    reused: Mapping[str, str] = field(default_factory=dict)
    engine: Engine = "offline"  # what lays the files out (a re-run reuses files of the same engine only)
    layout_label: str | None = None  # what decided the layout when no table row did (vllm-cpu)
    # Settings of the engine beyond the table's, recorded in the manifest and compared by a re-run
    # (vllm-cpu: expert parallelism, served dtype, build shims, quantization method).
    engine_settings: Mapping[str, Any] = field(default_factory=dict)
    # `--worker K/N`: the (pp_rank, part) this run writes, every TP rank of each (streamctl.shard.shares);
    # None: every part. The plan itself stays whole: every worker names, and checks names against, every file.
    share: frozenset[tuple[int, int]] | None = None

    @property
    def layout(self) -> str:
        return self.layout_label or self.row.label

    def files(self) -> list[PlannedFile]:
        return [file for stage in self.stages for file in stage_files(self, stage)]

    def writes_part(self, pp_rank: int, part: int) -> bool:
        """Whether this run writes part `part` of stage `pp_rank` (a `--worker` run: only its share's)."""
        return self.share is None or (pp_rank, part) in self.share

    def own_files(self) -> list[PlannedFile]:
        """The rank files this run writes: every planned one, or a `--worker` run's share."""
        return [file for file in self.files() if self.writes_part(file.pp_rank, file.part)]

    @property
    def total_bytes(self) -> int:
        return sum(file.size for file in self.files())

    @property
    def own_bytes(self) -> int:
        return sum(file.size for file in self.own_files())

    @classmethod
    def for_run(
        cls, source: str, dest: str, options: ShardOptions, pattern: str, version: str | None, **layout: Any
    ) -> ShardPlan:
        """A plan with the run's own fields taken from `options`; `layout` holds the rest (row, dims, stages...)."""
        return cls(
            source=source,
            dest=dest,
            tensor_parallel_size=options.tensor_parallel_size,
            pipeline_parallel_size=options.pipeline_parallel_size,
            pattern=pattern,
            vllm_version=version,
            dtype=options.dtype,
            max_part_size=options.max_part_size,
            **layout,
        )


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
    return tuple(range(start, start + count) for start, count in zip(starts, counts, strict=False))


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


def safetensors_order(tensors: Sequence[PlannedTensor]) -> list[PlannedTensor]:
    """The order `safetensors.save_file` lays tensors out in: descending dtype alignment, then by name."""
    return sorted(tensors, key=lambda tensor: (-DTYPE_ALIGNMENT_RANK.get(tensor.dtype, 0), tensor.name))


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
        shared = _file_header(ordered)
        for tp_rank in range(plan.tensor_parallel_size):
            name = format_name(plan.pattern, tp_rank=tp_rank, pp_rank=stage.pp_rank, part=part_index)
            own = tuple(tensor.on_rank(tp_rank) for tensor in ordered)
            header = shared if own == ordered else _file_header(own)
            files.append(PlannedFile(name, stage.pp_rank, tp_rank, part_index, own, header))
    return files


def _file_header(tensors: Sequence[PlannedTensor]) -> bytes:
    header, _ = encode_safetensors_header(
        [(tensor.name, tensor.dtype, tensor.shape, tensor.nbytes) for tensor in tensors]
    )
    return header


def skipped_files(plan: ShardPlan) -> frozenset[str]:
    """The rank files a re-run leaves as they are: every TP rank of a part reused (they are cut from the
    same reads, so a part is skipped or written for all ranks together); a `--worker` run's, of its share."""
    if not plan.reused:
        return frozenset()
    skipped: set[str] = set()
    for stage in plan.stages:
        files = stage_files(plan, stage)
        for part_index in range(len(stage.parts)):
            names = [file.name for file in files if file.part == part_index]
            if plan.writes_part(stage.pp_rank, part_index) and all(name in plan.reused for name in names):
                skipped.update(names)
    return frozenset(skipped)
