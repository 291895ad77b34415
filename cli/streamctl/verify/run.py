"""Verify that a checkpoint folder or bucket prefix is sound and ready for vLLM, reading headers only.

One listing of the location, the index and `config.json` (small), then one or two ranged reads per
`*.safetensors` file for its header; tensor data is never read. Every problem becomes a `Finding` with a
stable code; the library never prints and never exits.

Layouts: `indexed` (an index names the shards), `single` (no index: `model.safetensors`, or several files
vLLM would all load) and `sharded` (vLLM sharded state, `model-rank-{rank}-part-{part}.safetensors`).

Finding codes
-------------

| code | severity | meaning |
|---|---|---|
| `file-too-small` | error | a `.safetensors` object is shorter than the 8-byte header length (rule 1) |
| `header-too-large` | error | header over 100,000,000 bytes: the reference reader and the streamer refuse it (rule 2) |
| `header-over-hf-limit` | warning | header over 25,000,000 bytes, refused by huggingface_hub (rule 2) |
| `header-exceeds-file` | error | 8 + header length is beyond the end of the object (rule 3) |
| `header-not-utf8` | error | header bytes are not UTF-8 (rule 4) |
| `header-invalid-json` | error | header is not valid JSON (rule 4) |
| `header-too-complex` | error | header JSON nested over 64 deep, or a flood of arrays/objects (a JSON bomb) (rule 4) |
| `header-not-object` | error | header JSON is not an object (rule 4) |
| `header-leading-whitespace` | warning | header starts with whitespace, tolerated by the reference reader (rule 4) |
| `bad-metadata` | error | `__metadata__` is not a map of string to string (rule 5; `null` is a warning) |
| `bad-tensor-entry` | error | a tensor entry is not an object or lacks `dtype`, `shape` or `data_offsets` (rule 5) |
| `unknown-tensor-field` | warning | a tensor entry has extra fields, ignored by readers (rule 5) |
| `duplicate-tensor` | error | a tensor name appears twice in one header; readers silently keep the last (rule 6) |
| `duplicate-key` | error | a key appears twice inside a tensor entry or `__metadata__` (rule 6) |
| `unknown-dtype` | error | dtype not in the safetensors dtype list (rule 7) |
| `bad-shape` | error | shape is not a list of integers 0..2**64-1 (rules 5, 8) |
| `bad-offsets` | error | `data_offsets` is not two integers 0..2**64-1 (rules 5, 8) |
| `offsets-reversed` | error | a tensor's end offset is before its begin (rule 8) |
| `offsets-gap` | error | unused bytes before a tensor's data (rule 8) |
| `offsets-overlap` | error | a tensor's data overlaps the previous one (rule 8) |
| `size-overflow` | error | prod(shape) * bits overflows 64 bits (rule 8) |
| `size-not-whole-bytes` | error | a sub-byte dtype's total is not whole bytes (rule 8) |
| `size-mismatch` | error | prod(shape) * bits / 8 differs from end - begin (rule 8) |
| `file-truncated` | error | the object is shorter than header + data (rule 9) |
| `file-trailing-bytes` | error | the object has bytes after the last tensor (rule 9) |
| `object-vanished` | error | an object in the listing was gone when read |
| `object-changed` | error | an object was shorter when read than the listing said |
| `empty-shard` | warning | a `.safetensors` file holds no tensors; vLLM 0.33 and the streamer 0.17 load it (vLLM's own sharded save writes one) |
| `streamer-unsupported-dtype` | warning (error for `serve`) | a dtype the Run:ai streamer 0.17 cannot read: F8_E4M3FNUZ, F8_E5M2FNUZ, F6_E2M3, F6_E3M2 |
| `streamer-size-mismatch` | warning (error for `serve`) | the streamer 0.17 sizes the tensor differently from the file (F4: one byte per element, not 4 bits) and refuses it |
| `index-missing` | error | the index named with `--index` does not exist |
| `index-too-large` | error | the index is over 100,000,000 bytes |
| `index-invalid` | error | the index is not UTF-8 JSON like `{"metadata": {...}, "weight_map": {tensor: file}}` |
| `index-duplicate-tensor` | error | a tensor appears twice in `weight_map` |
| `unsafe-shard-name` | error | the index names a shard with `..`, an absolute path, a backslash or a sub-folder |
| `shard-not-safetensors` | error | the index names a shard that is not a `.safetensors` file |
| `missing-shard` | error | a shard named by the index does not exist |
| `index-tensor-missing` | error | a tensor of the index is in no shard header |
| `index-wrong-shard` | error | the index maps a tensor to one shard but it is in another |
| `tensor-not-in-index` | error | a tensor in an indexed shard's header is not in the index |
| `tensor-in-two-shards` | error | the same tensor name is in two `.safetensors` files |
| `total-size-mismatch` | warning | `metadata.total_size` differs from the sum of tensor sizes (writers differ) |
| `no-index` | warning | several `.safetensors` files and no index |
| `stale-index` | warning | a sharded-state layout also holds an HF index, which describes other files |
| `unindexed-safetensors` | error | a top-level `.safetensors` the index omits: vLLM loads all of them from a bucket |
| `consolidated-mixed` | error | `consolidated*.safetensors` next to HF shards switches vLLM to Mistral-format loading |
| `config-missing` | error | no `config.json` (vLLM requires it) |
| `config-invalid` | error | `config.json` is not a UTF-8 JSON object |
| `tokenizer-missing` | warning | no tokenizer (`tokenizer.json`, `tokenizer.model`, `vocab.json` + `merges.txt`, ...) |
| `remote-code-missing` | warning | `auto_map` in `config.json` names a `.py` file that is not there |
| `entry-skipped` | warning | a FIFO, socket, device, or a symbolic link that dangles, loops or leads out of the folder: not read (local folders) |
| `subfolder-pulled` | warning | a sub-folder (such as `original/` or `.git/`) that vLLM pulls at start-up; files the model's configs reference (`modules.json` folders such as `1_Pooling/`, `auto_map` code) are not counted |
| `expect-violated` | error | a tensor matching an `--expect` GLOB lives outside its FILEs |
| `expect-no-match` | error | an `--expect` GLOB matches no tensor |
| `sharded-pattern-invalid` | error | the sharded pattern breaks vLLM 0.33's rules at the detected TP/PP sizes |
| `sharded-rank-missing` | error | no file for a TP rank / PP stage in 0..TP-1 x 0..PP-1 |
| `sharded-rank-unexpected` | error | files for a rank or stage beyond the given TP/PP sizes |
| `sharded-part-missing` | error | a hole in a rank's part numbers (they count from 0) |
| `sharded-part-duplicate` | error | the same part number twice in one rank (e.g. `part-1` and `part-01`) |
| `sharded-duplicate-tensor` | error | a tensor name twice across the parts of one rank |
| `sharded-rank-mismatch` | error | TP ranks of one stage hold different tensor names |
| `sharded-dtype-mismatch` | warning | TP ranks of one stage store a tensor with different dtypes |
| `sharded-unexpected-file` | error | a file vLLM's rank glob would load that does not fit the pattern |
| `sharded-unused-file` | warning | a `.safetensors` file that no rank of the sharded layout loads |
| `shard-incomplete` | error | `streamctl shard` began here and never completed (killed, out of space, a failed check): `streamctl-shard-manifest.json` says `"complete": false` or is unreadable |

When one code repeats more than 25 times for one file, the rest are summed up in one finding with that
code, no tensor, and a message that says how many more there were.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

from streamctl.errors import NotFoundError, UsageError
from streamctl.checkpoint.files import (
    CONFIG_NAME,
    MAX_CONFIG_BYTES,
    MISTRAL_PARAMS_NAME,
    SHARD_MANIFEST_NAME,
    STANDALONE_TOKENIZER_FILES,
)
from streamctl.ownership import MAX_MANIFEST_BYTES, shard_run_incomplete
from streamctl.limits import MAX_CONCURRENCY, check_count, check_parallel_sizes
from streamctl.checkpoint.files import listing_notes, read_config_references
from streamctl.progress import NULL_PROGRESS, Progress
from streamctl.checkpoint.safetensors import (
    DEFAULT_SPECULATIVE_BYTES,
    PROBLEMS_KEPT_PER_CODE,
    HeaderProblem,
    ParsedHeader,
    decode_json_strictly,
    parse_header,
    printable,
    read_header,
)
from streamctl.checkpoint.sharded_names import (
    ShardedName,
    default_pattern,
    match_sharded,
    detect_sharded_pattern,
    parse_sharded_name,
    pattern_fields,
    rank_glob,
    rank_loading,
    validate_pattern,
)
from streamctl.storage.base import Location, unsafe_path_reason
from streamctl.checkpoint.index import INDEX_NAME, INDEX_NAMES, MAX_INDEX_BYTES, CheckpointIndex, InvalidIndex, parse_index
from streamctl.checkpoint.streamer_compat import streamer_problem
from streamctl.storage import deadlines

Severity = Literal["error", "warning"]
Layout = Literal["indexed", "single", "sharded"]

SHARD_INCOMPLETE_CODE = "shard-incomplete"
FINDINGS_PER_CODE_AND_FILE = PROBLEMS_KEPT_PER_CODE  # the header parser keeps as many and counts the rest
MAX_RANKS_LISTED = 4096  # above TP x PP this, missing ranks are summed up in one finding
# Headers this large are parsed one at a time, so parallel reads don't multiply the parser's memory.
_LARGE_HEADER_BYTES = 8_000_000


@dataclass(frozen=True)
class Finding:
    severity: Severity
    code: str
    file: str | None
    tensor: str | None
    message: str


@dataclass(frozen=True)
class Expectation:
    """`--expect GLOB=FILE[,FILE...]`: every tensor whose name matches GLOB lives in one of FILES."""

    pattern: str
    files: tuple[str, ...]


def parse_expectation(text: str) -> Expectation:
    """Parse 'GLOB=FILE[,FILE...]'; UsageError on bad syntax."""
    pattern, separator, files_text = text.partition("=")
    pattern = pattern.strip()
    files = tuple(name.strip() for name in files_text.split(","))
    if not separator or not pattern or not all(files):
        raise UsageError(
            f"invalid --expect {text!r}",
            hint="write it as GLOB=FILE[,FILE...], e.g. 'model.layers.0.*=model-00001-of-00002.safetensors'",
        )
    return Expectation(pattern, files)


@dataclass(frozen=True)
class VerifyOptions:
    # None: model.safetensors.index.json, else consolidated.safetensors.index.json if that is the one
    # present, else single-file mode.
    index_name: str | None = None
    expectations: tuple[Expectation, ...] = ()
    sharded: bool | None = None  # None: detect from names
    tensor_parallel_size: int | None = None  # None: inferred from the highest rank seen
    pipeline_parallel_size: int | None = None
    pattern: str | None = None
    concurrency: int = 16
    speculative_bytes: int = DEFAULT_SPECULATIVE_BYTES
    # True for `serve`'s pre-flight: what the Run:ai streamer refuses is an error, not a warning.
    for_streamer: bool = False


@dataclass(frozen=True)
class VerifyStats:
    files: int  # .safetensors files whose headers were checked
    tensors: int
    total_bytes: int  # sizes of those files
    bytes_read: int  # header, index and config bytes actually read
    requests: int  # ranged reads (the listing is not counted)
    seconds: float
    largest_tensor_bytes: int = 0  # what a streamer's memory limit must at least hold


@dataclass(frozen=True)
class VerifyReport:
    checkpoint: str
    layout: str  # "indexed" | "single" | "sharded"
    findings: tuple[Finding, ...]
    stats: VerifyStats
    # TP ranks and PP stages whose files a sharded layout holds (highest rank seen + 1); None otherwise.
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(finding for finding in self.findings if finding.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(finding for finding in self.findings if finding.severity == "warning")

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checkpoint": self.checkpoint,
            "layout": self.layout,
            "findings": [
                {
                    "severity": finding.severity,
                    "code": finding.code,
                    "file": finding.file,
                    "tensor": finding.tensor,
                    "message": finding.message,
                }
                for finding in self.findings
            ],
            "stats": {
                "files": self.stats.files,
                "tensors": self.stats.tensors,
                "total_bytes": self.stats.total_bytes,
                "bytes_read": self.stats.bytes_read,
                "requests": self.stats.requests,
                "seconds": round(self.stats.seconds, 3),
            },
        }


# ---------------------------------------------------------------------------------------------------
# Internal state


@dataclass(frozen=True)
class _Listing:
    sizes: Mapping[str, int]  # every object, by name relative to the location
    top_level: Mapping[str, int]  # objects directly in the location
    subfolders: Mapping[str, tuple[int, int]]  # first path segment -> (objects, bytes)


@dataclass(frozen=True)
class _Shard:
    """One `.safetensors` file after its header read."""

    name: str
    size: int
    header: ParsedHeader | None  # None when the read or the length checks failed
    read_problem: HeaderProblem | None
    requests: int
    bytes_read: int

    @property
    def complete(self) -> bool:
        """Whether `header.tensors` is every tensor in the file, so absences mean something."""
        return self.header is not None and self.header.complete

    @property
    def tensor_names(self) -> list[str]:
        return [tensor.name for tensor in self.header.tensors] if self.header else []


@dataclass
class _Findings:
    """Collects findings; caps each (code, file) at FINDINGS_PER_CODE_AND_FILE and sums up the rest."""

    kept: list[Finding] = field(default_factory=list)
    counts: Counter[tuple[str, str | None]] = field(default_factory=Counter)
    severities: dict[tuple[str, str | None], Severity] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the index and config are read in threads

    def add(self, severity: Severity, code: str, file: str | None, tensor: str | None, message: str) -> None:
        key = (code, file)
        with self.lock:
            self.counts[key] += 1
            self.severities.setdefault(key, severity)
            if self.counts[key] <= FINDINGS_PER_CODE_AND_FILE:
                self.kept.append(Finding(severity, code, file, tensor, message))

    def add_unkept(self, severity: Severity, code: str, file: str | None, count: int) -> None:
        """Count `count` more findings that were dropped before they got here (the header parser's)."""
        key = (code, file)
        with self.lock:
            self.counts[key] += count
            self.severities.setdefault(key, severity)

    def error(self, code: str, file: str | None, message: str, tensor: str | None = None) -> None:
        self.add("error", code, file, tensor, message)

    def warning(self, code: str, file: str | None, message: str, tensor: str | None = None) -> None:
        self.add("warning", code, file, tensor, message)

    def problem(self, file: str, problem: HeaderProblem) -> None:
        self.add(problem.severity, problem.code, file, problem.tensor, problem.message)

    def result(self) -> tuple[Finding, ...]:
        findings = list(self.kept)
        for (code, file), count in self.counts.items():
            if count > FINDINGS_PER_CODE_AND_FILE:
                more = count - FINDINGS_PER_CODE_AND_FILE
                findings.append(
                    Finding(self.severities[(code, file)], code, file, None, f"... and {more} more {code} findings")
                )
        # Stable order: location-wide findings first, then by file, code and tensor.
        findings.sort(key=lambda item: (item.file or "", item.code, item.tensor or "", item.message))
        return tuple(findings)


@dataclass
class _Reads:
    requests: int = 0
    bytes_read: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, requests: int, bytes_read: int) -> None:
        with self.lock:
            self.requests += requests
            self.bytes_read += bytes_read


