"""`transfer --worker K/N`: one copy spread over N runs (the pods of a Kubernetes Indexed Job, or N shells).

The split: every worker plans the whole transfer, then takes share K of the plan's files, balanced by bytes:
files sorted largest first (ties by name), each into the least-loaded share (ties: the lowest index). It
counts every planned file, copied or skipped, so it depends on the source listing alone and every worker
(and every re-run of one) computes the same split, whatever DEST holds by then.

The manifest: `streamctl-manifest.json` says `"complete": false` until every share is in. A worker that
finishes its share merges its files into it with a conditional write (create-if-absent, or replace-if-version
of the copy it read: of two workers racing, one retries on the other's), and the one whose share completes
the set writes it with `"complete": true`. `workers.plan` (a digest of the planned paths and sizes) ties the
shares to one plan: a worker finding a manifest of another split or plan starts the record afresh.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from streamctl.dest.manifests import (
    FileEntry,
    ShardManifest,
    TransferManifest,
    Workers,
    body_metadata,
    is_complete,
    manifest_body,
    parse_manifest,
)
from streamctl.errors import DestinationBusy, NotFoundError, PreconditionFailed, UsageError
from streamctl.storage.base import Location

MAX_WORKERS = 10_000  # a Kubernetes Indexed Job allows up to 100,000 completions; far beyond any model's files
_WORKER = re.compile(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*")
_RECORD_ATTEMPTS = 20


@dataclass(frozen=True)
class Worker:
    """Share `index` of `count` (index from 0, as a Job's JOB_COMPLETION_INDEX)."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def to_json(self) -> dict[str, int]:
        return {"index": self.index, "count": self.count}


def parse_worker(text: str) -> Worker:
    """`K/N` with 0 <= K < N; UsageError (exit 2) naming what is wrong otherwise."""
    match = _WORKER.fullmatch(text)
    hint = "--worker K/N copies share K of N, K from 0 to N-1 (a Job's JOB_COMPLETION_INDEX), e.g. --worker 0/3"
    if match is None:
        raise UsageError(f"--worker {text!r}: expected K/N, two whole numbers such as 0/3", hint=hint)
    index, count = int(match[1]), int(match[2])
    if not 1 <= count <= MAX_WORKERS:
        raise UsageError(f"--worker {text}: the number of workers must be from 1 to {MAX_WORKERS:,}", hint=hint)
    if index >= count:
        raise UsageError(f"--worker {text}: the index must be from 0 to {count - 1} for {count} workers", hint=hint)
    return Worker(index, count)


def split_shares(files: Sequence[tuple[str, int]], count: int) -> tuple[tuple[str, ...], ...]:
    """`count` shares of (path, size) pairs balanced by bytes: largest first into the least-loaded share."""
    loads = [0] * count
    shares: list[list[str]] = [[] for _ in range(count)]
    for path, size in sorted(files, key=lambda file: (-file[1], file[0])):
        target = min(range(count), key=lambda index: (loads[index], index))
        shares[target].append(path)
        loads[target] += size
    return tuple(tuple(sorted(share)) for share in shares)


def plan_digest(source: str, commit: str | None, files: Sequence[tuple[str, int]]) -> str:
    """What ties the workers of one copy together: the source and the planned paths and sizes."""
    text = json.dumps([source, commit, sorted(files)], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def manifest_incomplete(manifest: TransferManifest | ShardManifest) -> str | None:
    """Why a manifest does not describe a finished run (None when it does, see
    streamctl.dest.manifests.is_complete): for a transfer only `--worker` runs write `"complete": false`; a
    shard manifest without a split's record is a whole run's, not finished."""
    if is_complete(manifest):
        return None
    workers = manifest.workers
    count = workers.count if workers is not None else None
    finished = workers.finished if workers is not None else None
    if count is None or finished is None:
        return "a `--worker` copy has not finished every share"
    missing = [index for index in range(count) if index not in finished]
    shown = ", ".join(f"{index}/{count}" for index in missing[:10]) + (", ..." if len(missing) > 10 else "")
    return f"{len(finished)} of {count} `--worker` shares finished; still to run: --worker {shown}"


@dataclass(frozen=True)
class Share:
    """A worker's part of a plan: which worker, the plan's digest, and every planned path (the plan's order)."""

    worker: Worker
    digest: str
    planned: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {**self.worker.to_json(), "plan": self.digest, "planned_files": len(self.planned)}


def take_share(source: str, commit: str | None, files: Sequence[tuple[str, int]], worker: Worker) -> Share:
    """This worker's Share of a plan's (path, size) files; its paths are split_shares(...)[worker.index]."""
    return Share(worker, plan_digest(source, commit, files), tuple(path for path, _ in files))


@dataclass(frozen=True)
class ShareRecord:
    """The manifest after this worker's share went in."""

    finished: tuple[int, ...]
    count: int
    # The manifest recorded the shares of another split or plan (other files, revision or count): dropped.
    restarted: bool = False

    @property
    def complete(self) -> bool:
        return len(self.finished) == self.count

    def to_json(self) -> dict[str, object]:
        return {
            "count": self.count,
            "finished": list(self.finished),
            "complete": self.complete,
            "restarted": self.restarted,
        }


@dataclass(frozen=True)
class ShareFields:
    """What a worker records of its share: the copy's source and commit, this share's files (as the manifest
    lists them), the older streamctl files left in DEST, what --force removes once every share is in, every
    planned path (in the plan's order), and whether --force was given."""

    source: str
    commit: str | None
    files: tuple[FileEntry, ...]
    older_files: tuple[str, ...]
    to_remove: tuple[str, ...]
    plan_order: tuple[str, ...]
    force: bool = False


def _complete_copy_of(stored: TransferManifest | None, fields: ShareFields) -> bool:
    """Whether `stored` is a complete manifest of this source and commit naming every planned path."""
    if stored is None or not is_complete(stored):
        return False
    if stored.source != fields.source or stored.commit != fields.commit:
        return False
    return set(fields.plan_order) <= {file.path for file in stored.files}


def _older_files(stored: TransferManifest | None, fields: ShareFields, complete: bool) -> tuple[str, ...]:
    """Files of earlier runs the manifest keeps naming (a later --force removes them): those of every share's
    plan, and what --force is to remove until the worker completing the manifest has removed it."""
    older = set(stored.older_files) if stored is not None else set()
    older |= set(fields.older_files)
    to_remove = set(fields.to_remove)
    older = older - to_remove if complete else older | to_remove
    return tuple(sorted(older - set(fields.plan_order)))


def _merged(
    stored: TransferManifest | None, fields: ShareFields, worker: Worker, digest: str
) -> tuple[TransferManifest, ShareRecord]:
    """The manifest with this share's files in: the stored one's shares kept when it is of this very plan."""
    workers = stored.workers if stored is not None else None
    same = workers is not None and workers.plan == digest and workers.count == worker.count
    finished_before: Sequence[int] = (workers.finished or ()) if same and workers is not None else ()
    files_before: Sequence[FileEntry] = stored.files if same and stored is not None else ()
    whole = not same and not fields.force and _complete_copy_of(stored, fields)
    if whole and stored is not None:
        # A whole run (or an earlier split) already copied this plan: a worker re-running keeps it complete
        # (not with --force: then every share copies its files again, and the record starts again).
        finished_before, files_before = range(worker.count), stored.files
    by_path = {item.path: item for item in files_before}
    by_path.update({item.path: item for item in fields.files})
    order = fields.plan_order
    files = tuple(by_path[path] for path in order if path in by_path)
    finished = tuple(sorted({*finished_before, worker.index}))
    record = ShareRecord(finished, worker.count, restarted=workers is not None and not same and not whole)
    manifest = TransferManifest(
        source=fields.source,
        commit=fields.commit,
        files=files,
        older_files=_older_files(stored if same else None, fields, record.complete),
        complete=record.complete,
        workers=Workers(worker.count, digest, finished),
        # Every file of the plan may be in DEST already (a share killed after some): a later --force sees
        # them as streamctl's (streamctl.dest.ownership.manifest_paths reads "planned", as for `shard`).
        planned=None if record.complete else order,
    )
    return manifest.stamped(), record


_M = TypeVar("_M", TransferManifest, ShardManifest)


def _read(dest: Location, kind: type[_M]) -> tuple[_M | None, str | None]:
    try:
        data, version = dest.store.read_versioned(dest.key(kind.name))
    except NotFoundError:
        return None, None
    return parse_manifest(kind, data), version  # None: not one this version can read


def replace_conditionally(
    dest: Location,
    kind: type[_M],
    change: Callable[[_M | None], _M | None],
    before_write: Callable[[], None] = lambda: None,
) -> _M | None:
    """Read DEST's manifest of `kind` (None: absent or unreadable), and write `change(it)` in its place only if
    nobody wrote it meanwhile: create-if-absent, or replace-if-version of the copy read; when someone did,
    read and change again. `change` returning None writes nothing. Returns what was written (or None).
    `before_write` runs before every write (the lease's guard). The one way `--worker` runs (transfer's and
    shard's) update the manifest they share."""
    key = dest.key(kind.name)
    for _ in range(_RECORD_ATTEMPTS):
        stored, version = _read(dest, kind)
        manifest = change(stored)
        if manifest is None:
            return None
        body = manifest_body(manifest)
        metadata = body_metadata(body)
        before_write()
        try:
            if version is None:
                dest.store.create_if_absent(key, body, metadata)
            else:
                dest.store.replace_if_version(key, body, version, metadata)
            return manifest
        except PreconditionFailed:
            continue  # another worker wrote it meanwhile (or our own write, retried): merge again
    raise DestinationBusy(
        f"{dest.store.url(key)} kept changing while this worker recorded its share",
        hint="run this worker again: its files are in place, and the re-run only records its share",
    )


def record_share(
    dest: Location,
    fields: ShareFields,
    worker: Worker,
    digest: str,
    before_complete: Callable[[], None] = lambda: None,
    before_write: Callable[[], None] = lambda: None,
) -> ShareRecord:
    """Merge this worker's share into DEST's transfer manifest, conditionally (see the module's doc).

    `before_complete` runs before the write that completes the manifest (what --force removes), `before_write`
    before every write (the lease's guard)."""
    records: list[ShareRecord] = []

    def merge(stored: TransferManifest | None) -> TransferManifest:
        manifest, record = _merged(stored, fields, worker, digest)
        if record.complete:
            before_complete()
        records.append(record)
        return manifest

    replace_conditionally(dest, TransferManifest, merge, before_write)
    return records[-1]
