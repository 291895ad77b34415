"""`--engine vllm-cpu`: vLLM's own model classes lay the files out. A worker in a CPU-only vLLM environment
(client.py starts it; worker.py is the worker) builds every (pp_rank, tp_rank) one decoder layer at a time
and streams each tensor's bytes; streamctl plans the files from the worker's plan reply (parts by
`split_into_parts`, file layout by `stage_files`: the offline writer's rules), writes them through the usual
part streams (nothing under a final name until all are complete) and checks them (`VllmCpuEngine`);
`run_shard` records them as every engine's."""

from __future__ import annotations

import tempfile
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from streamctl.checkpoint.files import listing_notes, log_notes
from streamctl.checkpoint.index import INDEX_NAME
from streamctl.checkpoint.safetensors import DTYPE_BITS
from streamctl.checkpoint.vllm_layouts import LAYOUT_ROWS, Split
from streamctl.dest.overlap import check_disjoint
from streamctl.dest.uploads import ByteBudget, Cancelled
from streamctl.errors import EngineFailed, IntegrityError, UsageError
from streamctl.interrupts import Shielded, shielded_calls, stop_signal
from streamctl.progress import Progress
from streamctl.retry import RetryPolicy, with_retries
from streamctl.shard.checks import check_verify
from streamctl.shard.dest import RunKind, check_shard_names, output_names, plan_dest, refuse_unusable_dest_early
from streamctl.shard.engine import Checks, EngineRun, Written
from streamctl.shard.engines.vllm_cpu.checks import (
    LoaderCheckReport,
    TensorDigests,
    check_tensor_digests,
    digests_from_loader,
)
from streamctl.shard.engines.vllm_cpu.client import ReadSource, VllmWorker, plan_request, start_worker
from streamctl.shard.plan import (
    Engine,
    ModelDims,
    PlannedFile,
    PlannedTensor,
    ShardOptions,
    ShardPlan,
    SourceTensor,
    StagePlan,
    skipped_files,
    split_into_parts,
    stage_files,
)
from streamctl.shard.planning import (
    list_source,
    read_config,
    read_source_tensors,
    serving_files_to_copy,
    weight_files,
)
from streamctl.shard.writer import PartStream, WrittenFile, abort_all, commit_all, copy_serving_files, start_stream
from streamctl.storage.base import ListingNote, Location


@dataclass(frozen=True)
class _Source:
    """What the run read of SOURCE before the worker sees it."""

    notes: tuple[ListingNote, ...]
    config: dict[str, Any]
    serving: tuple[tuple[str, int], ...]
    tensors: Mapping[str, SourceTensor]
    source_files: tuple[tuple[str, int, str | None], ...]
    index: tuple[str, int] | None  # model.safetensors.index.json, copied for vLLM beside the serving files


def _read_source(source: Location, progress: Progress) -> _Source:
    notes = listing_notes(source)
    log_notes(notes, progress)
    listing = list_source(source)
    config = read_config(source, listing)
    tensors = read_source_tensors(source, listing, weight_files(source, listing))
    files = sorted({tensor.file for tensor in tensors.values()})
    return _Source(
        notes,
        config,
        serving_files_to_copy(source, listing, config),
        tensors,
        tuple((name, listing.sizes[name], listing.etags.get(name)) for name in files),
        (INDEX_NAME, listing.sizes[INDEX_NAME]) if INDEX_NAME in listing.sizes else None,
    )


def local_path(location: Location) -> str | None:
    """The folder of a local location, None for a bucket or the Hub."""
    return location.local_path()


def _model_dir(source: Location, read: _Source, folder: str, policy: RetryPolicy) -> str:
    """The folder vLLM's ModelConfig reads config.json (and the tokenizer's, processor's...) from: SOURCE
    itself when local, else a copy of its small serving files in `folder` (vLLM never reaches the source)."""
    path = local_path(source)
    if path is not None:
        return path
    from streamctl.storage import open_location

    files = [*read.serving, *([read.index] if read.index else [])]
    copy_serving_files(source, open_location(folder), files, policy)
    return folder


READ_AHEAD = 4  # ranged reads in flight while a "read" frame is answered