# ---------------------------------------------------------------------------------------------------
# Entry point


def verify_checkpoint(
    location: Location, options: VerifyOptions = VerifyOptions(), progress: Progress = NULL_PROGRESS
) -> VerifyReport:
    """Check the checkpoint at `location` and return every finding.

    Raises NotFoundError when the location holds no objects or no top-level `.safetensors`, UsageError
    for bad options, and lets AccessDeniedError/RemoteError from the store propagate.
    """
    started = time.monotonic()
    _check_options(options)
    listing = _list(location)
    safetensors_names = sorted(name for name in listing.top_level if name.endswith(".safetensors"))
    if not safetensors_names:
        raise _no_safetensors(location, listing)

    findings = _Findings()
    for note in listing_notes(location):
        if not note.listed:
            findings.warning("entry-skipped", note.key, note.reason)
    reads = _Reads()
    sharded_pattern, index_name, layout = _layout(options, listing, safetensors_names)

    # The index and config.json are read while the headers are: one round trip less on the critical path.
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="verify-side") as side:
        index_future = side.submit(_read_index, location, listing, index_name, findings, reads) if index_name else None
        manifest_future = (
            side.submit(_check_shard_manifest, location, listing, findings, reads)
            if SHARD_MANIFEST_NAME in listing.top_level
            else None
        )
        config_future = (
            side.submit(
                _read_small_object, location, listing, CONFIG_NAME, MAX_CONFIG_BYTES, findings, reads, "config-invalid"
            )
            if CONFIG_NAME in listing.top_level
            else None
        )
        try:
            shards = _read_headers(location, listing, safetensors_names, options, progress)
            index = index_future.result() if index_future else None
            config_data = config_future.result() if config_future else None
            if manifest_future:
                manifest_future.result()
        except BaseException:
            deadlines.cut_all()  # the side reads too
            raise
    for shard in shards:
        reads.add(shard.requests, shard.bytes_read)
        _report_shard(shard, findings)
        _check_streamer_readable(shard, "error" if options.for_streamer else "warning", findings)

    if sharded_pattern is not None:
        _check_sharded(sharded_pattern, options, shards, listing, findings)
    else:
        _check_tensor_in_two_shards(shards, findings)
        if index is not None:
            _check_index(index, shards, listing, findings)
        elif index_name is None and len(shards) > 1:
            findings.warning(
                "no-index", None, f"{len(shards)} .safetensors files and no {INDEX_NAME}; vLLM loads them all"
            )
        _check_consolidated_mix(safetensors_names, findings)
    _check_expectations(options.expectations, shards, index, findings)
    # Sub-folders the model's configs name (sentence-transformers modules, custom code) are needed, not stray.
    referenced = read_config_references(location, listing.sizes) if listing.subfolders else {}
    _check_serving_files(listing, safetensors_names, config_data, referenced, findings)

    stats = VerifyStats(
        files=len(shards),
        tensors=sum(len(shard.header.tensors) for shard in shards if shard.header),
        total_bytes=sum(shard.size for shard in shards),
        bytes_read=reads.bytes_read,
        requests=reads.requests,
        seconds=time.monotonic() - started,
        largest_tensor_bytes=max(
            (tensor.end - tensor.begin for shard in shards if shard.header for tensor in shard.header.tensors),
            default=0,
        ),
    )
    tp = pp = None
    if sharded_pattern is not None:
        ranks = match_sharded(sharded_pattern, safetensors_names)
        tp = max((tp_rank for _, tp_rank in ranks), default=-1) + 1 or None
        pp = max((pp_rank for pp_rank, _ in ranks), default=-1) + 1 or None
    return VerifyReport(location.url, layout, findings.result(), stats, tp, pp)


