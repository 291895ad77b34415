"""One transfer run: plan, copy every planned file under DEST's lease, remove what --force replaces, write
the manifest, then check DEST with verify-index.

`--worker K/N` (streamctl.dest.shares): the run holds that share's lease, and the manifest is merged share by
share; the worker whose share completes it removes what --force replaces.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from streamctl.checkpoint.files import MANIFEST_NAME, notes_to_json, weights_file
from streamctl.dest.lease import Lease, hold_lease
from streamctl.dest.manifests import FileEntry, TransferManifest, put_manifest, read_dest_manifests
from streamctl.dest.overlap import check_disjoint
from streamctl.dest.ownership import remove_files
from streamctl.dest.shares import ShareFields, ShareRecord, record_share
from streamctl.dest.uploads import ByteBudget, CopiedFile, discard_unfinished_uploads, list_dest
from streamctl.errors import ChecksFailed, DestinationBusy, NotFoundError, RemoteError
from streamctl.interrupts import shielded_calls
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.storage import deadlines
from streamctl.storage.base import ListingNote, Location, StorageOptions
from streamctl.transfer.engine import Engine
from streamctl.transfer.plan import TransferOptions, TransferPlan, check_manifest, plan_transfer

if TYPE_CHECKING:
    from streamctl.verify.report import VerifyReport


@dataclass(frozen=True)
class TransferResult:
    source: str
    dest: str
    commit: str | None
    files: tuple[CopiedFile, ...]
    bytes_copied: int
    seconds: float
    discarded: tuple[str, ...] = ()  # unfinished uploads of earlier runs removed first (see discard_unfinished_uploads)
    removed: tuple[str, ...] = ()  # files of an earlier streamctl run that --force removed (plan.cleanup.to_remove)
    notes: tuple[ListingNote, ...] = ()  # the plan's: SOURCE entries left out or read through a link
    # Bytes of parts an earlier (killed) run had sent that matched the source: read and hashed, not sent.
    bytes_resumed: int = 0
    share: ShareRecord | None = None  # `--worker`: the shares finished once this one went into the manifest

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_copied / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "dest": self.dest,
            "commit": self.commit,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256, "action": f.action} for f in self.files],
            "bytes_copied": self.bytes_copied,
            "bytes_resumed": self.bytes_resumed,
            "seconds": round(self.seconds, 3),
            "throughput_mb_s": round(self.throughput_mb_s, 2),
            "discarded_uploads": list(self.discarded),
            "removed": list(self.removed),
            **notes_to_json(self.notes),
            "worker": self.share.to_json() if self.share else None,
        }


def transfer_manifest(plan: TransferPlan, files: tuple[CopiedFile, ...]) -> TransferManifest:
    """A whole run's manifest: what it copied (or found already right), and the files earlier streamctl runs
    wrote here that this one left (no --force): a later --force removes them."""
    return TransferManifest(plan.source, plan.commit, _entries(files), plan.cleanup.older_files).stamped()


def _entries(files: Sequence[CopiedFile]) -> tuple[FileEntry, ...]:
    return tuple(FileEntry(file.path, file.size, file.sha256) for file in files)


def _finish(
    dest: Location, plan: TransferPlan, files: tuple[CopiedFile, ...], progress: Progress, lease: Lease, force: bool
) -> tuple[tuple[str, ...], ShareRecord | None]:
    """Remove what --force replaces, then write the manifest (a worker: merge its share into it, and only the
    one completing it removes). What was removed, and for a worker the shares finished."""
    if plan.share is None:
        gone = remove_files(dest, plan.cleanup.to_remove, progress)  # only now that the new files are complete
        lease.ensure_held()  # after this renewal nobody can take DEST over before the manifest is written
        put_manifest(dest, transfer_manifest(plan, files))
        return gone, None
    removed: tuple[str, ...] = ()

    def remove_replaced() -> None:  # the files of every share are complete now
        nonlocal removed
        removed = remove_files(dest, plan.cleanup.to_remove, progress)

    cleanup = plan.cleanup
    fields = ShareFields(
        plan.source, plan.commit, _entries(files), cleanup.older_files, cleanup.to_remove, plan.share.planned, force
    )
    lease.ensure_held()
    record = record_share(dest, fields, plan.share.worker, plan.share.digest, remove_replaced, lease.guard_commit)
    if record.restarted:
        progress.log(
            f"{MANIFEST_NAME} recorded the shares of another split or plan (other files, revision or worker count); "
            f"it records this one's from now on: run every --worker K/{record.count} of this split"
        )
    if not record.complete:
        progress.log(f"worker {plan.share.worker}: share recorded; {len(record.finished)} of {record.count} done")
    return removed, record


def execute_transfer(
    plan: TransferPlan,
    source: Location,
    dest: Location,
    options: TransferOptions = TransferOptions(),
    progress: Progress = NULL_PROGRESS,
) -> TransferResult:
    """Copy every planned file, remove what --force replaces, then write the manifest. Ctrl-C aborts open
    uploads before re-raising.

    The whole write phase holds DEST's lease (DestinationBusy, exit 7, while another run writes there)."""
    options.validate()
    check_disjoint(source, dest)  # again: a plan may come from elsewhere, and nothing is written yet
    worker = plan.share.worker if plan.share else None
    command = f"streamctl transfer {plan.source}" + (f" --worker {worker}" if worker else "")
    with hold_lease(dest, command, progress, worker=worker) as lease:
        dest = lease.fenced(dest)
        if not options.force:
            # Planning ran before the lease: another run may have finished writing here since.
            existing = list_dest(dest)
            manifests = read_dest_manifests(dest, {name: info.size for name, info in existing.items()})
            planned = set(plan.share.planned) if plan.share else {file.path for file in plan.files}
            check_manifest(dest, manifests, plan.source, plan.commit, planned)
        return _execute_transfer(plan, source, dest, options, progress, lease)


