"""Which files in a DEST streamctl wrote, and so which ones `--force` may remove.

`transfer` and `shard` share one rule: `--force` replaces what streamctl wrote there and nothing else. A file
counts as streamctl's when a streamctl manifest at the top of DEST names it (`transfer`'s or `shard`'s,
complete or not; a shard manifest's own pattern names its rank files too), when it is one of those
manifests, or when it matches the running command's own output (its rank pattern). Everything else in DEST
is left alone and listed as such. Removal happens only after the new files are complete, so an interrupted
run never leaves DEST with less than it had.

SOURCE and DEST never overlap (streamctl.locations.check_disjoint runs first), so no file removed here
can be one the run reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamctl.checkpoint.files import MANIFEST_NAME, SHARD_MANIFEST_NAME
from streamctl.errors import StreamctlError
from streamctl.progress import Progress
from streamctl.storage.base import ListingNote, Location, is_safe_relative_path

MANIFEST_NAMES = (MANIFEST_NAME, SHARD_MANIFEST_NAME)
MAX_MANIFEST_BYTES = 100_000_000  # shard manifests list every tensor of every rank
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


def read_manifests(dest: Location, sizes: Mapping[str, int]) -> dict[str, dict[str, Any] | None]:
    """The streamctl manifests at the top of DEST, by name (None: present but not a readable JSON object)."""
    found: dict[str, dict[str, Any] | None] = {}
    for name in MANIFEST_NAMES:
        size = sizes.get(name)
        if size is None:
            continue
        document = None
        if size <= MAX_MANIFEST_BYTES:
            raw = dest.store.read_range(dest.key(name), 0, size)
            try:
                value = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):  # nested too deep: not ours
                value = None
            document = value if isinstance(value, dict) else None
        found[name] = document
    return found


def shard_run_incomplete(document: Mapping[str, Any] | None) -> bool:
    """Whether a shard manifest (None: present but unreadable) says its run never completed. `shard` writes it
    with `"complete": false` first and the completed one last; manifests of versions before that flag were
    written only at the end, so one without the key is complete."""
    return document is None or document.get("complete") is False


def manifest_paths(document: Mapping[str, Any]) -> set[str]:
    """Every path a manifest names: copied files, rank files, planned files and older files it carries."""
    paths: set[str] = set()

    def add(value: object) -> None:
        path = value.get("path") if isinstance(value, dict) else value
        if isinstance(path, str) and is_safe_relative_path(path):
            paths.add(path)

    for key in ("files", "planned", "older_files"):
        items = document.get(key)
        for item in items if isinstance(items, list) else ():
            add(item)
    ranks = document.get("ranks")
    for rank in ranks if isinstance(ranks, list) else ():
        files = rank.get("files") if isinstance(rank, dict) else None
        for item in files if isinstance(files, list) else ():
            add(item)
    return paths


def written_by_streamctl(manifests: Mapping[str, Mapping[str, Any] | None], existing: Iterable[str]) -> set[str]:
    """Which of DEST's files the manifests found there say streamctl wrote, the manifests included."""
    from streamctl.checkpoint.sharded_names import parse_sharded_name

    names = set(existing)
    ours = set(manifests) & names
    patterns: list[str] = []
    for name, document in manifests.items():
        if document is None:
            continue
        ours |= manifest_paths(document) & names
        pattern = document.get("pattern")
        if name == SHARD_MANIFEST_NAME and isinstance(pattern, str):
            patterns.append(pattern)
    for pattern in patterns:
        try:
            ours |= {name for name in names if parse_sharded_name(pattern, name) is not None}
        except StreamctlError:
            continue  # a pattern this version cannot parse names nothing
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