def detect_layout(location: Location, options: VerifyOptions = VerifyOptions()) -> Layout:
    """The layout `verify_checkpoint` would check, from one listing and no reads (`serve --no-preflight`).

    Raises what `verify_checkpoint` raises for an empty location or one without top-level `.safetensors`.
    """
    _check_options(options)
    listing = _list(location)
    safetensors_names = sorted(name for name in listing.top_level if name.endswith(".safetensors"))
    if not safetensors_names:
        raise _no_safetensors(location, listing)
    return _layout(options, listing, safetensors_names)[2]


def _layout(
    options: VerifyOptions, listing: _Listing, safetensors_names: Sequence[str]
) -> tuple[str | None, str | None, Layout]:
    """(sharded pattern, index name, layout): the one decision both the check and `detect_layout` use."""
    sharded_pattern = _sharded_pattern(options, safetensors_names)
    index_name = None if sharded_pattern is not None else _index_name(options, listing)
    layout: Layout = "sharded" if sharded_pattern is not None else ("indexed" if index_name else "single")
    return sharded_pattern, index_name, layout


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


def _list(location: Location) -> _Listing:
    sizes: dict[str, int] = {}
    top_level: dict[str, int] = {}
    subfolders: dict[str, tuple[int, int]] = {}
    for info in location.list():
        name = location.relative(info.key)
        if not name:
            continue  # a marker object for the prefix itself
        sizes[name] = info.size
        folder, separator, _ = name.partition("/")
        if separator:
            objects, total = subfolders.get(folder, (0, 0))
            subfolders[folder] = (objects + 1, total + info.size)
        else:
            top_level[name] = info.size
    if not sizes:
        raise NotFoundError(
            f"nothing found under {location.url}",
            hint="check the URL (prefixes are case-sensitive) and that the checkpoint was uploaded there",
        )
    return _Listing(sizes, top_level, subfolders)


