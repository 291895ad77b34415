"""`shard --worker K/N`: one shard run spread over N runs (the pods of a Kubernetes Indexed Job, or N shells
on any machines), at once or one after another, each re-runnable.

The split: every worker plans the whole run (the plan depends on SOURCE's listing and the options alone),
then writes share K of its parts. The unit is a part of a PP stage (a run of consecutive layers in
state-dict order, cut at --max-part-size) with every TP rank's file of it: the TP ranks of a part are cut
from the same source reads (offline) or built from the same layer's tensors (vllm-cpu), so splitting them
would read SOURCE again. Parts are balanced by bytes with transfer's rule (streamctl.dest.shares.split_shares:
largest first into the least-loaded share, ties by name). Share 0 also copies the serving files.

The checks: each worker checks its own files (offline: bit for bit against SOURCE; vllm-cpu: every tensor
re-read against vLLM's rank model). The worker whose share completes the set runs the checks of the whole
set (verify-index --sharded; vllm-cpu: vLLM's loader on every rank of a local DEST), removes what --force
replaces, and writes the manifest `"complete": true`; the files are those of one run, byte for byte.

The manifest: the first worker writes it `"complete": false` with the split's record (`workers`: count,
the plan's digest, the finished shares), and every worker merges its files into it once they are checked,
by conditional writes (streamctl.dest.shares.replace_conditionally). A worker finding the record of another
split or plan (other options or source files, another count) starts it afresh: shares of different plans
never mix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from streamctl.dest.manifests import FileEntry, Rank, RankFile, ShardManifest, Workers, is_complete
from streamctl.dest.shares import ShareRecord, Worker, replace_conditionally, split_shares
from streamctl.shard.plan import Engine, ShardPlan
from streamctl.shard.result import ShardResult, manifest_ranks, plan_record
from streamctl.storage.base import Location

Part = tuple[int, int]  # (pp_rank, part)


@dataclass(frozen=True)
class ShardShare:
    """This worker, the digest of the plan it shares, and every share's parts (share K: `shares[K]`)."""

    worker: Worker
    digest: str
    shares: tuple[frozenset[Part], ...]

    @property
    def parts(self) -> frozenset[Part]:
        return self.shares[self.worker.index]

    @property
    def copies_serving_files(self) -> bool:
        return self.worker.index == 0


def plan_digest(plan: ShardPlan) -> str:
    """What ties the workers of one split together: everything that decides the files' bytes and names."""
    document = [
        plan.source, plan.engine, plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.pattern,
        plan.vllm_version, plan.layout, dict(plan.engine_settings), plan.dtype, plan.max_part_size,
        [list(entry) for entry in plan.source_files], [list(entry) for entry in plan.serving_files],
        [[file.name, file.size, hashlib.sha256(file.header).hexdigest()] for file in plan.files()],
    ]  # fmt: skip
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def take_share(plan: ShardPlan, worker: Worker) -> tuple[ShardPlan, ShardShare]:
    """The plan with this worker's parts (`ShardPlan.share`), and the split; from the plan alone, so every
    worker (and every re-run of one) computes the same split, whatever DEST holds by now."""
    sizes: dict[Part, int] = {}
    for file in plan.files():
        key = (file.pp_rank, file.part)
        sizes[key] = sizes.get(key, 0) + file.size
    labels = {f"{pp_rank}/{part}": (pp_rank, part) for pp_rank, part in sizes}
    split = split_shares([(label, sizes[key]) for label, key in labels.items()], worker.count)
    shares = tuple(frozenset(labels[label] for label in share) for share in split)
    return replace(plan, share=shares[worker.index]), ShardShare(worker, plan_digest(plan), shares)


def _same_split(manifest: ShardManifest | None, share: ShardShare) -> bool:
    workers = manifest.workers if manifest is not None else None
    return workers is not None and workers.plan == share.digest and workers.count == share.worker.count


def nothing_to_do(plan: ShardPlan) -> bool:
    """DEST holds this plan complete (a whole run's or a split's) with this share's files unchanged."""
    return bool(plan.reused) and all(file.name in plan.reused for file in plan.own_files())


def _merge_ranks(plan: ShardPlan, ranks: Iterable[Rank]) -> tuple[Rank, ...]:
    """The rank files of `ranks` grouped by the plan's (pp_rank, tp_rank), a later entry of one path replacing
    an earlier one, each rank's parts in order; entries the plan does not name are dropped."""
    planned = {file.name: file for file in plan.files()}
    files: dict[tuple[int, int], dict[str, RankFile]] = {}
    for rank in ranks:
        for file in rank.files:
            where = planned.get(file.path)
            if where is not None:
                files.setdefault((where.pp_rank, where.tp_rank), {})[file.path] = file
    return tuple(
        Rank(pp_rank, tp_rank, tuple(sorted(by_path.values(), key=lambda file: planned[file.path].part)))
        for (pp_rank, tp_rank), by_path in sorted(files.items())
    )