def _range_reader(source: Location, policy: RetryPolicy, block: int) -> ReadSource:
    """Answers the worker's reads of a bucket or Hub SOURCE: the range in blocks, a few read ahead, so
    memory stays near READ_AHEAD blocks whatever the size asked for."""

    def read_span(key: str, start: int, length: int) -> bytes:
        data = with_retries(partial(source.store.read_range, key, start, length), policy)
        if len(data) != length:
            raise IntegrityError(f"{source.store.url(key)} is shorter than its safetensors header says")
        return data

    def read(file: str, offset: int, length: int) -> Iterator[bytes]:
        key = source.key(file)
        spans = [(start, min(block, offset + length - start)) for start in range(offset, offset + length, block)]
        if len(spans) <= 1:
            yield from (read_span(key, *span) for span in spans)
            return
        with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="shard-source") as pool:
            pending: deque[Future[bytes]] = deque()
            try:
                for span in spans:
                    pending.append(pool.submit(read_span, key, *span))
                    if len(pending) >= READ_AHEAD:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for future in pending:
                    future.cancel()

    return read


def _ask_plan(
    worker: VllmWorker, source: Location, read: _Source, folder: str, options: ShardOptions, read_source: ReadSource
) -> dict[str, Any]:
    tensors = {
        name: {"file": t.file, "dtype": t.dtype, "shape": list(t.shape), "offset": t.offset, "nbytes": t.nbytes}
        for name, t in read.tensors.items()
    }
    request = plan_request(
        _model_dir(source, read, folder, options.retry),
        tensors,
        local_path(source),
        options.tensor_parallel_size,
        options.pipeline_parallel_size,
        options.enable_expert_parallel,
        options.dtype,
        options.layer_partition,
    )
    worker.request(request)
    reply = worker.receive(read_source)
    if reply.get("type") != "plan":
        raise worker.failure(f"the vLLM worker answered a plan request with a {reply.get('type')!r} frame")
    return reply


def _log_plan(reply: Mapping[str, Any], options: ShardOptions, progress: Progress) -> None:
    shims = reply.get("shims") or []
    used = f"; build-only stand-ins: {', '.join(map(str, shims))}" if shims else ""
    ep = ", expert parallel" if options.enable_expert_parallel else ""
    progress.log(
        f"vLLM {reply.get('vllm_version')} lays out {reply.get('architecture')} "
        f"(served as {reply.get('served_dtype')}{ep}){used}"
    )
    if reply.get("layerwise") is False:
        progress.log(
            f"vLLM's {reply.get('architecture')} has no pipeline stages, so each rank is built whole, not one "
            "layer at a time: the worker holds one rank's weights at once"
        )


def _reply_field(reply: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = reply.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise EngineFailed(f"the vLLM worker's plan has a bad {key!r}: {value!r}")
    return value


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in value
    )


def _planned_tensor(entry: Any, tp: int) -> PlannedTensor:
    """A plan entry; "rank_shapes" (every TP rank's shape, rank 0's first) where the ranks differ."""
    if not isinstance(entry, dict):
        raise EngineFailed(f"the vLLM worker's plan has a bad tensor entry: {entry!r}")
    name, dtype, shape, rank_shapes = (
        entry.get("name"),
        entry.get("dtype"),
        entry.get("shape"),
        entry.get("rank_shapes"),
    )
    if not isinstance(name, str) or dtype not in DTYPE_BITS or not isinstance(shape, list) or not _is_shape(shape):
        raise EngineFailed(f"the vLLM worker's plan has a bad tensor entry: {entry!r}")
    if rank_shapes is not None and not (
        isinstance(rank_shapes, list)
        and len(rank_shapes) == tp
        and all(_is_shape(item) and len(item) == len(shape) for item in rank_shapes)
        and rank_shapes[0] == shape
    ):
        raise EngineFailed(f"the vLLM worker's plan has bad per-rank shapes: {entry!r}")
    shapes = tuple(tuple(item) for item in rank_shapes) if rank_shapes else ()
    return PlannedTensor(name, Split.RANK_MODEL, (), str(dtype), tuple(shape), shapes)