def _no_safetensors(location: Location, listing: _Listing) -> NotFoundError:
    nested = sorted({name.partition("/")[0] for name in listing.sizes if "/" in name and name.endswith(".safetensors")})
    if nested:
        folders = ", ".join(f"{folder}/" for folder in nested)
        hint = f"*.safetensors files are in sub-folder(s) {folders}: verify that folder"
    else:
        hint = "vLLM needs model.safetensors or model-00001-of-0000N.safetensors files at the top of the prefix"
    return NotFoundError(f"no .safetensors files directly under {location.url}", hint=hint)


def _sharded_pattern(options: VerifyOptions, names: Sequence[str]) -> str | None:
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


def _index_name(options: VerifyOptions, listing: _Listing) -> str | None:
    if options.index_name is not None:
        return options.index_name
    for name in INDEX_NAMES:
        if name in listing.top_level:
            return name
    return None


# ---------------------------------------------------------------------------------------------------
# Reading


def _read_small_object(
    location: Location, listing: _Listing, name: str, limit: int, findings: _Findings, reads: _Reads, code: str
) -> bytes | None:
    """Read a whole small object (index, config) in one request; None (with a finding) when impossible."""
    size = listing.sizes[name]
    if size > limit:
        findings.error(code, name, f"{size:,} bytes; refusing to read more than {limit:,}")
        return None
    try:
        data = location.store.read_range(location.key(name), 0, size)
    except NotFoundError:
        reads.add(1, 0)
        findings.error("object-vanished", name, "listed, but gone when read")
        return None
    reads.add(1, len(data))
    if len(data) != size:
        findings.error("object-changed", name, f"listed as {size:,} bytes, but {len(data):,} were read")
        return None
    return data