def _serving_entries(plan: ShardPlan, entries: Iterable[FileEntry]) -> tuple[FileEntry, ...]:
    """The serving files among `entries` (the last of one path), in the plan's order, as one run lists them."""
    by_path = {entry.path: entry for entry in entries}
    return tuple(by_path[path] for path, _ in plan.serving_files if path in by_path)


def _in_progress(
    plan: ShardPlan,
    engine: Engine,
    share: ShardShare,
    finished: Iterable[int],
    ranks: Iterable[Rank],
    files: Iterable[FileEntry],
) -> ShardManifest:
    """The split's record while shares are still to run: `"complete": false`, every planned file named (a
    later --force knows them all), and the older streamctl files, including what --force will remove."""
    names = {file.name for file in plan.files()}
    older = {*plan.stale, *(item.path for item in plan.left_alone if item.streamctl)}
    record = plan_record(plan, engine, _merge_ranks(plan, ranks), _serving_entries(plan, files))
    return replace(
        record,
        complete=False,
        planned=tuple(sorted(names | {path for path, _ in plan.serving_files})),
        older_files=tuple(sorted(older - names)),
        workers=Workers(share.worker.count, share.digest, tuple(sorted(set(finished)))),
    ).stamped()


def begin_share(
    dest: Location, plan: ShardPlan, engine: Engine, share: ShardShare, before_write: Callable[[], None]
) -> bool:
    """Before this worker writes: DEST's manifest made the split's record, `"complete": false`, unless it
    already is one of this split. The shares whose files DEST holds right for this very plan (a complete
    run's, or another count's split of it) count as finished, their files recorded, so only the shares that
    rewrite anything run again. Whether it replaced the record of another split or plan."""
    replaced: list[bool] = []

    def begin(stored: ShardManifest | None) -> ShardManifest | None:
        replaced[:] = [stored is not None and stored.workers is not None and not _same_split(stored, share)]
        if _same_split(stored, share) and not is_complete(stored):
            return None  # another worker of this split began it: its record stays
        intact = [
            index
            for index, parts in enumerate(share.shares)
            if index != share.worker.index and all(name in plan.reused for name in _names(plan, parts))
        ]
        kept = {name for index in intact for name in _names(plan, share.shares[index])}
        ranks = [
            Rank(rank.pp_rank, rank.tp_rank, tuple(file for file in rank.files if file.path in kept))
            for rank in (stored.ranks if stored is not None else ())
        ]
        files = stored.files if stored is not None and 0 in intact else ()
        return _in_progress(plan, engine, share, intact, ranks, files)

    replace_conditionally(dest, ShardManifest, begin, before_write)
    return any(replaced)


def _names(plan: ShardPlan, parts: frozenset[Part]) -> list[str]:
    """The rank files of `parts` (an empty share has none: nothing for it to do, so it counts as finished)."""
    return [file.name for file in plan.files() if (file.pp_rank, file.part) in parts]


@dataclass
class _Completion:
    """What the worker completing the set does before the complete manifest, once however often the
    conditional write is retried: the whole set's checks (ShardCheckFailed when one fails), what --force
    removes; the result with them."""

    finish: Callable[[], ShardResult]
    result: ShardResult | None = None

    def __call__(self) -> ShardResult:
        if self.result is None:
            self.result = self.finish()
        return self.result


def record_share(
    dest: Location,
    result: ShardResult,
    share: ShardShare,
    complete: Callable[[], ShardResult],
    before_write: Callable[[], None],
    restarted: bool = False,
) -> ShardResult:
    """Merge this worker's checked files into the split's record (see the module's doc); the worker whose
    share completes it first runs `complete` (the whole set's checks and --force's removals, returning the
    result with them) and writes the manifest `"complete": true`. The result, with the shares finished
    (`restarted` also when begin_share replaced the record of another split)."""
    plan, index, count = result.plan, share.worker.index, share.worker.count
    completion = _Completion(complete)
    records: list[ShareRecord] = []
    ours = manifest_ranks(result.files)
    copied = tuple(FileEntry(file.path, file.size, file.sha256) for file in result.copied)

    def merge(stored: ShardManifest | None) -> ShardManifest | None:
        same = _same_split(stored, share)
        if stored is not None and is_complete(stored) and (same or nothing_to_do(plan)):
            records.append(ShareRecord(tuple(range(count)), count, restarted))
            return None  # the set is complete already, with this share's very files
        before = stored if same and stored is not None else None
        workers = before.workers if before is not None else None
        finished = sorted({*(workers.finished or () if workers else ()), index})
        ranks = [*(before.ranks if before else ()), *ours]
        files = [*(before.files if before else ()), *copied]
        other = stored is not None and stored.workers is not None and not same
        records.append(ShareRecord(tuple(finished), count, restarted or other))
        manifest = _in_progress(plan, result.engine, share, finished, ranks, files)
        if len(finished) < count:
            return manifest
        done = completion()
        return replace(manifest, complete=True, planned=None, older_files=_older(done.plan)).stamped()

    replace_conditionally(dest, ShardManifest, merge, before_write)
    done = completion.result or result
    return replace(done, share=records[-1])


def _older(plan: ShardPlan) -> tuple[str, ...]:
    return tuple(item.path for item in plan.left_alone if item.streamctl)
