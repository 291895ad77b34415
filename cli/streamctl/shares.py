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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from streamctl import __version__
from streamctl.errors import DestinationBusy, NotFoundError, PreconditionFailed, UsageError
from streamctl.storage.base import Location
from streamctl.uploads import SHA256_KEY

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


def manifest_incomplete(document: Mapping[str, Any]) -> str | None:
    """Why a transfer manifest does not describe a finished copy (None when it does): only `--worker` runs
    write `"complete": false`; manifests without the key were written at the end of a whole run."""
    if document.get("complete") is not False:
        return None
    workers = document.get("workers")
    count = workers.get("count") if isinstance(workers, dict) else None
    finished = workers.get("finished") if isinstance(workers, dict) else None
    if not isinstance(count, int) or not isinstance(finished, list):
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


def _complete_copy_of(stored: Mapping[str, Any] | None, fields: Mapping[str, Any]) -> bool:
    """Whether `stored` is a complete manifest of this source and commit naming every planned path."""
    if stored is None or stored.get("complete") is False:
        return False
    if stored.get("source") != fields["source"] or stored.get("commit") != fields["commit"]:
        return False
    files = stored.get("files")
    paths = {item.get("path") for item in files if isinstance(item, dict)} if isinstance(files, list) else set()
    return set(fields["plan_order"]) <= paths


def _older_files(stored: Mapping[str, Any] | None, fields: Mapping[str, Any], complete: bool) -> list[str]:
    """Files of earlier runs the manifest keeps naming (a later --force removes them): those of every share's
    plan, and what --force is to remove until the worker completing the manifest has removed it."""
    kept = stored.get("older_files") if stored is not None else None
    older = {path for path in kept if isinstance(path, str)} if isinstance(kept, list) else set()
    older |= set(fields["older_files"])
    to_remove = set(fields["to_remove"])
    older = older - to_remove if complete else older | to_remove
    return sorted(older - set(fields["plan_order"]))


def _merged(
    stored: Mapping[str, Any] | None, fields: Mapping[str, Any], worker: Worker, digest: str
) -> tuple[dict[str, Any], ShareRecord]:
    """The manifest with this share's files in: the stored one's shares kept when it is of this very plan."""
    workers = stored.get("workers") if stored is not None else None
    same = isinstance(workers, dict) and workers.get("plan") == digest and workers.get("count") == worker.count
    finished_before: list[Any] = workers.get("finished", []) if same and isinstance(workers, dict) else []
    files_before: list[Any] = stored.get("files", []) if same and stored is not None else []
    if not isinstance(finished_before, list) or not isinstance(files_before, list):
        finished_before, files_before = [], []  # not what this version writes: start the record again
    whole = not same and not fields.get("force") and _complete_copy_of(stored, fields)
    if whole:
        # A whole run (or an earlier split) already copied this plan: a worker re-running keeps it complete
        # (not with --force: then every share copies its files again, and the record starts again).
        finished_before, files_before = list(range(worker.count)), stored["files"]  # type: ignore[index]
    by_path = {item["path"]: item for item in files_before if isinstance(item, dict) and "path" in item}
    by_path.update({item["path"]: item for item in fields["files"]})
    order = fields["plan_order"]
    files = [by_path[path] for path in order if path in by_path]
    finished = sorted({index for index in finished_before if isinstance(index, int)} | {worker.index})
    record = ShareRecord(tuple(finished), worker.count, restarted=isinstance(workers, dict) and not same and not whole)
    document = {
        "tool": "streamctl",
        "version": __version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": fields["source"],
        "commit": fields["commit"],
        "files": files,
        "older_files": _older_files(stored if same else None, fields, record.complete),
        "complete": record.complete,
        "workers": {"count": worker.count, "plan": digest, "finished": finished},
    }
    if not record.complete:
        # Every file of the plan may be in DEST already (a share killed after some): a later --force sees them
        # as streamctl's (streamctl.ownership.manifest_paths reads "planned", as for `shard`).
        document["planned"] = list(order)
    return document, record


def _read(dest: Location, key: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        data, version = dest.store.read_versioned(key)
    except NotFoundError:
        return None, None
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):  # nested too deep: not one we wrote
        document = None
    return (document if isinstance(document, dict) else None), version


def record_share(
    dest: Location,
    name: str,
    fields: Mapping[str, Any],
    worker: Worker,
    digest: str,
    before_complete: Callable[[], None] = lambda: None,
    before_write: Callable[[], None] = lambda: None,
) -> ShareRecord:
    """Merge this worker's share into the manifest `name` of `dest`, conditionally (see the module's doc).

    `fields`: source, commit, files (this share's, as manifest entries), older_files, to_remove (what --force
    removes once every share is in), plan_order (every planned path, in the plan's order), force (optional). `before_complete` runs before the write that completes the manifest (what
    --force removes), `before_write` before every write (the lease's guard)."""
    key = dest.key(name)
    for _ in range(_RECORD_ATTEMPTS):
        stored, version = _read(dest, key)
        document, record = _merged(stored, fields, worker, digest)
        if record.complete:
            before_complete()
        body = json.dumps(document, indent=2).encode() + b"\n"
        metadata = {SHA256_KEY: hashlib.sha256(body).hexdigest()}
        before_write()
        try:
            if version is None:
                dest.store.create_if_absent(key, body, metadata)
            else:
                dest.store.replace_if_version(key, body, version, metadata)
            return record
        except PreconditionFailed:
            continue  # another worker wrote it meanwhile (or our own write, retried): merge again
    raise DestinationBusy(
        f"{dest.store.url(key)} kept changing while this worker recorded its share",
        hint="run this worker again: its files are in place, and the re-run only records its share",
    )