def _read_index(location: Location, listing: _Listing, name: str, findings: _Findings, reads: _Reads) -> CheckpointIndex | None:
    if name not in listing.sizes:
        findings.error("index-missing", name, "the index file does not exist")
        return None
    data = _read_small_object(location, listing, name, MAX_INDEX_BYTES, findings, reads, "index-too-large")
    if data is None:
        return None
    try:
        index = parse_index(name, data)
    except InvalidIndex as error:
        findings.error("index-invalid", name, error.reason)
        return None
    for tensor in index.duplicate_tensors:
        findings.error("index-duplicate-tensor", name, "tensor appears twice in weight_map", tensor)
    if index.total_size_problem is not None:
        findings.warning("total-size-mismatch", name, index.total_size_problem)
    return index


def _read_one_header(
    location: Location, name: str, size: int, speculative_bytes: int, large_header_lock: threading.Lock
) -> _Shard:
    read = read_header(location.store, location.key(name), size, speculative_bytes)
    if read.header_json is None:
        return _Shard(name, size, None, read.problem, read.requests, read.bytes_read)
    if len(read.header_json) > _LARGE_HEADER_BYTES:
        with large_header_lock:
            header = parse_header(read.header_json, size)
    else:
        header = parse_header(read.header_json, size)
    return _Shard(name, size, header, None, read.requests, read.bytes_read)


