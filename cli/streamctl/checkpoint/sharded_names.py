"""vLLM sharded-state file names: patterns, their validation, formatting, and parsing names back.

vLLM's `ShardedStateLoader` writes and reads one set of files per tensor-parallel rank (and, from vLLM
0.33, per pipeline stage), named by formatting a pattern with `rank`/`tp_rank` (TP rank), `pp_rank`
(pipeline stage) and `part`. To find a rank's files it formats the pattern with `part="*"` and globs,
so anything the glob matches is loaded as part of that rank. Shared by `verify-index` and `shard`.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from streamctl.errors import UsageError

DEFAULT_PATTERN = "model-rank-{rank}-part-{part}.safetensors"  # PP = 1
DEFAULT_PP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"  # PP > 1
PATTERN_FIELDS = frozenset({"rank", "tp_rank", "pp_rank", "part"})
TP_RANK_FIELDS = frozenset({"rank", "tp_rank"})
_GLOB_CHARACTERS = set("*?[]")
# Ranks are formatted as plain integers, so only canonical ones ("0", "12") can be a rank vLLM formats.
# Parts are globbed with "*" by vLLM, so any digits count (and "01" next to "1" is a duplicate).
_RANK_DIGITS = r"(?:0|[1-9][0-9]*)"
_PART_DIGITS = r"[0-9]+"


@dataclass(frozen=True)
class ShardedName:
    name: str
    pp_rank: int
    tp_rank: int
    part: int


def default_pattern(pipeline_parallel_size: int = 1) -> str:
    """The pattern vLLM 0.33 uses when none is given."""
    return DEFAULT_PP_PATTERN if pipeline_parallel_size > 1 else DEFAULT_PATTERN


def _segments(pattern: str) -> list[tuple[str, str | None]]:
    """(literal text, field name or None) pairs; UsageError on anything vLLM's format would not accept."""
    try:
        parsed = list(string.Formatter().parse(pattern))
    except ValueError as error:
        raise UsageError(f"invalid pattern {pattern!r}: {error}", hint="escape literal braces as {{ and }}") from None
    segments: list[tuple[str, str | None]] = []
    for literal, field, spec, conversion in parsed:
        if field is not None:
            if field not in PATTERN_FIELDS:
                raise UsageError(
                    f"unknown placeholder {{{field}}} in pattern {pattern!r}",
                    hint="use {rank} or {tp_rank}, {pp_rank} and {part}",
                )
            if spec or conversion:
                # vLLM formats {part} with "*" to glob for a rank's files, so a spec like {part:03d} breaks it.
                raise UsageError(
                    f"placeholder {{{field}}} in pattern {pattern!r} must not have a format spec or conversion"
                )
        segments.append((literal, field))
    return segments


def pattern_fields(pattern: str) -> tuple[str, ...]:
    """The placeholders of `pattern`, in order; UsageError when the pattern cannot name files safely.

    Beyond vLLM's own rules this refuses what would make names unsafe or impossible to parse back: path
    separators, glob characters in the literal text, and two placeholders with nothing between them.
    """
    if not pattern:
        raise UsageError("empty sharded file name pattern")
    segments = _segments(pattern)
    literal_text = "".join(literal for literal, _ in segments)
    if "/" in pattern or "\\" in pattern:
        raise UsageError(f"pattern {pattern!r} must be a plain file name (no '/' or '\\')")
    if _GLOB_CHARACTERS & set(literal_text):
        raise UsageError(f"pattern {pattern!r} holds glob characters (*?[]), which vLLM's rank lookup would expand")
    previous_was_field = False
    for literal, field in segments:
        if field is not None and previous_was_field and not literal:
            raise UsageError(
                f"pattern {pattern!r} has two placeholders with nothing between them, so names can't be parsed back"
            )
        previous_was_field = field is not None
    return tuple(field for _, field in segments if field is not None)


