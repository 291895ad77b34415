"""Whether the names a run will write fit its DEST: one check, by the limits in the scheme table, before
anything is written (`transfer` and `shard` call it with every name they plan, their manifest and lease).

A name counts with the temporary name streamctl writes it through (`DIR/.streamctl-tmp/TOKEN/NAME`, plus
`/PART` on GCS; see storage/base.py), so a name that fits the destination also fits as a temporary name:
on S3 a key may have 1,024 - 32 bytes, on GCS 1,024 - 38; Azure stages blocks and writes none.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from streamctl.common.words import plural
from streamctl.errors import UsageError
from streamctl.storage.base import Location, new_temporary_token, temporary_key
from streamctl.storage.schemes import SCHEMES, NameLimits

SHOWN_HEAD, SHOWN_TAIL = 100, 60  # a long name in a message: its start and its end, enough to find it


@dataclass(frozen=True)
class _TooLong:
    name: str  # as the plan calls it: relative to DEST
    shown: str  # what the message names: the final URL or path, or the path segment that is too long
    length: int  # of what was measured (the temporary name, where it is the one too long), in the limit's unit
    limit: int
    temporary: bool  # only its temporary name is too long
    segment_of: str | None = None  # a local path segment over NAME_MAX: the path it is in


def _length(text: str, limits: NameLimits) -> int:
    if limits.unit == "characters":
        return len(text)
    try:  # a local name's undecodable bytes come back as the bytes they are (as os.fsencode does)
        return len(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # other lone surrogates (a JSON listing's escapes): at their UTF-8 width
        return len(text.encode("utf-8", "surrogatepass"))


def _written(location: Location, name: str, limits: NameLimits) -> list[tuple[str, bool]]:
    """(key, or absolute path for a local folder; is temporary) of everything `name` is written as."""
    key = location.key(name)
    keys = [(key, False)]
    if limits.temporary_tail is not None:
        keys.append((temporary_key(key, new_temporary_token()) + limits.temporary_tail, True))
    if limits.max_component is None:
        return keys
    return [(os.path.abspath(location.store.url(written)), temporary) for written, temporary in keys]


def _problems(location: Location, name: str, limits: NameLimits) -> list[_TooLong]:
    final = location.store.url(location.key(name))
    found = []
    for written, temporary in _written(location, name, limits):
        length = _length(written, limits)
        if length > limits.max_length:
            found.append(_TooLong(name, final, length, limits.max_length, temporary))
        if limits.max_component is not None:
            found.extend(
                _TooLong(name, segment, _length(segment, limits), limits.max_component, temporary, final)
                for segment in written.split("/")
                if _length(segment, limits) > limits.max_component
            )
    return found


def shown(text: str) -> str:
    """`text` whole, or its start and end around '...' when it is too long for a one-line message."""
    return text if len(text) <= SHOWN_HEAD + SHOWN_TAIL + 3 else f"{text[:SHOWN_HEAD]}...{text[-SHOWN_TAIL:]}"


def check_names_fit(dest: Location, names: Iterable[str]) -> None:
    """UsageError (exit 2) naming the longest, when a name DEST would get (its prefix plus a planned `name`,
    or the temporary name it is written through) is longer than the destination holds. Writes nothing."""
    scheme = SCHEMES.get(dest.store.scheme)
    limits = scheme.names if scheme is not None else None
    if scheme is None or limits is None:
        return
    problems = [problem for name in dict.fromkeys(names) for problem in _problems(dest, name, limits)]
    if not problems:
        return
    worst = max(problems, key=lambda problem: (problem.length - problem.limit, problem.length))
    others = len({problem.name for problem in problems}) - 1
    unit = "bytes of UTF-8" if limits.unit == "bytes" and limits.max_component is None else limits.unit
    if worst.segment_of is not None:
        what = f"{shown(worst.shown)!r} in {shown(worst.segment_of)} is {worst.length:,} {unit}"
        holds = f"{worst.limit:,} per name in a path"
    else:
        what = f"{shown(worst.shown)} is {worst.length:,} {unit}"
        holds = f"{worst.limit:,}"
    raise UsageError(
        f"name too long for {scheme.service}: {what}"
        + (" as its temporary name under .streamctl-tmp/" if worst.temporary else "")
        + f"; {scheme.service} holds {holds}"
        + (f" ({plural(others, 'more name')} too long)" if others else ""),
        hint="choose a shorter DEST prefix or folder, or rename the file in SOURCE",
    )