def _read_headers(
    location: Location, listing: _Listing, names: Sequence[str], options: VerifyOptions, progress: Progress
) -> list[_Shard]:
    """One header read per file, `options.concurrency` at a time; store errors propagate."""
    task = progress.task("Reading safetensors headers", len(names))
    large_header_lock = threading.Lock()
    executor = ThreadPoolExecutor(max_workers=min(options.concurrency, len(names)), thread_name_prefix="verify")
    try:
        futures: list[Future[_Shard]] = [
            executor.submit(
                _read_one_header, location, name, listing.top_level[name], options.speculative_bytes, large_header_lock
            )
            for name in names
        ]
        for future in futures:
            future.add_done_callback(lambda _: progress.advance(task, 1))
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in done:
            error = future.exception()
            if error is not None:
                raise error
        return [future.result() for future in futures]
    except BaseException:
        deadlines.cut_all()  # reads in flight end now, not at their deadlines (a silent server, Ctrl-C)
        raise
    finally:
        # On an error (or Ctrl-C) drop the reads that have not started instead of waiting for them.
        executor.shutdown(wait=True, cancel_futures=True)
        progress.done(task)


# ---------------------------------------------------------------------------------------------------
# Checks


def _report_shard(shard: _Shard, findings: _Findings) -> None:
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


def _check_streamer_readable(shard: _Shard, severity: Severity, findings: _Findings) -> None:
    """Tensors the Run:ai streamer 0.17 refuses though the safetensors format allows them."""
    if shard.header is None:
        return
    for tensor in shard.header.tensors:
        problem = streamer_problem(tensor)
        if problem is not None:
            findings.add(severity, problem.code, shard.name, printable(tensor.name), problem.message)


def _tensor_locations(shards: Iterable[_Shard]) -> dict[str, list[str]]:
    locations: dict[str, list[str]] = defaultdict(list)
    for shard in shards:
        for name in shard.tensor_names:
            locations[name].append(shard.name)
    return locations


