"""Which files in a DEST streamctl wrote, and so which ones `--force` may remove.

`transfer` and `shard` share one rule: `--force` replaces what streamctl wrote there and nothing else. A file
counts as streamctl's when a streamctl manifest at the top of DEST names it (`transfer`'s or `shard`'s,
complete or not; a shard manifest's own pattern names its rank files too), when it is one of those
manifests, or when it matches the running command's own output (its rank pattern). Everything else in DEST
is left alone and listed as such. Removal happens only after the new files are complete, so an interrupted
run never leaves DEST with less than it had.

SOURCE and DEST never overlap (streamctl.dest.overlap.check_disjoint runs first), so no file removed here
can be one the run reads.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from streamctl.dest.manifests import DestManifests, Manifest, ShardManifest
from streamctl.errors import StreamctlError
from streamctl.progress import Progress
from streamctl.storage.base import ListingNote, Location, is_safe_relative_path

NOT_STREAMCTL = "not written by streamctl"
EARLIER_RUN = "written by an earlier streamctl run; --force removes it"


@dataclass(frozen=True)
class LeftAlone:
    path: str
    reason: str
    streamctl: bool  # written by streamctl (named by a manifest, or our own output): a later --force removes it

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


@dataclass(frozen=True)
class Cleanup:
    """What DEST holds besides the files this run writes: removed after the run (with --force), or left."""

    to_remove: tuple[str, ...] = ()
    left_alone: tuple[LeftAlone, ...] = ()

    @property
    def older_files(self) -> tuple[str, ...]:
        """Files of earlier streamctl runs that stay: the new manifest records them for a later --force."""
        return tuple(item.path for item in self.left_alone if item.streamctl)


def manifest_paths(manifest: Manifest) -> set[str]:
    """Every path a manifest names: copied files, rank files, planned files and older files it carries."""
    paths = [file.path for file in manifest.files]
    paths += [*(manifest.planned or ()), *manifest.older_files]
    if isinstance(manifest, ShardManifest):
        paths += [file.path for rank in manifest.ranks for file in rank.files]
    return {path for path in paths if is_safe_relative_path(path)}


def written_by_streamctl(manifests: DestManifests, existing: Iterable[str]) -> set[str]:
    """Which of DEST's files the manifests found there say streamctl wrote, the manifests included."""
    from streamctl.checkpoint.sharded_names import parse_sharded_name

    names = set(existing)
    ours = set(manifests.present & names)
    for manifest in manifests.all():
        ours |= manifest_paths(manifest) & names
    pattern = manifests.shard.pattern if manifests.shard is not None else None
    if pattern is not None:
        try:
            ours |= {name for name in names if parse_sharded_name(pattern, name) is not None}
        except StreamctlError:
            pass  # a pattern this version cannot parse names nothing
    return ours


def unfollowed_links(dest_notes: Iterable[ListingNote]) -> list[str]:
    """Links in a local DEST that its listing did not follow (they point outside it, dangle or loop), from
    `listing_notes(dest)`: a manifest may name one, and removing a link never touches what it points to."""
    return [note.key for note in dest_notes if note.kind.startswith("symlink") and not note.listed]


def plan_cleanup(
    existing: Iterable[str],
    writes: Collection[str],
    written_before: Collection[str],
    own_output: Callable[[str], bool],
    force: bool,
) -> Cleanup:
    """Sort DEST's files that this run does not write into to-remove (--force, and streamctl's) and left alone."""
    to_remove: list[str] = []
    left: list[LeftAlone] = []
    for name in sorted(existing):
        if name in writes:
            continue  # replaced in place by this run
        streamctl = name in written_before or own_output(name)
        if streamctl and force:
            to_remove.append(name)
        else:
            left.append(LeftAlone(name, EARLIER_RUN if streamctl else NOT_STREAMCTL, streamctl))
    return Cleanup(tuple(to_remove), tuple(left))


def remove_files(dest: Location, names: Sequence[str], progress: Progress) -> tuple[str, ...]:
    """Remove `names` (relative to DEST), which the cleanup plan chose; call only once the new files are complete."""
    for name in names:
        progress.log(f"--force: removing {name}, which an earlier streamctl run wrote and this one does not")
        dest.store.delete(dest.key(name))
    return tuple(names)
