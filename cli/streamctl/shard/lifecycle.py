"""The steps every shard run takes on DEST, whichever engine made the weights: begin (the incomplete
manifest, then the serving files), undo what it began when it fails early, record the completed manifest."""

# Completion is explicit: before its first byte a run writes its manifest with `"complete": false`, then the
# small serving files (config, tokenizer), then the weights, removes (with --force) what earlier streamctl
# runs wrote and this one does not (streamctl.dest.ownership), checks, and replaces the manifest with the completed
# one last. A run killed or out of space anywhere leaves a DEST that `verify-index` (`shard-incomplete`) and
# `serve` refuse; one that fails in-process before its weights are committed removes what it began with.

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.checkpoint.sharded_names import parse_sharded_name
from streamctl.dest.lease import Lease
from streamctl.dest.uploads import CopiedFile, list_dest
from streamctl.errors import StreamctlError
from streamctl.progress import Progress
from streamctl.shard.plan import Engine, ShardOptions, ShardPlan
from streamctl.shard.result import (
    ShardCheckFailed,
    ShardResult,
    started_manifest,
    write_incomplete_manifest,
    write_shard_manifest,
)
from streamctl.shard.writer import copy_serving_files
from streamctl.storage.base import Location

_T = TypeVar("_T")


def begin_run(
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
    the names this created (none of them was in DEST before), which `undo_on_failure` removes again."""
    before = set(list_dest(dest))
    names = (SHARD_MANIFEST_NAME, *(path for path, _ in plan.serving_files))
    created = tuple(name for name in names if name not in before)
    older = [*plan.stale, *(item.path for item in plan.left_alone if item.streamctl)]

    def begin() -> tuple[CopiedFile, ...]:
        started = started_manifest(
            source=plan.source,
            engine=engine,
            tensor_parallel_size=plan.tensor_parallel_size,
            pipeline_parallel_size=plan.pipeline_parallel_size,
            pattern=plan.pattern,
            planned=planned,
            older_files=older,
        )
        write_incomplete_manifest(dest, started)
        return copy_serving_files(source, dest, plan.serving_files, options.retry)

    return undo_on_failure(dest, created, progress, begin), created


def undo_on_failure(dest: Location, created: Sequence[str], progress: Progress, step: Callable[[], _T]) -> _T:
    """Run `step`; if it fails before any weight is under its final name (the uploads were aborted), remove
    what `begin_run` created, so a failed run into a new DEST leaves it as it was. What `begin_run` replaced stays,
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


def record_result(dest: Location, result: ShardResult, lease: Lease) -> ShardResult:
    """The manifest, once both checks passed; ShardCheckFailed (exit 1, no manifest) otherwise."""
    if not result.ok:
        raise ShardCheckFailed(result)
    lease.ensure_held()  # after this renewal nobody can take DEST over before the manifest is written
    write_shard_manifest(dest, result)
    return result


def is_shard_output(pattern: str, serving_files: Sequence[tuple[str, int]], name: str) -> bool:
    """Whether `name` (relative to DEST) is a file `shard` writes there: rank files, serving files, manifest."""
    return (
        name == SHARD_MANIFEST_NAME
        or any(name == path for path, _ in serving_files)
        or parse_sharded_name(pattern, name) is not None
    )
