"""Checks of an HF layout: the index against the shard headers, a tensor in two files, `--expect`
placements, and Mistral `consolidated*` files mixed with HF shards."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatchcase

from streamctl.checkpoint.files import WeightsChoice
from streamctl.checkpoint.index import MAX_INDEX_BYTES, CheckpointIndex, InvalidIndex, parse_index
from streamctl.checkpoint.safetensors import printable
from streamctl.storage.base import Location, unsafe_path_reason
from streamctl.verify.reading import Listing, Reads, ShardHeader, read_small
from streamctl.verify.report import Expectation, Findings


def read_index(
    location: Location, listing: Listing, name: str, findings: Findings, reads: Reads
) -> CheckpointIndex | None:
    """The index `name`, parsed; None (with a finding) when it is missing, too large or not an index."""
    if name not in listing.sizes:
        findings.error("index-missing", name, "the index file does not exist")
        return None
    data = read_small(location, listing, name, MAX_INDEX_BYTES, findings, reads, "index-too-large")
    if data is None:
        return None
    try:
        index = parse_index(name, data)
    except InvalidIndex as error:
        findings.error("index-invalid", name, error.reason)
        return None
    for duplicate in index.duplicate_tensors:
        where = (
            f"both times to {duplicate.file}"
            if duplicate.earlier == duplicate.file
            else f"to {duplicate.earlier}, then to {duplicate.file}"
        )
        findings.warning(
            "index-duplicate-tensor",
            name,
            f"tensor appears more than once in weight_map ({where}); vLLM and transformers use the last entry",
            duplicate.tensor,
        )
    if index.total_size_problem is not None:
        findings.warning("total-size-mismatch", name, index.total_size_problem)
    return index


def check_index(index: CheckpointIndex, shards: Sequence[ShardHeader], listing: Listing, findings: Findings) -> None:
    """The index against the listing and the shard headers, both ways."""
    shards_by_name = {shard.name: shard for shard in shards}
    mapped_counts = Counter(index.weight_map.values())
    usable = _usable_shards(index, mapped_counts, shards_by_name, listing, findings)
    _check_index_placements(index, usable, shards_by_name, tensor_locations(shards), findings)
    _check_header_tensors(index, mapped_counts, shards_by_name, findings)
    for shard in shards:
        if shard.name not in mapped_counts:
            findings.error(
                "unindexed-safetensors",
                shard.name,
                f"not named by {index.name}, but vLLM loads every top-level .safetensors file under a bucket prefix",
            )
    all_read = all(name in usable for name in mapped_counts)
    total = _indexed_total(mapped_counts, shards_by_name)
    if index.total_size is not None and all_read and total != index.total_size:
        findings.warning(
            "total-size-mismatch",
            index.name,
            f"metadata.total_size is {index.total_size:,}; the shard headers sum to {total:,}",
        )


def _usable_shards(
    index: CheckpointIndex,
    mapped_counts: Mapping[str, int],
    shards_by_name: Mapping[str, ShardHeader],
    listing: Listing,
    findings: Findings,
) -> set[str]:
    """The shard names whose headers can be compared with the index; a finding for each one that can't."""
    usable: set[str] = set()
    for file in sorted(mapped_counts):
        shown = printable(file)
        reason = _unsafe_shard_name(file)
        if reason is not None:
            findings.error("unsafe-shard-name", shown, f"shard name {reason}; {mapped_counts[file]} tensors map to it")
        elif not file.endswith(".safetensors"):
            findings.error(
                "shard-not-safetensors", shown, f"not a .safetensors file; {mapped_counts[file]} tensors map to it"
            )
        elif file not in listing.top_level:
            findings.error(
                "missing-shard", shown, f"named by {index.name} for {mapped_counts[file]} tensors, but absent"
            )
        elif shards_by_name[file].complete:
            usable.add(file)
    return usable


def _check_index_placements(
    index: CheckpointIndex,
    usable: set[str],
    shards_by_name: Mapping[str, ShardHeader],
    locations: Mapping[str, list[str]],
    findings: Findings,
) -> None:
    """Every tensor of the index is in the header of the shard it is mapped to."""
    names_by_shard = {file: set(shards_by_name[file].tensor_names) for file in usable}
    for tensor, file in index.weight_map.items():
        if file not in usable:
            continue  # already reported: missing, unsafe, or a header that could not be read in full
        if tensor in names_by_shard[file]:
            continue
        elsewhere = [name for name in locations.get(tensor, ()) if name != file]
        if elsewhere:
            findings.error(
                "index-wrong-shard",
                file,
                f"{index.name} maps it here, but it is in {', '.join(elsewhere)}",
                printable(tensor),
            )
        else:
            findings.error(
                "index-tensor-missing",
                file,
                f"{index.name} maps it here, but no shard header has it",
                printable(tensor),
            )


