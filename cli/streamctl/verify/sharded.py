"""Checks of vLLM's sharded-state layout (`model-rank-{rank}-part-{part}.safetensors`): the pattern, every
rank and part present once, the same tensors on the TP ranks of a stage, and a `streamctl shard` manifest."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from streamctl.checkpoint.files import SHARD_MANIFEST_NAME
from streamctl.checkpoint.index import INDEX_NAMES
from streamctl.checkpoint.safetensors import printable
from streamctl.checkpoint.sharded_names import (
    ShardedName,
    default_pattern,
    detect_sharded_pattern,
    match_sharded,
    parse_sharded_name,
    rank_glob,
    rank_loading,
    validate_pattern,
)
from streamctl.dest.manifests import MAX_MANIFEST_BYTES, ShardManifest, is_complete, parse_manifest
from streamctl.dest.shares import manifest_incomplete
from streamctl.errors import UsageError
from streamctl.storage.base import Location
from streamctl.verify.reading import Listing, Reads, ShardHeader, read_small
from streamctl.verify.report import SHARD_INCOMPLETE_CODE, Findings, VerifyOptions

MAX_RANKS_LISTED = 4096  # above TP x PP this, missing ranks are summed up in one finding


def sharded_pattern(options: VerifyOptions, names: Sequence[str]) -> str | None:
    """The sharded-state pattern to check against, or None for an HF layout."""
    if options.sharded is False:
        return None
    if options.pattern is not None:
        return options.pattern
    detected = detect_sharded_pattern(names)
    # A TP or PP size says what the user expects (a sharded checkpoint for that many ranks), as --pattern
    # does: check for it, so an HF checkpoint fails with sharded-rank-missing rather than passing unasked.
    expects_sharded = options.tensor_parallel_size is not None or options.pipeline_parallel_size is not None
    if options.sharded or expects_sharded:
        return detected or default_pattern(options.pipeline_parallel_size or 1)
    return detected


def sharded_sizes(pattern: str, names: Sequence[str]) -> tuple[int | None, int | None]:
    """(TP, PP): the ranks and stages whose files `names` hold (highest seen + 1); None when there are none."""
    ranks = match_sharded(pattern, names)
    tp = max((tp_rank for _, tp_rank in ranks), default=-1) + 1 or None
    pp = max((pp_rank for pp_rank, _ in ranks), default=-1) + 1 or None
    return tp, pp


def check_sharded(
    pattern: str, options: VerifyOptions, shards: Sequence[ShardHeader], listing: Listing, findings: Findings
) -> None:
    """The sharded-state rules at the given TP/PP sizes, or those the file names show."""
    parsed: dict[str, ShardedName] = {}
    for shard in shards:
        name = parse_sharded_name(pattern, shard.name)
        if name is not None:
            parsed[shard.name] = name
    seen_tp = max((name.tp_rank for name in parsed.values()), default=0) + 1
    seen_pp = max((name.pp_rank for name in parsed.values()), default=0) + 1
    tp = options.tensor_parallel_size or seen_tp
    pp = options.pipeline_parallel_size or seen_pp
    try:
        validate_pattern(pattern, tp, pp)
    except UsageError as error:
        findings.error("sharded-pattern-invalid", None, f"{error.message} (TP {tp}, PP {pp})")

    ranks: dict[tuple[int, int], list[ShardedName]] = defaultdict(list)
    for name in parsed.values():
        ranks[(name.pp_rank, name.tp_rank)].append(name)
    _check_ranks_present(pattern, ranks, tp, pp, findings)
    for (pp_rank, tp_rank), names in sorted(ranks.items()):
        glob = rank_glob(pattern, tp_rank=tp_rank, pp_rank=pp_rank)
        if tp_rank >= tp or pp_rank >= pp:
            findings.error(
                "sharded-rank-unexpected",
                glob,
                f"files for TP rank {tp_rank}, PP stage {pp_rank}, beyond TP {tp} x PP {pp}",
            )
        _check_parts(glob, names, findings)
    _check_rank_tensors(pattern, ranks, {shard.name: shard for shard in shards}, findings)
    _check_other_files(pattern, [shard.name for shard in shards if shard.name not in parsed], tp, pp, findings)
    for index_name in INDEX_NAMES:
        if index_name in listing.top_level:
            findings.warning(
                "stale-index", index_name, "sharded-state files don't use an index; this one describes other files"
            )


def _check_ranks_present(
    pattern: str, ranks: Mapping[tuple[int, int], Sequence[ShardedName]], tp: int, pp: int, findings: Findings
) -> None:
    """Every TP rank of every PP stage has files."""
    if tp * pp > MAX_RANKS_LISTED:
        # A stray name like model-rank-999999999-part-0 must not make us walk a billion ranks.
        present = sum(1 for pp_rank, tp_rank in ranks if pp_rank < pp and tp_rank < tp)
        if present < tp * pp:
            findings.error(
                "sharded-rank-missing", None, f"TP {tp:,} x PP {pp:,} needs {tp * pp:,} ranks; {present} have files"
            )
        return
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            if (pp_rank, tp_rank) not in ranks:
                findings.error(
                    "sharded-rank-missing",
                    rank_glob(pattern, tp_rank=tp_rank, pp_rank=pp_rank),
                    f"no file for TP rank {tp_rank} of {tp}, PP stage {pp_rank} of {pp}",
                )


def _check_other_files(pattern: str, unparsed: Sequence[str], tp: int, pp: int, findings: Findings) -> None:
    """`.safetensors` files that don't fit the pattern: an error if a rank's glob loads them, else unused."""
    for name in unparsed:
        loaded_by = rank_loading(pattern, name)
        if loaded_by is not None and loaded_by[0] < pp and loaded_by[1] < tp:
            findings.error(
                "sharded-unexpected-file",
                name,
                f"vLLM's rank lookup for {pattern} loads it, but it does not fit the pattern",
            )
        else:
            findings.warning("sharded-unused-file", name, f"no rank of {pattern} loads it; remove it to save space")


def _check_parts(glob: str, names: Sequence[ShardedName], findings: Findings) -> None:
    parts = Counter(name.part for name in names)
    for part, count in sorted(parts.items()):
        if count > 1:
            files = sorted(name.name for name in names if name.part == part)
            findings.error("sharded-part-duplicate", glob, f"part {part} appears {count} times: {', '.join(files)}")
    highest = max(parts)
    missing_count = highest + 1 - len(parts)
    if missing_count:
        # List the first few holes only: a part number can be absurdly large.
        first_missing: list[int] = []
        part = 0
        while len(first_missing) < 10 and part <= highest:
            if part not in parts:
                first_missing.append(part)
            part += 1
        shown = ", ".join(map(str, first_missing)) + (", ..." if missing_count > len(first_missing) else "")
        findings.error(
            "sharded-part-missing", glob, f"parts count from 0 without holes; {missing_count:,} missing: {shown}"
        )


def _check_rank_tensors(
    pattern: str,
    ranks: Mapping[tuple[int, int], Sequence[ShardedName]],
    shards_by_name: Mapping[str, ShardHeader],
    findings: Findings,
) -> None:
    # Per rank: every tensor once across its parts. Per stage: the same names (and dtypes) on every TP rank.
    stage_names: dict[int, dict[int, dict[str, str]]] = defaultdict(dict)  # pp -> tp -> {tensor: dtype}
    for (pp_rank, tp_rank), names in sorted(ranks.items()):
        seen: dict[str, str] = {}  # tensor -> the part it was first seen in
        dtypes: dict[str, str] = {}
        complete = True
        for sharded_name in sorted(names, key=lambda item: (item.part, item.name)):
            shard = shards_by_name[sharded_name.name]
            complete = complete and shard.complete
            for tensor in shard.header.tensors if shard.header else ():
                dtypes.setdefault(tensor.name, tensor.dtype)
                if tensor.name in seen:
                    findings.error(
                        "sharded-duplicate-tensor",
                        shard.name,
                        f"also in {seen[tensor.name]}, another part of the same rank; vLLM fails on it",
                        printable(tensor.name),
                    )
                else:
                    seen[tensor.name] = shard.name
        if complete:  # a rank with an unreadable part would show every missing name as a mismatch
            stage_names[pp_rank][tp_rank] = dtypes
    for pp_rank, per_rank in sorted(stage_names.items()):
        if len(per_rank) < 2:
            continue
        union: set[str] = set().union(*per_rank.values())
        for tp_rank, dtypes_by_name in sorted(per_rank.items()):
            glob = rank_glob(pattern, tp_rank=tp_rank, pp_rank=pp_rank)
            for missing_name in sorted(union - dtypes_by_name.keys()):
                others = sorted(rank for rank, names in per_rank.items() if missing_name in names)
                findings.error(
                    "sharded-rank-mismatch",
                    glob,
                    f"missing on TP rank {tp_rank} of stage {pp_rank}, "
                    f"present on rank(s) {', '.join(map(str, others))}",
                    printable(missing_name),
                )
        for shared_name in sorted(set.intersection(*(set(names) for names in per_rank.values()))):
            stored_as = {names[shared_name] for names in per_rank.values()}
            if len(stored_as) > 1:
                findings.warning(
                    "sharded-dtype-mismatch",
                    rank_glob(pattern, tp_rank=0, pp_rank=pp_rank),
                    f"stored as {', '.join(sorted(stored_as))} on different TP ranks of stage {pp_rank}",
                    printable(shared_name),
                )


def check_shard_manifest(location: Location, listing: Listing, findings: Findings, reads: Reads) -> None:
    """A `streamctl shard` run that never completed (see streamctl.dest.manifests.is_complete)."""
    data = read_small(
        location, listing, SHARD_MANIFEST_NAME, MAX_MANIFEST_BYTES, findings, reads, SHARD_INCOMPLETE_CODE
    )
    if data is None:
        return
    # Our own document, with a list per tensor: the header parser's flood limits are not meant for it.
    manifest = parse_manifest(ShardManifest, data)
    if manifest is None:
        findings.error(
            SHARD_INCOMPLETE_CODE,
            SHARD_MANIFEST_NAME,
            "the shard manifest is unreadable, so the run's completion is unknown",
        )
    elif not is_complete(manifest) and manifest.workers is not None:  # a `shard --worker K/N` split
        findings.error(
            SHARD_INCOMPLETE_CODE,
            SHARD_MANIFEST_NAME,
            f"a `streamctl shard --worker` split is writing here and is not complete: {manifest_incomplete(manifest)}",
        )
    elif not is_complete(manifest):
        findings.error(
            SHARD_INCOMPLETE_CODE,
            SHARD_MANIFEST_NAME,
            "`streamctl shard` started writing here and never completed (killed, out of space, or a failed "
            "check); run it again with --force",
        )
