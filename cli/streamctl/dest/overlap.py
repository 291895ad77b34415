"""Whether two locations are the same place, or one lies inside the other, by what they really are.

`transfer` and `shard` read SOURCE while they write (and, with `--force`, remove) in DEST, so DEST must share
no file with SOURCE. Comparing URL strings is not enough: a symlink, a bind mount, `file://` against a plain
path, a trailing slash or `..` all name one folder in several ways. So:

- local folders are compared by their resolved paths (`os.path.realpath`) and, for the parts that exist, by
  device and inode (`os.path.samefile`), ancestor by ancestor, so aliases of a parent count too;
- bucket prefixes are compared by scheme, the store's namespace (S3: the endpoint; Azure: the account),
  bucket, and key prefix segment by segment (`a/b` is inside `a`; `a/bc` is not).

The Hub is read-only here (never a DEST), and a local folder never overlaps a bucket.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from streamctl.errors import UsageError
from streamctl.storage.base import Location
from streamctl.storage.schemes import SCHEMES

Relation = Literal["same", "inside", "contains"]  # a is b / a is inside b / a contains b


@dataclass(frozen=True)
class LocalPlace:
    path: str  # absolute and resolved (symlinks followed; the missing tail kept as written)


@dataclass(frozen=True)
class BucketPlace:
    scheme: str
    namespace: str  # the store's endpoint or account: one bucket name means one bucket only within it
    bucket: str
    segments: tuple[str, ...]  # the key prefix, split on "/"


Place = LocalPlace | BucketPlace | None  # None: a read-only source (the Hub), which overlaps nothing


def place_of(location: Location) -> Place:
    """What `location` really names, as far as it can be told without a request."""
    store = location.store
    path = location.local_path()
    if path is not None:
        return LocalPlace(os.path.realpath(path))
    if SCHEMES[store.scheme].object_store:
        return BucketPlace(store.scheme, store.namespace, store.bucket, _segments(location.prefix))
    return None


def _segments(prefix: str) -> tuple[str, ...]:
    return tuple(part for part in prefix.split("/") if part)


def relation(a: Location, b: Location) -> Relation | None:
    """How `a` lies relative to `b`: the same place, inside it, containing it, or None (disjoint)."""
    return place_relation(place_of(a), place_of(b))


def place_relation(a: Place, b: Place) -> Relation | None:
    if isinstance(a, LocalPlace) and isinstance(b, LocalPlace):
        return _local_relation(a.path, b.path)
    if isinstance(a, BucketPlace) and isinstance(b, BucketPlace):
        if (a.scheme, a.namespace, a.bucket) != (b.scheme, b.namespace, b.bucket):
            return None
        return _segments_relation(a.segments, b.segments)
    return None


def _segments_relation(a: tuple[str, ...], b: tuple[str, ...]) -> Relation | None:
    if a == b:
        return "same"
    if a[: len(b)] == b:
        return "inside"
    if b[: len(a)] == a:
        return "contains"
    return None


def _local_relation(a: str, b: str) -> Relation | None:
    by_path = _segments_relation(_path_segments(a), _path_segments(b))
    if by_path is not None:
        return by_path
    # Aliases the resolved paths cannot show (bind mounts, case-insensitive names): compare by inode,
    # each existing ancestor of one against the other.
    if _same_file(a, b):
        return "same"
    if any(_same_file(ancestor, b) for ancestor in _ancestors(a)):
        return "inside"
    if any(_same_file(ancestor, a) for ancestor in _ancestors(b)):
        return "contains"
    return None


def _path_segments(path: str) -> tuple[str, ...]:
    return tuple(part for part in os.path.normpath(path).split(os.sep) if part)


def _ancestors(path: str) -> list[str]:
    found = []
    parent = os.path.dirname(path)
    while parent and parent != path:
        found.append(parent)
        path, parent = parent, os.path.dirname(parent)
    return found


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False  # one of them does not exist (yet): then it is not the other


_DESCRIBED: dict[Relation, str] = {
    "same": "is the same location as",
    "inside": "is inside",
    "contains": "contains",
}


def check_disjoint(source: Location, dest: Location) -> None:
    """UsageError (exit 2) naming both when DEST is SOURCE, lies inside it, or holds it: writing (or, with
    --force, removing) there would change what the run reads. Call it before anything is written."""
    found = relation(dest, source)
    if found is None:
        return
    dest_place, source_place = place_of(dest), place_of(source)
    resolved = ""
    if (
        isinstance(dest_place, LocalPlace)
        and isinstance(source_place, LocalPlace)
        and (dest_place.path, source_place.path) != (dest.url, source.url)
    ):
        resolved = f" (resolved: {dest_place.path} and {source_place.path})"
    raise UsageError(
        f"DEST {dest.url} {_DESCRIBED[found]} SOURCE {source.url}{resolved}",
        hint="write to a folder or prefix that shares nothing with SOURCE",
    )
