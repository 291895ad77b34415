"""Writing the planned rank files: one `PartStream` per output object, the TP ranks of a stage written in
lockstep by one thread each, and every upload completed together at the end or aborted (`write_sharded`)."""

# Plan first, then write: every file's header is known before its first data byte, so each file is streamed
# (header, then tensors) through the store's multipart upload, or written in place where the upload offers
# positional writes (a local file). Nothing is visible under a final name until every file is written:
# uploads are completed together at the end, and any failure before that aborts all of them. A pool reads
# blocks a few ahead; a byte budget bounds what is read but not yet written.

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial

from streamctl.checkpoint.vllm_layouts import TIED_LM_HEAD_RULE
from streamctl.dest.uploads import SHA256_KEY, ByteBudget, Cancelled, CopiedFile, part_size_for
from streamctl.errors import IntegrityError, StreamctlError, UsageError
from streamctl.interrupts import Shielded, shielded_calls
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.retry import RetryPolicy, with_retries
from streamctl.shard.blocks import Block, block_budget, block_chunks, read_block, tensor_blocks
from streamctl.shard.plan import (
    READ_BLOCK,
    PlannedFile,
    PlannedTensor,
    ShardOptions,
    ShardPlan,
    SourceTensor,
    StagePlan,
    skipped_files,
    stage_files,
)
from streamctl.storage.base import Location, MultipartUpload, PositionalWrite


@dataclass(frozen=True)
class WrittenFile:
    """A rank file written (or kept by a re-run) under its final name."""

    path: str
    pp_rank: int
    tp_rank: int
    part: int
    size: int
    sha256: str
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape) in file order


READ_AHEAD = 4  # block reads in flight (they also overlap the writes)


class PartStream:
    """One output object: bytes written in order, cut into fixed-size multipart parts (or written in place
    where the upload has a positional writer), sha256 in flight.

    A part is assembled with one copy (`b"".join` of the pieces that fill it); only a tail shorter than a
    part is copied on its own, because the caller may reuse its buffer once `write` returns. `finish()`
    sends the last part but does not complete the upload: completing is the caller's commit step, so that
    nothing appears under a final name before every file is written.
    """

    def __init__(self, location: Location, name: str, size: int, chunk: int, policy: RetryPolicy) -> None:
        store = location.store
        self.name = name
        self.size = size
        self.part_size = part_size_for(size, chunk, store)
        self.policy = policy
        key = location.key(name)
        self.upload: MultipartUpload = with_retries(partial(store.start_multipart, key, self.part_size), policy)
        self.digest = hashlib.sha256()
        self.pending: list[bytes | memoryview] = []
        self.pending_bytes = 0
        self.next_part = 0
        self.written = 0
        # Where the upload writes at offsets (a local file): each chunk goes in place, which spares the copy
        # that assembling a part takes. The upload still owns the object: complete() makes it visible
        # (locally: fsync and rename), abort() removes it.
        self._write_at: PositionalWrite | None = self.upload.positional_writer()

    def write(self, chunk: bytes | memoryview) -> None:
        view = memoryview(chunk).cast("B")
        self.digest.update(view)
        if self._write_at is not None:
            self._write_at(self.written, view)
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
        if self._write_at is None and (self.pending or self.next_part == 0):
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
                if not self.plan.writes_part(stage.pp_rank, part_index):
                    continue  # another `--worker` share's
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
                for file, finisher in zip(part_files, finishers, strict=False):
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
            stopped = isinstance(error, KeyboardInterrupt)  # Ctrl-C or SIGTERM: what the threads hit is its echo
            if cause is not None and cause is not error and not isinstance(cause, Cancelled) and not stopped:
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
                    raise Cancelled()
                need = min(block_budget(block, tensor.dtype), self.options.max_buffer)
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
        start = partial(start_stream, self.open_streams, self.dest, file.name, file.size, chunk, policy)
        return self.shielded(start)

    def _submit(
        self, executor: ThreadPoolExecutor, stream: PartStream, chunk: memoryview, countdown: _Countdown | None
    ) -> Future[None]:
        def write() -> None:
            try:
                if self.cancelled.is_set():
                    raise Cancelled()
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
    return next((error for error in errors if not isinstance(error, Cancelled)), errors[0] if errors else None)


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


def abort_all(streams: Sequence[PartStream], progress: Progress) -> None:
    for stream in streams:
        try:
            stream.upload.abort()
        except StreamctlError as error:
            progress.log(f"could not abort the upload of {stream.name}: {error.message}")


def commit_all(streams: Sequence[PartStream], dest: Location, policy: RetryPolicy, progress: Progress) -> None:
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
        abort_all([stream for stream in streams if stream not in completed], progress)
        raise


def write_sharded(
    plan: ShardPlan, source: Location, dest: Location, options: ShardOptions, progress: Progress = NULL_PROGRESS
) -> tuple[tuple[WrittenFile, ...], int]:
    """Write every planned file and complete them all at the end; a failure aborts every upload."""
    task = progress.task("Writing sharded state", plan.own_bytes)
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
        commit_all(open_streams, dest, options.retry, progress)
    except BaseException:
        cancelled.set()
        abort_all(open_streams, progress)
        raise
    finally:
        progress.done(task)
    return tuple(writer.written), writer.bytes_written


def start_stream(
    streams: list[PartStream], dest: Location, name: str, size: int, chunk: int, policy: RetryPolicy
) -> PartStream:
    stream = PartStream(dest, name, size, chunk, policy)
    streams.append(stream)  # before anything can interrupt: the abort path must see it
    return stream


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