def _check_tensor_in_two_shards(shards: Sequence[_Shard], findings: _Findings) -> None:
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


def _check_index(index: CheckpointIndex, shards: Sequence[_Shard], listing: _Listing, findings: _Findings) -> None:
    shards_by_name = {shard.name: shard for shard in shards}
    mapped_counts = Counter(index.weight_map.values())
    usable: set[str] = set()  # shard names whose headers can be compared with the index
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

    locations = _tensor_locations(shards)
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

    total = 0
    for name in sorted(mapped_counts):
        shard = shards_by_name.get(name)
        if shard is None or shard.header is None:
            continue
        for info in shard.header.tensors:
            total += info.nbytes
            if info.name not in index.weight_map:
                findings.error(
                    "tensor-not-in-index", name, f"in the header but not in {index.name}", printable(info.name)
                )
    for shard in shards:
        if shard.name not in mapped_counts:
            findings.error(
                "unindexed-safetensors",
                shard.name,
                f"not named by {index.name}, but vLLM loads every top-level .safetensors file under a bucket prefix",
            )
    all_read = all(name in usable for name in mapped_counts)
    if index.total_size is not None and all_read and total != index.total_size:
        findings.warning(
            "total-size-mismatch",
            index.name,
            f"metadata.total_size is {index.total_size:,}; the shard headers sum to {total:,}",
        )


def _check_consolidated_mix(safetensors_names: Sequence[str], findings: _Findings) -> None:
    consolidated = [name for name in safetensors_names if name.startswith("consolidated")]
    others = [name for name in safetensors_names if not name.startswith("consolidated")]
    if consolidated and others:
        for name in consolidated:
            findings.error(
                "consolidated-mixed",
                name,
                f"next to {len(others)} other .safetensors files; vLLM then loads Mistral-format consolidated weights "
                "instead of the HF shards: keep one format",
            )


def _check_expectations(
    expectations: Sequence[Expectation], shards: Sequence[_Shard], index: CheckpointIndex | None, findings: _Findings
) -> None:
    if not expectations:
        return
    # Both where the headers put a tensor and where the index says it is must satisfy the expectation.
    in_headers = _tensor_locations(shards)
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


def _check_sharded(
    pattern: str, options: VerifyOptions, shards: Sequence[_Shard], listing: _Listing, findings: _Findings
) -> None:
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
    if tp * pp > MAX_RANKS_LISTED:
        # A stray name like model-rank-999999999-part-0 must not make us walk a billion ranks.
        present = sum(1 for pp_rank, tp_rank in ranks if pp_rank < pp and tp_rank < tp)
        if present < tp * pp:
            findings.error(
                "sharded-rank-missing", None, f"TP {tp:,} x PP {pp:,} needs {tp * pp:,} ranks; {present} have files"
            )
    else:
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                if (pp_rank, tp_rank) not in ranks:
                    findings.error(
                        "sharded-rank-missing",
                        rank_glob(pattern, tp_rank=tp_rank, pp_rank=pp_rank),
                        f"no file for TP rank {tp_rank} of {tp}, PP stage {pp_rank} of {pp}",
                    )
    for (pp_rank, tp_rank), names in sorted(ranks.items()):
        glob = rank_glob(pattern, tp_rank=tp_rank, pp_rank=pp_rank)
        if tp_rank >= tp or pp_rank >= pp:
            findings.error(
                "sharded-rank-unexpected",
                glob,
                f"files for TP rank {tp_rank}, PP stage {pp_rank}, beyond TP {tp} x PP {pp}",
            )
        _check_parts(glob, names, findings)

    shards_by_name = {shard.name: shard for shard in shards}
    _check_rank_tensors(pattern, ranks, shards_by_name, findings)

    for shard in shards:
        if shard.name in parsed:
            continue
        loaded_by = rank_loading(pattern, shard.name)
        if loaded_by is not None and loaded_by[0] < pp and loaded_by[1] < tp:
            findings.error(
                "sharded-unexpected-file",
                shard.name,
                f"vLLM's rank lookup for {pattern} loads it, but it does not fit the pattern",
            )
        else:
            findings.warning(
                "sharded-unused-file", shard.name, f"no rank of {pattern} loads it; remove it to save space"
            )
    for index_name in INDEX_NAMES:
        if index_name in listing.top_level:
            findings.warning(
                "stale-index", index_name, "sharded-state files don't use an index; this one describes other files"
            )


