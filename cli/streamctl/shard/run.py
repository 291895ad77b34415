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
from streamctl.dest.uploads import CopiedFile, discard_unfinished_uploads
from streamctl.errors import UsageError
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.shard.auto import choose_engine
from streamctl.shard.engine import Checks, EngineRun, ShardEngine, Written
from streamctl.shard.engines import create_engine
from streamctl.shard.lifecycle import begin_run, is_shard_output, record_result, undo_on_failure
from streamctl.shard.plan import ShardOptions, ShardPlan, skipped_files
from streamctl.shard.result import ShardCheckFailed, ShardResult
from streamctl.shard.shares import ShardShare, begin_share, nothing_to_do, record_share, take_share
from streamctl.shard.writer import copy_serving_files
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
    worker = options.worker
    if worker is not None and not engine.plans_rank_files:
        raise UsageError(
            f"--worker {worker} with --engine {engine.name}: vLLM's own save names its files as it writes them, "
            "so they cannot be split between workers beforehand",
            hint="use --engine vllm-cpu or offline for a split run",
        )
    started = time.monotonic()
    run = EngineRun(source, dest, options, progress, source_id)
    command = f"streamctl shard {run.source_label}" + (f" --worker {worker}" if worker else "")
    with engine.session():
        notes = engine.plan(run)
        with hold_lease(dest, command, progress, worker=worker) as lease:
            run = replace(run, dest=lease.fenced(dest))
            plan = engine.plan_dest(run)  # planning ran before the lease: another run may have written here since
            if worker is None:
                return _write_and_record(engine, run, plan, lease, started, notes)
            return _write_share(engine, run, plan, lease, started, notes)


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
    result = _result(engine, plan, written, copied, removed, (started, write_seconds), checks, discarded, notes)
    return record_result(dest, result, lease)


def _result(
    engine: ShardEngine,
    plan: ShardPlan,
    written: Written,
    copied: tuple[CopiedFile, ...],
    removed: tuple[str, ...],
    times: tuple[float, float],
    checks: Checks,
    discarded: tuple[str, ...],
    notes: tuple[ListingNote, ...],
) -> ShardResult:
    started, write_seconds = times
    return ShardResult(
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


def _write_share(
    engine: ShardEngine, run: EngineRun, plan: ShardPlan, lease: Lease, started: float, notes: tuple[ListingNote, ...]
) -> ShardResult:
    """A `--worker K/N` run (shard/shares.py): under its share's lease, the unfinished uploads of its own files
    discarded, the split's record begun, its parts written (share 0: and the serving files) and checked,
    then merged into the record; the worker completing the set checks the whole set first."""
    dest, options, progress = run.dest, run.options, run.progress
    assert options.worker is not None
    plan, share = take_share(plan, options.worker)
    own = {file.name for file in plan.own_files()}
    serving = plan.serving_files if share.copies_serving_files else ()
    ours = lambda name: name in own or any(name == path for path, _ in serving)  # noqa: E731
    discarded = discard_unfinished_uploads(dest, ours, progress, lease.acquired_at)
    _log_share(plan, share, progress)
    done = nothing_to_do(plan)  # DEST holds this plan complete, this share's files unchanged
    restarted = not done and begin_share(dest, plan, engine.name, share, lease.guard_commit)
    copied = copy_serving_files(run.source, dest, serving, options.retry) if not done else ()
    written = engine.write(run, plan)
    write_seconds = time.monotonic() - started
    checks = engine.checks(run, plan, written)
    result = _result(engine, plan, written, copied, (), (started, write_seconds), checks, discarded, notes)
    if not result.ok:
        raise ShardCheckFailed(result)

    def complete() -> ShardResult:  # this share completes the set: what a whole run does at its end
        removed = remove_files(dest, plan.stale, progress)
        whole = engine.whole_checks(run, plan)
        checked = replace(result, removed=removed, verify=whole.verify, loader_check=whole.loader)
        if not checked.ok:
            raise ShardCheckFailed(checked)
        lease.ensure_held()  # after this renewal nobody can take the share over before the manifest is written
        return checked

    lease.ensure_held()
    recorded = record_share(dest, result, share, complete, lease.guard_commit, restarted)
    if recorded.share is not None and recorded.share.restarted:
        progress.log(
            "the shard manifest recorded the shares of another split or plan; it records this one's from now on: "
            f"run every --worker K/{share.worker.count} of this split"
        )
    if recorded.share is not None and not recorded.share.complete:
        progress.log(
            f"worker {share.worker}: share recorded; {len(recorded.share.finished)} of {share.worker.count} done"
        )
    return replace(recorded, worker=share.worker, seconds=time.monotonic() - started)


def _log_share(plan: ShardPlan, share: ShardShare, progress: Progress) -> None:
    parts = sum(len(parts) for parts in share.shares)
    if not share.parts:
        progress.log(f"worker {share.worker}: no part of the {parts} falls to this share; it only records it")
        return
    progress.log(
        f"worker {share.worker}: {len(share.parts)} of {parts} parts, {len(plan.own_files())} rank files "
        f"of {plan.own_bytes:,} bytes" + ("; and the serving files" if share.copies_serving_files else "")
    )
