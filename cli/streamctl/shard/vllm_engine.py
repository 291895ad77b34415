"""`--engine vllm-gpu` (formerly `vllm`): vLLM's own `save_sharded_state` (shard/vllm_save.py, in a subprocess on GPUs) writes into
a temporary folder; its files are then streamed to DEST and checked and recorded as the offline writer's are."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from streamctl.checkpoint.files import CONFIG_NAME, listing_notes, log_notes
from streamctl.checkpoint.safetensors import ParsedHeader, parse_header, read_header
from streamctl.checkpoint.sharded_names import default_pattern, format_name, parse_sharded_name, validate_pattern
from streamctl.checkpoint.vllm_layouts import installed_vllm_version, layout_row
from streamctl.dest.lease import Lease, hold_lease
from streamctl.dest.overlap import check_disjoint
from streamctl.dest.ownership import Cleanup, remove_files
from streamctl.dest.uploads import discard_unfinished_uploads
from streamctl.errors import MissingProgramError, UsageError
from streamctl.interrupts import shielded_calls
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.retry import with_retries
from streamctl.shard.checks import check_written
from streamctl.shard.dest import RunKind, check_dest, check_shard_names
from streamctl.shard.lifecycle import begin_run, is_shard_output, record_result, undo_on_failure
from streamctl.shard.plan import ModelDims, ShardOptions, ShardPlan
from streamctl.shard.planning import list_source, plan_shard, read_json_object, serving_files_to_copy
from streamctl.shard.result import ShardResult, WrittenFile
from streamctl.shard.writer import PartStream, abort_all, commit_all, start_stream
from streamctl.storage.base import ListingNote, Location, ObjectInfo

# The script the engine subprocess runs (by path: vLLM's Python need not have streamctl installed).
VLLM_SAVE_SCRIPT = Path(__file__).with_name("vllm_save.py")


def _find_gpus() -> bool:
    """Whether this machine has NVIDIA GPUs, without importing torch."""
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


def check_vllm_engine_available() -> None:
    """The error naming what is missing for --engine vllm-gpu: the vllm package (exit 127, as for every missing
    program or extra), or CUDA GPUs (exit 2: nothing to install fixes that here)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise MissingProgramError(
            "--engine vllm-gpu needs the vllm package in this Python environment, and it is not installed",
            hint="pip install 'streamctl[vllm]' on a machine with GPUs, or use --engine vllm-cpu",
        )
    if not _find_gpus():
        raise UsageError(
            "--engine vllm-gpu needs CUDA GPUs (one per TP x PP rank), and this machine has none",
            hint="run it on a GPU machine, or use --engine vllm-cpu (vLLM's own model code on this CPU)",
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
        raise UsageError(
            "--engine vllm-gpu needs SOURCE as a local folder", hint="copy it first with `streamctl transfer`"
        )
    check_disjoint(source, dest)
    check_vllm_engine_available()
    started = time.monotonic()
    version = options.vllm_version or installed_vllm_version()
    pattern = options.pattern or default_pattern(options.pipeline_parallel_size)
    validate_pattern(pattern, options.tensor_parallel_size, options.pipeline_parallel_size)
    listing = list_source(source)
    notes = listing_notes(source)
    log_notes(notes, progress)
    config = read_json_object(source, CONFIG_NAME, listing.sizes[CONFIG_NAME]) if CONFIG_NAME in listing.sizes else {}
    serving = serving_files_to_copy(source, listing, config)
    # vLLM names its parts as it saves; each rank's first part stands for them (a longer part number is rare).
    ranks = [
        format_name(pattern, tp_rank=tp_rank, part=0, pp_rank=pp_rank)
        for pp_rank in range(options.pipeline_parallel_size)
        for tp_rank in range(options.tensor_parallel_size)
    ]
    check_shard_names(dest, [*ranks, *(path for path, _ in serving)])
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
    version: str | None,
    pattern: str,
    serving: tuple[tuple[str, int], ...],
    config: dict[str, Any],
    lease: Lease,
    notes: tuple[ListingNote, ...],
) -> ShardResult:
    # Under the lease (nobody writes meanwhile), and before the engine runs: a refusal costs nothing.
    tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
    kind = RunKind(source_id or source.url, "vllm-gpu", tp, pp, pattern)
    cleanup = check_dest(dest, pattern, {path for path, _ in serving}, options.force, kind=kind)
    with tempfile.TemporaryDirectory(prefix="streamctl-vllm-save-") as folder:
        arguments = {
            "model": source.url,
            "output": folder,
            "tensor_parallel_size": options.tensor_parallel_size,
            "pipeline_parallel_size": options.pipeline_parallel_size,
            "dtype": options.dtype,
            "pattern": pattern,
            "max_size": options.max_part_size,
            "enable_expert_parallel": options.enable_expert_parallel,
        }
        # -P: the script's folder (this package) is not put on the path of vLLM's Python.
        command = [sys.executable, "-P", str(VLLM_SAVE_SCRIPT), json.dumps(arguments)]
        progress.log("running vLLM's save_sharded_state (this starts a full engine)")
        completed = (runner or _run)(command)
        if completed.returncode != 0:
            tail = (completed.stderr or "").strip().splitlines()[-5:]
            raise UsageError(f"vLLM's save failed (exit {completed.returncode}): {' | '.join(tail)}")
        from streamctl.storage import open_location

        saved = open_location(folder)
        ours = partial(is_shard_output, pattern, serving)
        discarded = discard_unfinished_uploads(dest, ours, progress, lease.acquired_at)
        architecture = str((config.get("architectures") or ["?"])[0])
        plan = _plan_for_saved(source, dest, options, serving, version, pattern, source_id, cleanup, architecture)
        copied, created = begin_run(source, dest, plan, "vllm-gpu", [path for path, _ in serving], options, progress)
        files = undo_on_failure(
            dest, created, progress, partial(_copy_saved_files, saved, dest, pattern, options, progress)
        )
    write_seconds = time.monotonic() - started
    written = {file.path for file in files}
    removed = remove_files(dest, tuple(name for name in plan.stale if name not in written), progress)
    verify, reconstruction = check_written(source, dest, plan, options, progress, dtype_from_files=True)
    result = ShardResult(
        plan,
        "vllm-gpu",
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
    return record_result(dest, result, lease)


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)