def _check_header_tensors(
    index: CheckpointIndex,
    mapped_counts: Mapping[str, int],
    shards_by_name: Mapping[str, ShardHeader],
    findings: Findings,
) -> None:
    """Every tensor in the header of an indexed shard is in the index."""
    for name in sorted(mapped_counts):
        shard = shards_by_name.get(name)
        for info in shard.header.tensors if shard is not None and shard.header is not None else ():
            if info.name not in index.weight_map:
                findings.error(
                    "tensor-not-in-index", name, f"in the header but not in {index.name}", printable(info.name)
                )


def _indexed_total(mapped_counts: Mapping[str, int], shards_by_name: Mapping[str, ShardHeader]) -> int:
    """The bytes of every tensor in the headers of the shards the index names (what `total_size` counts)."""
    total = 0
    for name in mapped_counts:
        shard = shards_by_name.get(name)
        if shard is not None and shard.header is not None:
            total += sum(info.nbytes for info in shard.header.tensors)
    return total


def tensor_locations(shards: Iterable[ShardHeader]) -> dict[str, list[str]]:
    """Tensor name -> the files whose headers hold it."""
    locations: dict[str, list[str]] = defaultdict(list)
    for shard in shards:
        for name in shard.tensor_names:
            locations[name].append(shard.name)
    return locations


def check_tensor_in_two_shards(shards: Sequence[ShardHeader], findings: Findings) -> None:
    """No tensor name in two files: which copy vLLM loads would be undefined."""
    if len(shards) < 2:
        return  # twice in one header is the parser's duplicate-tensor
    first_file: dict[str, str] = {}  # no list per name: a header may hold a million tensors
    for shard in shards:
        for tensor in shard.header.tensors if shard.header else ():
            owner = first_file.setdefault(tensor.name, shard.name)
            if owner is not shard.name:
                findings.error(
                    "tensor-in-two-shards",
                    shard.name,
                    f"also in {owner}; which copy is loaded is undefined",
                    printable(tensor.name),
                )


def _unsafe_shard_name(name: str) -> str | None:
    reason = unsafe_path_reason(name)
    if reason is not None:
        return reason
    if "/" in name:
        return "is in a sub-folder; vLLM loads only top-level .safetensors files"
    return None


def check_consolidated_mix(weights: WeightsChoice, findings: Findings) -> None:
    """Mistral `consolidated*` files next to HF shards (the duplicate) switch vLLM to the Mistral format."""
    for name in weights.duplicate:
        findings.error(
            "consolidated-mixed",
            name,
            f"next to {len(weights.hf)} other .safetensors files; vLLM then loads Mistral-format consolidated weights "
            "instead of the HF shards: keep one format",
        )


def check_expectations(
    expectations: Sequence[Expectation],
    shards: Sequence[ShardHeader],
    index: CheckpointIndex | None,
    findings: Findings,
) -> None:
    """`--expect GLOB=FILE[,FILE...]`: where the headers put each matching tensor, and where the index does."""
    if not expectations:
        return
    # Both where the headers put a tensor and where the index says it is must satisfy the expectation.
    in_headers = tensor_locations(shards)
    mapped: Mapping[str, str] = index.weight_map if index else {}
    names = sorted(set(in_headers) | set(mapped))
    for expectation in expectations:
        matched = [tensor for tensor in names if fnmatchcase(tensor, expectation.pattern)]
        if not matched:
            findings.error("expect-no-match", None, f"--expect {expectation.pattern!r} matches no tensor")
            continue
        allowed = set(expectation.files)
        for tensor in matched:
            found = in_headers.get(tensor, [])
            outside = sorted(set(found) - allowed)
            mapped_to = mapped.get(tensor)
            index_outside = mapped_to is not None and mapped_to not in allowed and mapped_to not in found
            if not outside and not index_outside:
                continue
            where = [f"is in {', '.join(outside)}"] if outside else []
            if index_outside:
                where.append(f"the index maps it to {printable(mapped_to or '')}")
            findings.error(
                "expect-violated",
                outside[0] if outside else printable(mapped_to or ""),
                f"matches {expectation.pattern!r} and must be in {', '.join(expectation.files)}, "
                f"but {' and '.join(where)}",
                printable(tensor),
            )