def _stage(entry: Any, pp_rank: int, max_part_size: int, tp: int) -> StagePlan:
    if not isinstance(entry, dict) or entry.get("pp_rank") != pp_rank:
        raise EngineFailed(f"the vLLM worker's plan lacks pipeline stage {pp_rank}")
    layers = entry.get("layers")
    if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(layer, int) for layer in layers)):
        raise EngineFailed(f"the vLLM worker's plan has bad layers for stage {pp_rank}: {layers!r}")
    tensors = [_planned_tensor(item, tp) for item in _reply_field(entry, "tensors", list)]
    names = [tensor.name for tensor in tensors]
    if len(set(names)) != len(names):
        raise EngineFailed(f"the vLLM worker's plan names a tensor twice in stage {pp_rank}")
    if not tensors:
        raise UsageError(
            f"pipeline stage {pp_rank} holds no tensors, so vLLM would find no files for it",
            hint="use fewer stages or set VLLM_PP_LAYER_PARTITION",
        )
    return StagePlan(pp_rank, range(layers[0], layers[1]), split_into_parts(tensors, max_part_size))


def plan_from_reply(
    reply: Mapping[str, Any], read: _Source, options: ShardOptions, pattern: str, source: str, dest: str
) -> ShardPlan:
    """A normal ShardPlan from the worker's plan frame: its tensors in state-dict order cut into parts at
    --max-part-size, each file's tensors in safetensors order (`stage_files`), as the offline writer plans."""
    version = str(_reply_field(reply, "vllm_version", str))
    stages = _reply_field(reply, "stages", list)
    if len(stages) != options.pipeline_parallel_size:
        raise EngineFailed(
            f"the vLLM worker planned {len(stages)} pipeline stages, not {options.pipeline_parallel_size}"
        )
    architecture = str(_reply_field(reply, "architecture", str))
    num_layers = int(_reply_field(reply, "num_layers", int))
    settings = {
        "served_dtype": str(_reply_field(reply, "served_dtype", str)),
        "enable_expert_parallel": options.enable_expert_parallel,
        "quantization": reply.get("quantization"),
        "shims": [str(shim) for shim in reply.get("shims") or []],
        "layerwise": reply.get("layerwise") is not False,
        "torch_version": reply.get("torch_version"),
    }
    return ShardPlan.for_run(
        source,
        dest,
        options,
        pattern,
        version,
        row=LAYOUT_ROWS[0],  # unused: vLLM's model code decided the layout
        dims=ModelDims(architecture, 0, 0, 0, 0, 0, 0, num_layers, False),
        stages=tuple(
            _stage(entry, index, options.max_part_size, options.tensor_parallel_size)
            for index, entry in enumerate(stages)
        ),
        serving_files=read.serving,
        stale=(),
        tied_lm_head=None,
        source_files=read.source_files,
        engine="vllm-cpu",
        layout_label=f"vLLM {version} model code",
        engine_settings=settings,
    )


@dataclass(frozen=True)
class RoutedWrite:
    files: tuple[WrittenFile, ...]
    bytes_written: int
    digests: TensorDigests
    report: Mapping[str, Any]  # the worker's "written" frame


def _write_request(plan: ShardPlan, skip: frozenset[str]) -> dict[str, Any]:
    stages = []
    for stage in plan.stages:
        files = stage_files(plan, stage)
        parts = [
            [tensor.name for tensor in files[index * plan.tensor_parallel_size].tensors]
            for index in range(len(stage.parts))
            if files[index * plan.tensor_parallel_size].name not in skip and plan.writes_part(stage.pp_rank, index)
        ]
        stages.append({"pp_rank": stage.pp_rank, "parts": parts})
    return {"op": "write", "stages": stages}