def validate_pattern(pattern: str, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> None:
    """vLLM 0.33's rules for a sharded pattern at the given TP and PP sizes; UsageError when broken."""
    if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
        raise UsageError("tensor and pipeline parallel sizes must be at least 1")
    fields = set(pattern_fields(pattern))
    if "part" not in fields:
        raise UsageError(
            f"pattern {pattern!r} lacks {{part}}", hint=f"for example {default_pattern(pipeline_parallel_size)}"
        )
    if tensor_parallel_size > 1 and not fields & TP_RANK_FIELDS:
        raise UsageError(
            f"pattern {pattern!r} lacks a tensor-parallel rank ({{rank}} or {{tp_rank}}), needed when TP > 1",
            hint=f"for example {default_pattern(pipeline_parallel_size)}",
        )
    if pipeline_parallel_size > 1 and "pp_rank" not in fields:
        raise UsageError(
            f"pattern {pattern!r} lacks {{pp_rank}}, needed when PP > 1", hint=f"for example {DEFAULT_PP_PATTERN}"
        )
    if pipeline_parallel_size == 1 and "pp_rank" in fields:
        raise UsageError(
            f"pattern {pattern!r} uses {{pp_rank}}, which vLLM 0.33 rejects when PP = 1", hint=f"use {DEFAULT_PATTERN}"
        )


def format_name(pattern: str, *, tp_rank: int, part: int, pp_rank: int = 0) -> str:
    """The file name of one part, as vLLM formats it."""
    pattern_fields(pattern)
    return pattern.format(rank=tp_rank, tp_rank=tp_rank, pp_rank=pp_rank, part=part)


def rank_glob(pattern: str, *, tp_rank: int, pp_rank: int = 0) -> str:
    """The glob vLLM uses to find every part of one rank: the pattern with `part="*"`."""
    pattern_fields(pattern)
    return pattern.format(rank=tp_rank, tp_rank=tp_rank, pp_rank=pp_rank, part="*")


@lru_cache(maxsize=32)
def _name_regex(pattern: str) -> re.Pattern[str]:
    parts: list[str] = []
    for index, (literal, field) in enumerate(_segments(pattern)):
        parts.append(re.escape(literal))
        if field is not None:
            digits = _PART_DIGITS if field == "part" else _RANK_DIGITS
            parts.append(f"(?P<{field}_{index}>{digits})")
    return re.compile("".join(parts))


def parse_sharded_name(pattern: str, name: str) -> ShardedName | None:
    """Read (pp_rank, tp_rank, part) back from a file name; None when `name` does not fit the pattern.

    A field the pattern lacks is 0; `{rank}` and `{tp_rank}` in one pattern must agree.
    """
    pattern_fields(pattern)
    match = _name_regex(pattern).fullmatch(name)
    single = _field_values(match) if match is not None else None
    if single is None:
        return None
    return ShardedName(name, single.get("pp_rank", 0), single.get("tp_rank", 0), single.get("part", 0))


def _field_values(match: re.Match[str]) -> dict[str, int] | None:
    """The number each field of a matched name holds (`{rank}` and `{tp_rank}` are one field), or None when
    two places of one field disagree (e.g. {rank}-{tp_rank} with different numbers: vLLM never writes that)."""
    values: dict[str, set[int]] = {}
    for group, text in match.groupdict().items():
        field = group.rsplit("_", 1)[0]
        values.setdefault("tp_rank" if field in TP_RANK_FIELDS else field, set()).add(int(text))
    if any(len(seen) > 1 for seen in values.values()):
        return None
    return {field: next(iter(seen)) for field, seen in values.items()}


def match_sharded(pattern: str, names: Iterable[str]) -> dict[tuple[int, int], list[int]]:
    """{(pp_rank, tp_rank): sorted parts} for every name that fits the pattern (others are ignored).

    A part number that appears twice (e.g. `part-1` and `part-01`) is listed twice.
    """
    result: dict[tuple[int, int], list[int]] = {}
    for name in names:
        parsed = parse_sharded_name(pattern, name)
        if parsed is not None:
            result.setdefault((parsed.pp_rank, parsed.tp_rank), []).append(parsed.part)
    return {key: sorted(parts) for key, parts in sorted(result.items())}


@lru_cache(maxsize=32)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    # The rank glob with its ranks left open: "*" (for {part}) matches anything, as in fnmatch.
    parts: list[str] = []
    for index, (literal, field) in enumerate(_segments(pattern)):
        parts.append(re.escape(literal))
        if field == "part":
            parts.append(".*")
        elif field is not None:
            parts.append(f"(?P<{field}_{index}>{_RANK_DIGITS})")
    return re.compile("".join(parts), re.DOTALL)


def rank_loading(pattern: str, name: str) -> tuple[int, int] | None:
    """(pp_rank, tp_rank) of a rank whose vLLM glob matches `name` (so vLLM would load it), or None.

    Works without enumerating ranks, so a name with an absurd rank number costs nothing.
    """
    pattern_fields(pattern)
    match = _glob_regex(pattern).fullmatch(name)
    single = _field_values(match) if match is not None else None
    if single is None:
        return None
    return single.get("pp_rank", 0), single.get("tp_rank", 0)


def detect_sharded_pattern(names: Iterable[str]) -> str | None:
    """The default pattern the names follow (the PP pattern first), or None when they follow neither."""
    listed = list(names)
    for pattern in (DEFAULT_PP_PATTERN, DEFAULT_PATTERN):
        if any(parse_sharded_name(pattern, name) is not None for name in listed):
            return pattern
    return None
