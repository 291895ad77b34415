"""Verify that a checkpoint folder or bucket prefix is sound and ready for vLLM, reading headers only: the
layout decision and the order of the checks. What it returns, and every finding code, is in verify/report.py;
the library never prints and never exits."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from streamctl.checkpoint.files import (
    CONFIG_NAME,
    MANIFEST_NAME,
    MAX_CONFIG_BYTES,
    SHARD_MANIFEST_NAME,
    listing_notes,
    read_config_references,
)
from streamctl.checkpoint.index import INDEX_NAME, INDEX_NAMES, CheckpointIndex
from streamctl.checkpoint.safetensors import printable
from streamctl.checkpoint.sharded_names import pattern_fields
from streamctl.checkpoint.streamer_compat import streamer_problem
from streamctl.common.limits import MAX_CONCURRENCY, check_count, check_parallel_sizes
from streamctl.errors import UsageError
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.storage import deadlines
from streamctl.storage.base import Location
from streamctl.verify.folder import check_serving_files, check_transfer_manifest, read_repo_kind
from streamctl.verify.indexed import (
    check_consolidated_mix,
    check_expectations,
    check_index,
    check_tensor_in_two_shards,
    read_index,
)
from streamctl.verify.reading import (
    Listing,
    Reads,
    ShardHeader,
    list_location,
    no_safetensors,
    read_headers,
    read_small,
)
from streamctl.verify.report import Findings, Layout, Severity, VerifyOptions, VerifyReport, VerifyStats
from streamctl.verify.sharded import check_shard_manifest, check_sharded, sharded_pattern, sharded_sizes

DEFAULT_OPTIONS = VerifyOptions()  # frozen: one shared default is safe


def verify_checkpoint(
    location: Location, options: VerifyOptions = DEFAULT_OPTIONS, progress: Progress = NULL_PROGRESS
) -> VerifyReport:
    """Check the checkpoint at `location` and return every finding.

    Raises NotFoundError when the location holds no objects or no top-level `.safetensors`, UsageError
    for bad options, and lets AccessDeniedError/RemoteError from the store propagate.
    """
    started = time.monotonic()
    _check_options(options)
    listing = list_location(location)
    safetensors_names = sorted(name for name in listing.top_level if name.endswith(".safetensors"))
    if not safetensors_names:
        raise no_safetensors(location, listing)

    findings = Findings()
    for note in listing_notes(location):
        if not note.listed:
            findings.warning("entry-skipped", note.key, note.reason)
    reads = Reads()
    pattern, index_name, layout = _layout(options, listing, safetensors_names)
    read = _read_checkpoint(location, listing, safetensors_names, index_name, options, findings, reads, progress)
    for shard in read.shards:
        reads.add(shard.requests, shard.bytes_read)
        _report_shard(shard, findings)
        _check_streamer_readable(shard, "error" if options.for_streamer else "warning", findings)

    if pattern is not None:
        check_sharded(pattern, options, read.shards, listing, findings)
    else:
        check_tensor_in_two_shards(read.shards, findings)
        if read.index is not None:
            check_index(read.index, read.shards, listing, findings)
        elif index_name is None and len(read.shards) > 1:
            findings.warning(
                "no-index", None, f"{len(read.shards)} .safetensors files and no {INDEX_NAME}; vLLM loads them all"
            )
        check_consolidated_mix(safetensors_names, findings)
    check_expectations(options.expectations, read.shards, read.index, findings)
    # Sub-folders the model's configs name (sentence-transformers modules, custom code) are needed, not stray.
    referenced = read_config_references(location, listing.sizes) if listing.subfolders else {}
    kind = read_repo_kind(location, listing, read.config, findings, reads)
    check_serving_files(listing, safetensors_names, read.config, referenced, findings, kind, location.url)

    stats = _stats(read.shards, reads, time.monotonic() - started)
    tp, pp = sharded_sizes(pattern, safetensors_names) if pattern is not None else (None, None)
    return VerifyReport(location.url, layout, findings.result(), stats, tp, pp)


def detect_layout(location: Location, options: VerifyOptions = DEFAULT_OPTIONS) -> Layout:
    """The layout `verify_checkpoint` would check, from one listing and no reads (`serve --no-preflight`).

    Raises what `verify_checkpoint` raises for an empty location or one without top-level `.safetensors`.
    """
    return listed_layout(location, options)[0]


def listed_layout(location: Location, options: VerifyOptions = DEFAULT_OPTIONS) -> tuple[Layout, Listing]:
    """`detect_layout`, and the one listing it was read from."""
    _check_options(options)
    listing = list_location(location)
    safetensors_names = sorted(name for name in listing.top_level if name.endswith(".safetensors"))
    if not safetensors_names:
        raise no_safetensors(location, listing)
    return _layout(options, listing, safetensors_names)[2], listing


def _layout(
    options: VerifyOptions, listing: Listing, safetensors_names: Sequence[str]
) -> tuple[str | None, str | None, Layout]:
    """(sharded pattern, index name, layout): the one decision both the check and `detect_layout` use."""
    pattern = sharded_pattern(options, safetensors_names)
    index_name = None if pattern is not None else _index_name(options, listing)
    layout: Layout = "sharded" if pattern is not None else ("indexed" if index_name else "single")
    return pattern, index_name, layout


@dataclass(frozen=True)
class _Read:
    shards: list[ShardHeader]
    index: CheckpointIndex | None
    config: bytes | None  # None when absent or unreadable (a finding says which)


def _read_checkpoint(
    location: Location,
    listing: Listing,
    safetensors_names: Sequence[str],
    index_name: str | None,
    options: VerifyOptions,
    findings: Findings,
    reads: Reads,
    progress: Progress,
) -> _Read:
    """Every header, and the index, `config.json` and shard manifest while the headers are read: one round
    trip less on the critical path."""
    top = listing.top_level
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="verify-side") as side:
        index_future = side.submit(read_index, location, listing, index_name, findings, reads) if index_name else None
        manifest_future = (
            side.submit(check_shard_manifest, location, listing, findings, reads)
            if SHARD_MANIFEST_NAME in top
            else None
        )
        transfer_future = (
            side.submit(check_transfer_manifest, location, listing, findings, reads) if MANIFEST_NAME in top else None
        )
        config_future = (
            side.submit(read_small, location, listing, CONFIG_NAME, MAX_CONFIG_BYTES, findings, reads, "config-invalid")
            if CONFIG_NAME in top
            else None
        )
        try:
            shards = read_headers(location, listing, safetensors_names, options, progress)
            index = index_future.result() if index_future else None
            config = config_future.result() if config_future else None
            if manifest_future:
                manifest_future.result()
            if transfer_future:
                transfer_future.result()
        except BaseException:
            deadlines.cut_all()  # the side reads too
            raise
    return _Read(shards, index, config)


def _stats(shards: Sequence[ShardHeader], reads: Reads, seconds: float) -> VerifyStats:
    return VerifyStats(
        files=len(shards),
        tensors=sum(len(shard.header.tensors) for shard in shards if shard.header),
        total_bytes=sum(shard.size for shard in shards),
        bytes_read=reads.bytes_read,
        requests=reads.requests,
        seconds=seconds,
        largest_tensor_bytes=max(
            (tensor.end - tensor.begin for shard in shards if shard.header for tensor in shard.header.tensors),
            default=0,
        ),
    )


def _check_options(options: VerifyOptions) -> None:
    check_count("--concurrency", options.concurrency, MAX_CONCURRENCY)
    check_parallel_sizes(options.tensor_parallel_size, options.pipeline_parallel_size)
    if options.pattern is not None:
        pattern_fields(options.pattern)  # syntax errors are the caller's, not the checkpoint's
    sharded_only = [
        flag
        for flag, value in (
            ("--tensor-parallel-size", options.tensor_parallel_size),
            ("--pipeline-parallel-size", options.pipeline_parallel_size),
            ("--pattern", options.pattern),
        )
        if value is not None
    ]
    if options.sharded is False and sharded_only:
        raise UsageError(f"{sharded_only[0]} describes a sharded checkpoint, and --not-sharded says it is not one",
                         hint=f"drop {sharded_only[0]} or --not-sharded")  # fmt: skip
    if options.index_name is not None and not options.index_name.strip():
        raise UsageError("empty --index name")


def _index_name(options: VerifyOptions, listing: Listing) -> str | None:
    if options.index_name is not None:
        return options.index_name
    for name in INDEX_NAMES:
        if name in listing.top_level:
            return name
    return None


def _report_shard(shard: ShardHeader, findings: Findings) -> None:
    if shard.read_problem is not None:
        findings.problem(shard.name, shard.read_problem)
        return
    assert shard.header is not None
    for problem in shard.header.problems:
        findings.problem(shard.name, problem)
    for code, count in shard.header.dropped.items():
        severity = next(problem.severity for problem in shard.header.problems if problem.code == code)
        findings.add_unkept(severity, code, shard.name, count)
    if shard.complete and not shard.header.tensors:
        # Measured: the streamer 0.17 loads it at every memory limit, concurrency and in distributed mode.
        findings.warning(
            "empty-shard", shard.name, "no tensors; vLLM and the Run:ai streamer load it, but it holds nothing"
        )


def _check_streamer_readable(shard: ShardHeader, severity: Severity, findings: Findings) -> None:
    """Tensors the Run:ai streamer 0.17 refuses though the safetensors format allows them."""
    if shard.header is None:
        return
    for tensor in shard.header.tensors:
        problem = streamer_problem(tensor)
        if problem is not None:
            findings.add(severity, problem.code, shard.name, printable(tensor.name), problem.message)