def _check_parts(glob: str, names: Sequence[ShardedName], findings: _Findings) -> None:
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
    shards_by_name: Mapping[str, _Shard],
    findings: _Findings,
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


def _check_serving_files(
    listing: _Listing,
    safetensors_names: Sequence[str],
    config_data: bytes | None,
    referenced: Mapping[str, str],
    findings: _Findings,
) -> None:
    """What vLLM pulls next to the weights: config, tokenizer, custom code, and sub-folders."""
    top = listing.top_level
    if CONFIG_NAME in top:
        if config_data is not None:
            _check_config(config_data, listing, findings)
    elif not (MISTRAL_PARAMS_NAME in top and all(name.startswith("consolidated") for name in safetensors_names)):
        findings.error("config-missing", None, f"no {CONFIG_NAME}; vLLM needs it to build the model")
    if not any(name in top for name in STANDALONE_TOKENIZER_FILES) and not ("vocab.json" in top and "merges.txt" in top):
        findings.warning(
            "tokenizer-missing",
            None,
            "no tokenizer files (tokenizer.json, tokenizer.model, vocab.json + merges.txt, ...); "
            "serve with --tokenizer pointing elsewhere, or upload them",
        )
    unreferenced: dict[str, tuple[int, int]] = {}
    for name, size in listing.sizes.items():
        folder, separator, _ = name.partition("/")
        if separator and name not in referenced:
            objects, total = unreferenced.get(folder, (0, 0))
            unreferenced[folder] = (objects + 1, total + size)
    for folder, (objects, total) in sorted(unreferenced.items()):
        findings.warning(
            "subfolder-pulled",
            f"{folder}/",
            f"{objects} object{'' if objects == 1 else 's'} ({total:,} bytes) that vLLM pulls into its cache "
            "at start-up; move them elsewhere",
        )


def _check_shard_manifest(location: Location, listing: _Listing, findings: _Findings, reads: _Reads) -> None:
    """A `streamctl shard` run that never completed (see streamctl.ownership.shard_run_incomplete)."""
    data = _read_small_object(
        location, listing, SHARD_MANIFEST_NAME, MAX_MANIFEST_BYTES, findings, reads, SHARD_INCOMPLETE_CODE
    )
    if data is None:
        return
    try:
        # Our own document, with a list per tensor: the header parser's flood limits are not meant for it.
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        document = None
    if not isinstance(document, dict):
        findings.error(
            SHARD_INCOMPLETE_CODE,
            SHARD_MANIFEST_NAME,
            "the shard manifest is unreadable, so the run's completion is unknown",
        )
    elif shard_run_incomplete(document):
        findings.error(
            SHARD_INCOMPLETE_CODE,
            SHARD_MANIFEST_NAME,
            "`streamctl shard` started writing here and never completed (killed, out of space, or a failed "
            "check); run it again with --force",
        )


def _check_config(data: bytes, listing: _Listing, findings: _Findings) -> None:
    document = decode_json_strictly(data, what=CONFIG_NAME)
    if document.error is not None or not isinstance(document.value, dict):
        message = document.error.message if document.error else f"{CONFIG_NAME} is not a JSON object"
        findings.error("config-invalid", CONFIG_NAME, message)
        return
    auto_map = document.value.get("auto_map")
    if not isinstance(auto_map, dict):
        return
    references: list[str] = []
    for value in auto_map.values():
        items = value if isinstance(value, list) else [value]
        references.extend(item for item in items if isinstance(item, str))
    needed: dict[str, str] = {}
    for reference in references:
        if "--" in reference or "." not in reference:
            continue  # code in another repository, or not a module.Class reference
        module = reference.rsplit(".", 1)[0]
        needed.setdefault(module.replace(".", "/") + ".py", reference)
    for file, reference in sorted(needed.items()):
        if file not in listing.sizes:
            findings.warning(
                "remote-code-missing",
                printable(file),
                f"auto_map in {CONFIG_NAME} names {printable(reference)!r}; --trust-remote-code needs this file",
            )


__all__ = [
    "Expectation",
    "Finding",
    "Severity",
    "VerifyOptions",
    "VerifyReport",
    "VerifyStats",
    "parse_expectation",
    "verify_checkpoint",
]