def _copy_saved_files(
    saved: Location, dest: Location, pattern: str, options: ShardOptions, progress: Progress
) -> tuple[WrittenFile, ...]:
    """Stream vLLM's files to DEST (sha256 in flight), completing them all at the end.

    vLLM 0.33 writes an empty part file when a rank's first tensor exceeds max_size, and the Run:ai
    streamer fails on such a file: empty parts are left out and the rank's parts renumbered from 0.
    """
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
        with shielded_calls() as shielded:  # see writer.write_sharded
            for (pp_rank, tp_rank), parts in sorted(ranks.items()):
                for part, (_, info, header) in enumerate(sorted(parts, key=lambda item: item[0])):
                    name = format_name(pattern, tp_rank=tp_rank, pp_rank=pp_rank, part=part)
                    stream = shielded(
                        partial(start_stream, streams, dest, name, info.size, options.upload_chunk, options.retry)
                    )
                    for start in range(0, info.size, options.read_block):
                        length = min(options.read_block, info.size - start)
                        data = with_retries(partial(saved.store.read_range, info.key, start, length), options.retry)
                        stream.write(data)
                    tensors = tuple((tensor.name, tensor.dtype, tensor.shape) for tensor in header.tensors)
                    written.append(WrittenFile(name, pp_rank, tp_rank, part, info.size, stream.finish(), tensors))
        commit_all(streams, dest, options.retry, progress)
    except BaseException:
        abort_all(streams, progress)
        raise
    return tuple(written)


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
    return ShardPlan.for_run(
        source=source_id or source.url,
        dest=dest.url,
        options=options,
        pattern=pattern,
        version=version,
        row=row,
        dims=dims,
        stages=(),
        serving_files=serving_files,
        stale=cleanup.to_remove,
        tied_lm_head=None,
        left_alone=cleanup.left_alone,
    )
