# numpy is imported lazily (typed Any) so that `--help` stays fast: its results are Any to mypy.
# mypy: disable-error-code="no-any-return"
"""Moving tensor bytes: the blocks of whole source rows each TP rank's tensor is cut from (one ranged read
each), the bits-only casts between BF16, F16 and F32, and the per-rank chunks a block becomes."""

# Memory is bounded by buffers, not by tensors: each tensor is cut into blocks of whole source rows of about
# `read_block` bytes (`tensor_blocks`), each read with one ranged read of the source (a local file or a
# bucket object alike) and cut for the TP ranks that need it: rows a rank holds whole are passed on as read,
# column slices and casts are copied. Rows several ranks hold (replicated tensors, shared KV heads) are read once.

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from streamctl.checkpoint.safetensors import DTYPE_BITS
from streamctl.checkpoint.vllm_layouts import Split
from streamctl.errors import IntegrityError, UsageError
from streamctl.retry import RetryPolicy, with_retries
from streamctl.shard.plan import ModelDims, PlannedTensor, Segment, SourceTensor, rank_segments
from streamctl.storage.base import Location

if TYPE_CHECKING:
    import numpy as np

SCALE_ONE_BYTES = b"\x00\x00\x80\x3f"  # float32 1.0, little-endian: vLLM's attention scale buffers


# =============================================================================================== casting


def lazy_numpy() -> Any:
    import numpy  # lazily: `streamctl --help` and the other commands never load it

    return numpy


def storage_dtype(dtype: str) -> Any:
    """The unsigned integer numpy dtype with the element size of a safetensors dtype (data is moved as bits)."""
    np_ = lazy_numpy()
    bits = DTYPE_BITS[dtype]
    if bits not in (8, 16, 32, 64):
        raise UsageError(f"{dtype} has {bits}-bit elements; the offline writer handles whole-byte dtypes only")
    return {8: np_.uint8, 16: np_.dtype("<u2"), 32: np_.dtype("<u4"), 64: np_.dtype("<u8")}[bits]


def _to_float32(bits: np.ndarray, dtype: str) -> np.ndarray:
    np_ = lazy_numpy()
    if dtype == "F32":
        return bits.view(np_.float32)
    if dtype == "F16":
        return bits.view(np_.float16).astype(np_.float32)
    return (bits.astype(np_.uint32) << 16).view(np_.float32)  # BF16 is the top half of an F32: exact


def _from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    np_ = lazy_numpy()
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
    np_ = lazy_numpy()
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


def block_budget(block: Block, out_dtype: str) -> int:
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
