"""`shard_checkpoint`, the library call behind `streamctl shard`: plan, write vLLM sharded-state files
(`model-rank-{rank}-part-{part}.safetensors`) on a CPU, locally or into a bucket, check them, record them."""

# What gets written is decided by one table, `streamctl.checkpoint.vllm_layouts` (names, sources and splits
# per vLLM version range); shard/planning.py plans by it, shard/writer.py writes, shard/checks.py checks, and
# shard/lifecycle.py marks DEST incomplete until both checks passed. `--engine vllm` (shard/vllm_engine.py)
# runs vLLM's own save instead and shares the rest. The library never prints; it reports through `Progress`.

from __future__ import annotations

import time
from functools import partial

from streamctl.checkpoint.files import listing_notes, log_notes
from streamctl.lease import Lease, hold_lease
from streamctl.ownership import remove_files
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.shard.checks import check_written
from streamctl.shard.dest import plan_dest
from streamctl.shard.lifecycle import begin_run, is_shard_output, record_result, undo_on_failure
from streamctl.shard.plan import ShardOptions, ShardPlan, skipped_files
from streamctl.shard.planning import plan_shard
from streamctl.shard.result import ShardCheckFailed, ShardResult
from streamctl.shard.vllm_engine import shard_with_vllm
from streamctl.shard.writer import write_sharded
from streamctl.storage.base import ListingNote, Location
from streamctl.uploads import discard_unfinished_uploads

# What the commands and other callers import from here (the types live in their own modules).
__all__ = ["ShardCheckFailed", "ShardOptions", "ShardResult", "shard_checkpoint"]


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
        plan = plan_dest(dest, plan, options.force)
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