def _execute_transfer(
    plan: TransferPlan, source: Location, dest: Location, options: TransferOptions, progress: Progress, lease: Lease
) -> TransferResult:
    started = time.monotonic()
    to_copy = [file for file in plan.files if file.action == "copy"]
    # A worker's are its own share's files: the other workers' uploads in flight are theirs.
    ours = {file.path for file in plan.files} | ({MANIFEST_NAME} if plan.share is None else set())
    overall = progress.task("total", plan.copy_bytes)
    parts = ThreadPoolExecutor(options.concurrency, thread_name_prefix="streamctl-part")
    files_pool = ThreadPoolExecutor(options.concurrency, thread_name_prefix="streamctl-file")
    engine = Engine(source, dest, options, progress, overall, ByteBudget(options.max_buffer), parts)
    engine.origin = {"source": plan.source, "commit": plan.commit}
    tokens = {file.path: engine.resume_token(file) for file in to_copy}
    resumable = lambda name, token: tokens.get(name) == token  # noqa: E731
    discarded = discard_unfinished_uploads(dest, ours.__contains__, progress, lease.acquired_at, resumable)
    lease.on_lost(engine.cancelled.set)  # another run holds DEST now: stop writing at once
    copied: dict[str, CopiedFile] = {}
    try:
        with shielded_calls() as engine.shielded:
            # Largest first: the long poles start early and small files fill the gaps.
            ordered = sorted(to_copy, key=lambda file: -file.size)
            futures = {files_pool.submit(engine.copy, file): file for file in ordered}
            for future in futures:
                result = future.result()
                copied[result.path] = result
    except BaseException as error:
        engine.cancelled.set()
        # Requests in flight end now (Ctrl-C, a signal, or a failed file), not at their deadlines; on a stop,
        # uploads being created finish, so that the aborts below see them.
        deadlines.cut_all(spare_clean_up=isinstance(error, KeyboardInterrupt))
        files_pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(error, (RemoteError, DestinationBusy)):
            engine.keep_for_resume()  # the link or the lease was lost, not the will to copy: resume later
        engine.abort_all()  # Ctrl-C, bad input, bad bytes: nothing is left behind
        raise
    finally:
        files_pool.shutdown(wait=True)
        parts.shutdown(wait=True)
        progress.done(overall)
    results = tuple(
        copied.get(file.path) or CopiedFile(file.path, file.size, file.sha256 or "", "skipped") for file in plan.files
    )
    removed, share = _finish(dest, plan, results, progress, lease, options.force)
    return TransferResult(
        plan.source,
        plan.dest,
        plan.commit,
        results,
        engine.bytes_sent,
        time.monotonic() - started,
        discarded,
        removed,
        plan.notes,
        engine.bytes_reused,
        share,
    )


@dataclass(frozen=True)
class TransferRun:
    """What `streamctl transfer` did: the copy, and the check of DEST after it (None: not checked)."""

    result: TransferResult
    verify: VerifyReport | None

    def to_json(self) -> dict[str, object]:
        return {**self.result.to_json(), "verify": self.verify.to_json() if self.verify is not None else None}


def run_transfer(
    source_url: str,
    dest_url: str,
    options: TransferOptions,
    storage: StorageOptions,
    progress: Progress = NULL_PROGRESS,
    *,
    dry_run: bool = False,
    verify: bool = True,
    on_plan: Callable[[TransferPlan], None] = lambda plan: None,
) -> TransferPlan | TransferRun:
    """The whole transfer: open both sides, plan (the plan is the answer with `dry_run`; else `on_plan` sees it
    before anything is written), copy, then verify-index DEST when weights (of any format) were among the files, as
    shard checks what it wrote. A check that fails raises ChecksFailed carrying the run (exit 1)."""
    from streamctl.common.memory import return_large_buffers_to_the_os
    from streamctl.storage import open_destination, open_location
    from streamctl.storage.url import source_identity
    from streamctl.verify.run import verify_checkpoint

    options.validate()
    return_large_buffers_to_the_os()
    source = open_location(source_url, storage)
    dest = open_destination(dest_url, replace(storage, follow_symlinks=False))  # nothing is written through a link
    plan = plan_transfer(source, dest, source_identity(source), options)
    if dry_run:
        return plan
    on_plan(plan)
    result = execute_transfer(plan, source, dest, options, progress)
    report = None
    whole = result.share is None or result.share.complete  # a worker's share alone is not a checkpoint
    planned = plan.share.planned if plan.share else tuple(file.path for file in plan.files)
    if verify and whole and any(weights_file(path) for path in planned):
        try:
            report = verify_checkpoint(dest)  # verify-index's rule, as `serve` applies it: GGUF alone is none
        except NotFoundError as error:
            error.hint = f"{error.hint or ''} (the copy is complete; --no-verify skips this check)".lstrip()
            raise
    run = TransferRun(result, report)
    if report is not None and not report.ok:
        raise ChecksFailed(run, report)
    return run