@dataclass
class _Router:
    """Routes the worker's tensor frames into the part streams of their (pp_rank, tp_rank), checking each
    against the plan: name, dtype, shape, size and order. Frames are read on the caller's thread; one
    thread per TP rank writes (uploads) its file meanwhile, so the worker is not kept waiting on a bucket;
    a byte budget bounds what is read but not yet written."""

    plan: ShardPlan
    worker: VllmWorker
    dest: Location
    options: ShardOptions
    progress: Progress
    task: int
    read_source: ReadSource
    shielded: Shielded
    streams: list[PartStream]
    writers: Mapping[int, ThreadPoolExecutor]  # tp_rank -> its one writer thread
    cancelled: threading.Event
    digests: dict[tuple[int, int, str], str] = field(default_factory=dict)
    bytes_written: int = 0
    budget: ByteBudget = field(init=False)
    futures: list[Future[Any]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.budget = ByteBudget(self.options.max_buffer)

    def write_part(self, part_files: Sequence[PlannedFile]) -> list[WrittenFile]:
        chunk, policy = self.options.upload_chunk, self.options.retry
        opened = {}
        for file in part_files:
            start = partial(start_stream, self.streams, self.dest, file.name, file.size, chunk, policy)
            opened[file.tp_rank] = self.shielded(start)
            self._write(file.tp_rank, opened[file.tp_rank], file.header)
        pending = {file.tp_rank: deque(file.tensors) for file in part_files}
        for _ in range(sum(len(file.tensors) for file in part_files)):
            header = self.worker.receive(self.read_source)
            tp_rank, nbytes = self._check(header, part_files[0].pp_rank, pending)
            for data in self.worker.payload(nbytes):
                self._write(tp_rank, opened[tp_rank], data)
            self.digests[(part_files[0].pp_rank, tp_rank, str(header["name"]))] = str(header["sha256"])
        finishers = {rank: self.writers[rank].submit(stream.finish) for rank, stream in opened.items()}
        self.futures.extend(finishers.values())
        self._wait()
        return [
            WrittenFile(
                file.name, file.pp_rank, file.tp_rank, file.part, file.size, finishers[file.tp_rank].result(),
                tuple((tensor.name, tensor.dtype, tensor.shape) for tensor in file.tensors),
            )
            for file in part_files
        ]  # fmt: skip

    def _write(self, tp_rank: int, stream: PartStream, data: bytes) -> None:
        self._raise_failed()
        try:
            held = self.budget.acquire(len(data), self.cancelled)
        except Cancelled:
            self._wait()  # the writer's own error, rather than the cancellation it caused
            raise

        def write() -> None:
            try:
                if self.cancelled.is_set():
                    raise Cancelled()
                stream.write(data)
                with self._lock:
                    self.bytes_written += len(data)
                self.progress.advance(self.task, len(data))
            except BaseException:
                self.cancelled.set()  # stop the frame loop and the other ranks early
                raise
            finally:
                self.budget.release(held)

        self.futures.append(self.writers[tp_rank].submit(write))

    def _raise_failed(self) -> None:
        """A writer's error, as soon as the frame loop next writes (finished writes are dropped)."""
        if self.cancelled.is_set():
            self._wait()
            raise Cancelled()
        self.futures = [future for future in self.futures if not future.done() or future.exception() is not None]

    def _wait(self) -> None:
        wait(self.futures)
        errors = [error for error in (future.exception() for future in self.futures) if error is not None]
        self.futures = []
        real = [error for error in errors if not isinstance(error, Cancelled)]
        if real or errors:
            raise (real or errors)[0]

    def _check(
        self, header: Mapping[str, Any], pp_rank: int, pending: Mapping[int, deque[PlannedTensor]]
    ) -> tuple[int, int]:
        """The frame's TP rank and size, once it is the next tensor that rank's file expects."""
        if header.get("type") != "tensor":
            raise self.worker.failure(f"the vLLM worker sent a {header.get('type')!r} frame where a tensor was due")
        tp_rank = header.get("tp_rank")
        if header.get("pp_rank") != pp_rank or tp_rank not in pending:
            raise self.worker.failure(
                f"the vLLM worker sent {header.get('name')!r} for PP stage {header.get('pp_rank')}, TP rank "
                f"{tp_rank}, which is not a file being written (PP stage {pp_rank})"
            )
        assert isinstance(tp_rank, int)
        if not pending[tp_rank]:
            raise self.worker.failure(f"the vLLM worker sent more tensors than planned for TP rank {tp_rank}")
        planned = pending[tp_rank].popleft()
        got = (header.get("name"), header.get("dtype"), header.get("shape"), header.get("nbytes"))
        expected = (planned.name, planned.dtype, list(planned.shape), planned.nbytes)
        if got != expected or not isinstance(header.get("sha256"), str):
            raise self.worker.failure(
                f"the vLLM worker's tensor (name, dtype, shape, nbytes) {got} differs from the plan's {expected} "
                f"(PP stage {pp_rank}, TP rank {tp_rank})"
            )
        return tp_rank, planned.nbytes


def _reused(plan: ShardPlan, part_files: Sequence[PlannedFile]) -> list[WrittenFile]:
    return [
        WrittenFile(
            file.name, file.pp_rank, file.tp_rank, file.part, file.size, plan.reused[file.name],
            tuple((tensor.name, tensor.dtype, tensor.shape) for tensor in file.tensors),
        )
        for file in part_files
    ]  # fmt: skip


def _stop_writers(writers: Mapping[int, ThreadPoolExecutor], cancel: bool) -> None:
    for executor in writers.values():
        executor.shutdown(wait=True, cancel_futures=cancel)


def write_routed(
    plan: ShardPlan,
    worker: VllmWorker,
    dest: Location,
    options: ShardOptions,
    progress: Progress,
    read_source: ReadSource,
) -> RoutedWrite:
    """Ask the worker for every part not reused, write each tensor frame into its file, complete every
    upload at the end; any failure (a frame off the plan, the worker gone, Ctrl-C) aborts them all."""
    task = progress.task("Writing sharded state", plan.own_bytes)
    streams: list[PartStream] = []
    skip = skipped_files(plan)
    written: list[WrittenFile] = []
    cancelled = threading.Event()
    writers = {rank: ThreadPoolExecutor(1, f"shard-rank{rank}") for rank in range(plan.tensor_parallel_size)}
    try:
        with shielded_calls() as shielded:  # see writer.write_sharded
            router = _Router(
                plan, worker, dest, options, progress, task, read_source, shielded, streams, writers, cancelled
            )
            worker.request(_write_request(plan, skip))
            for stage in plan.stages:
                files = stage_files(plan, stage)
                for part in range(len(stage.parts)):
                    if not plan.writes_part(stage.pp_rank, part):
                        continue  # another `--worker` share's
                    part_files = [file for file in files if file.part == part]
                    if part_files[0].name in skip:
                        written.extend(_reused(plan, part_files))
                        progress.advance(task, sum(file.size for file in part_files))
                        progress.log(
                            f"part {part} of PP stage {stage.pp_rank}: unchanged since the previous run, skipped"
                        )
                        continue
                    written.extend(router.write_part(part_files))
            report = worker.receive(read_source)
            if report.get("type") != "written":
                raise worker.failure(f"the vLLM worker sent a {report.get('type')!r} frame after the last tensor")
        _stop_writers(writers, cancel=False)
        commit_all(streams, dest, options.retry, progress)
    except BaseException:
        cancelled.set()
        _stop_writers(writers, cancel=True)  # no upload is still being written while they are aborted
        abort_all(streams, progress)
        raise
    finally:
        progress.done(task)
    return RoutedWrite(tuple(written), router.bytes_written, router.digests, report)


@dataclass(frozen=True)
class _Planned:
    """What the engine planned before the lease."""

    plan: ShardPlan
    read_source: ReadSource


class VllmCpuEngine:
    """Plan with the worker, write what it sends, check with it. `worker`: one already started (a caller
    sharding many models shares one vLLM import); else one is started (and its environment found or made)
    and stopped at the end of the run. Its plan raises UsageError (exit 2, vLLM's own words) before anything
    is written when vLLM refuses the checkpoint; EngineFailed when the worker dies or breaks the protocol."""

    name: Engine = "vllm-cpu"
    plans_rank_files = True

    def __init__(self, worker: VllmWorker | None = None) -> None:
        self._worker = worker
        self._own = worker is None
        self._folder = ""
        self._planned: _Planned | None = None
        self._routed: RoutedWrite | None = None

    @contextmanager
    def session(self) -> Iterator[None]:
        """A temporary folder (vLLM's copy of a remote SOURCE's config); at the end, the worker stopped if
        the run started it, killed if a request was interrupted (its frames are still in the pipe)."""
        try:
            with tempfile.TemporaryDirectory(prefix="streamctl-vllm-cpu-") as folder:
                self._folder = folder
                yield
        except BaseException:
            if self._worker is not None and self._worker.busy:
                self._worker.kill("a request was interrupted", forward=stop_signal())
            raise
        finally:
            if self._own and self._worker is not None:
                self._worker.close(forward=stop_signal())

    def plan(self, run: EngineRun) -> tuple[ListingNote, ...]:
        source, dest, options, progress = run.source, run.dest, run.options, run.progress
        tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
        pattern = options.file_pattern()
        check_disjoint(source, dest)
        read = _read_source(source, progress)
        kind = RunKind(run.source_label, "vllm-cpu", tp, pp, pattern)
        refuse_unusable_dest_early(dest, pattern, {path for path, _ in read.serving}, options.force, kind)
        worker = self._start_worker(options, progress)
        read_source = _range_reader(source, options.retry, options.read_block)
        reply = _ask_plan(worker, source, read, self._folder, options, read_source)
        plan = plan_from_reply(reply, read, options, pattern, run.source_label, dest.url)
        _log_plan(reply, options, progress)
        check_shard_names(dest, output_names(plan))
        self._planned = _Planned(plan, read_source)
        return read.notes

    def plan_dest(self, run: EngineRun) -> ShardPlan:
        return plan_dest(run.dest, self._plan().plan, run.options.force)

    def write(self, run: EngineRun, plan: ShardPlan) -> Written:
        worker, read_source = self._running(), self._plan().read_source
        routed = write_routed(plan, worker, run.dest, run.options, run.progress, read_source)
        self._routed = routed
        report = {
            key: routed.report.get(key) for key in ("seconds", "peak_rss_mib", "kept_construction_value", "phases")
        }
        return Written(routed.files, routed.bytes_written, report)

    def checks(self, run: EngineRun, plan: ShardPlan, written: Written) -> Checks:
        """vLLM's loader check (local DEST) runs in the worker while this process runs verify-index; its
        per-tensor sha256 comparisons are the tensor check. Without it, every tensor is re-read from DEST."""
        dest, options, progress = run.dest, run.options, run.progress
        assert self._routed is not None
        sent, reused = self._routed.digests, len(skipped_files(plan))
        whole = plan.share is None  # a `--worker` share checks its own tensors; whole_checks the rest at the end
        if whole and self._start_loader_check(dest, plan):
            verified = check_verify(dest, plan, progress)
            loader = self._loader_check({(pp_rank, tp_rank) for pp_rank, tp_rank, _ in sent})
            return Checks(verified, None, digests_from_loader(loader, sent, reused_files=reused), loader)
        verify = check_verify(dest, plan, progress) if whole else None
        digests = check_tensor_digests(
            dest, plan, sent, options.retry, progress, reused_files=reused, chunk=options.read_block
        )
        return Checks(verify, None, digests, None)

    def whole_checks(self, run: EngineRun, plan: ShardPlan) -> Checks:
        """The `--worker` run completing the set: verify-index, and vLLM's loader on every rank (local DEST;
        the tensors this worker did not send are checked by name, shape and dtype, their bytes by their own
        worker's digests)."""
        every_rank = sorted({(file.pp_rank, file.tp_rank) for file in plan.files()})
        started = self._start_loader_check(run.dest, plan, every_rank)
        verify = check_verify(run.dest, plan, run.progress)
        return Checks(verify, None, None, self._loader_check(set(every_rank)) if started else None)

    def _start_worker(self, options: ShardOptions, progress: Progress) -> VllmWorker:
        if self._worker is None:
            from streamctl.shard.engines.vllm_cpu.env import resolve_vllm_python

            python = resolve_vllm_python(options.vllm_python, options.vllm_version, progress)
            self._worker = start_worker(python.path, progress, forward_logs=options.engine_logs)
        self._worker.progress, self._worker.forward_logs = progress, options.engine_logs
        return self._worker

    def _running(self) -> VllmWorker:
        if self._worker is None:
            raise RuntimeError("the vllm-cpu engine's worker is not started (plan first)")
        return self._worker

    def _plan(self) -> _Planned:
        if self._planned is None:
            raise RuntimeError("the vllm-cpu engine has not planned yet")
        return self._planned

    def _start_loader_check(
        self, dest: Location, plan: ShardPlan, ranks: Sequence[tuple[int, int]] | None = None
    ) -> bool:
        """Ask the worker to load the written files with vLLM's own ShardedStateLoader (local DEST only): the
        ranks it sent tensors of, or `ranks`; every rank in about one tensor's memory."""
        folder = local_path(dest)
        if folder is None:
            return False
        request: dict[str, Any] = {"op": "check", "dest_dir": folder, "pattern": plan.pattern}
        if ranks is not None:
            request["ranks"] = [list(rank) for rank in ranks]
        self._running().request(request)
        return True

    def _loader_check(self, ranks: set[tuple[int, int]]) -> LoaderCheckReport:
        """The worker's answer to `_start_loader_check`; every rank of `ranks` must be in it."""
        worker = self._running()
        frame = worker.receive(self._plan().read_source)
        if frame.get("type") != "checked":
            raise worker.failure(f"the vLLM worker answered a check request with a {frame.get('type')!r} frame")
        return LoaderCheckReport.from_frame(frame, ranks)
