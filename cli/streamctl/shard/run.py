"""`shard_checkpoint`, the library call behind `streamctl shard`, and `run_shard`, the one lifecycle of every
shard run whichever engine lays the files out: plan, lease, DEST state, write, check, record."""

# An engine (shard/engines/<name>/, behind shard/engine.py's protocol) plans, writes and checks; run_shard does
# the rest in the same order for all of them: the engine's plan before the lease; under it the plan with what
# DEST holds decided (shard/dest.py), the unfinished uploads of earlier runs discarded, the "incomplete" manifest
# and the serving files (shard/lifecycle.py), the weights, what --force removes, the checks, the result and the
# completed manifest last. The library never prints; it reports through `Progress`.

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from streamctl.dest.lease import Lease, hold_lease
from streamctl.dest.ownership import remove_files
from streamctl.dest.uploads import discard_unfinished_uploads
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.shard.auto import choose_engine
from streamctl.shard.engine import EngineRun, ShardEngine
from streamctl.shard.engines import create_engine
from streamctl.shard.lifecycle import begin_run, is_shard_output, record_result, undo_on_failure
from streamctl.shard.plan import ShardOptions, ShardPlan, skipped_files
from streamctl.shard.result import ShardCheckFailed, ShardResult
from streamctl.storage.base import ListingNote, Location

if TYPE_CHECKING:
    from streamctl.shard.engines.vllm_cpu.client import VllmWorker

# What the commands and other callers import from here (the types live in their own modules).
__all__ = ["ShardCheckFailed", "ShardOptions", "ShardResult", "run_shard", "shard_checkpoint"]


# =============================================================================================== entry points


def shard_checkpoint(
    source: Location,
    dest: Location,
    options: ShardOptions,
    progress: Progress = NULL_PROGRESS,
    source_id: str | None = None,
    worker: VllmWorker | None = None,
) -> ShardResult:
    """Plan, write, copy the serving files, check, and write the manifest, with the engine --engine names
    (`auto`: chosen from SOURCE's config.json).

    Raises UsageError/NotFoundError before writing anything when the input or the options are wrong, and
    ShardCheckFailed (exit 1) when the files were written but a check failed (then no manifest is written).
    `worker`: a started vllm-cpu worker to use (shard/engines/vllm_cpu/client.py), so that many runs share
    one vLLM.
    """
    options.validate()
    options = choose_engine(source, options, progress)
    return run_shard(source, dest, options, progress, create_engine(options.engine, worker), source_id)


def run_shard(
    source: Location,
    dest: Location,
    options: ShardOptions,
    progress: Progress,
    engine: ShardEngine,
    source_id: str | None = None,
) -> ShardResult:
    """One shard run with `engine`: its plan, then under DEST's lease its DEST plan, the unfinished uploads
    of earlier runs discarded, the "incomplete" manifest and the serving files, its write, what --force
    removes, its checks, and the completed manifest once they passed (ShardCheckFailed otherwise)."""
    options.validate()
    started = time.monotonic()
    run = EngineRun(source, dest, options, progress, source_id)
    with engine.session():
        notes = engine.plan(run)
        with hold_lease(dest, f"streamctl shard {run.source_label}", progress) as lease:
            run = replace(run, dest=lease.fenced(dest))
            plan = engine.plan_dest(run)  # planning ran before the lease: another run may have written here since
            return _write_and_record(engine, run, plan, lease, started, notes)


def _write_and_record(
    engine: ShardEngine, run: EngineRun, plan: ShardPlan, lease: Lease, started: float, notes: tuple[ListingNote, ...]
) -> ShardResult:
    dest, options, progress = run.dest, run.options, run.progress
    ours = partial(is_shard_output, plan.pattern, plan.serving_files)
    discarded = discard_unfinished_uploads(dest, ours, progress, lease.acquired_at)
    rank_files = [file.name for file in plan.files()] if engine.plans_rank_files else []
    planned = rank_files + [path for path, _ in plan.serving_files]
    copied, created = begin_run(run.source, dest, plan, engine.name, planned, options, progress)
    written = undo_on_failure(dest, created, progress, partial(engine.write, run, plan))
    write_seconds = time.monotonic() - started
    names = {file.path for file in written.files}
    # An earlier run's file this one wrote again is not stale (vllm-gpu's plan cannot know its part names).
    removed = remove_files(dest, tuple(name for name in plan.stale if name not in names), progress)
    checks = engine.checks(run, plan, written)
    result = ShardResult(
        plan,
        engine.name,
        written.files,
        copied,
        removed,
        written.bytes_written,
        time.monotonic() - started,
        write_seconds,
        checks.verify,
        checks.reconstruction,
        discarded,
        notes,
        tuple(sorted(skipped_files(plan))),
        tensor_check=checks.tensors,
        loader_check=checks.loader,
        engine_report=written.report,
    )
    return record_result(dest, result, lease)
