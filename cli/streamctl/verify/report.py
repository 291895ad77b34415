"""The stable contract of `verify_checkpoint`: its options, its report, and every finding code it can emit.

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
| `duplicate-tensor` | warning | a tensor name appears twice in one header; every reader loads the last entry, which the other rules check (rule 6) |
| `duplicate-key` | error | `dtype`, `shape` or `data_offsets` twice in one tensor entry, or `__metadata__` twice: the safetensors reader refuses it, the streamer loads it (rule 6) |
| `duplicate-metadata-key` | warning | a key appears twice inside `__metadata__`; every reader keeps the last value (rule 6) |
| `unknown-dtype` | error | dtype not in the safetensors dtype list (rule 7) |
| `bad-shape` | error | shape is not a list of integers 0..2**63-1: torch, numpy and the streamer fail on a larger dimension, even of an empty tensor (rules 5, 8) |
| `bad-offsets` | error | `data_offsets` is not two integers 0..2**64-1 (rules 5, 8) |
| `offsets-reversed` | error | a tensor's end offset is before its begin (rule 8) |
| `offsets-gap` | error | unused bytes before a tensor's data (rule 8) |
| `offsets-overlap` | error | a tensor's data overlaps the previous one (rule 8) |
| `size-overflow` | error | prod(shape) * bits overflows 64 bits (rule 8) |
| `size-not-whole-bytes` | error | a sub-byte dtype's total is not whole bytes (rule 8) |
| `size-mismatch` | error | prod(shape) * bits / 8 differs from end - begin (rule 8) |
| `file-truncated` | error | the object is shorter than header + data; names the first tensor cut short (rule 9) |
| `file-trailing-bytes` | error | the object has bytes after the last tensor (rule 9) |
| `object-vanished` | error | an object in the listing was gone when read |
| `object-changed` | error | an object was shorter when read than the listing said |
| `empty-shard` | warning | a `.safetensors` file holds no tensors; vLLM 0.33 and the streamer 0.17 load it (vLLM's own sharded save writes one) |
| `streamer-unsupported-dtype` | warning (error for `serve`) | a dtype the Run:ai streamer 0.17 cannot read: F8_E4M3FNUZ, F8_E5M2FNUZ, F6_E2M3, F6_E3M2 |
| `streamer-size-mismatch` | warning (error for `serve`) | the streamer 0.17 sizes the tensor differently from the file (F4: one byte per element, not 4 bits) and refuses it |
| `index-missing` | error | the index named with `--index` does not exist |
| `index-too-large` | error | the index is over 100,000,000 bytes |
| `index-invalid` | error | the index is not UTF-8 JSON like `{"metadata": {...}, "weight_map": {tensor: file}}` |
| `index-duplicate-tensor` | warning | a tensor appears twice in `weight_map`; vLLM and transformers use the last entry, which the other rules check |
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
| `lora-adapter` | warning | an adapter (`adapter_config.json`), not a model: vLLM serves it on its base model (`base_model_name_or_path`) with `--enable-lora --lora-modules NAME=LOCATION` |
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
| `transfer-incomplete` | warning | a `transfer --worker K/N` copy is not complete: `streamctl-manifest.json` says `"complete": false` and names the shares still to run (each worker merges its share in; the last one completes it) |

When one code repeats more than 25 times for one file, the rest are summed up in one finding with that
code, no tensor, and a message that says how many more there were. Over all files, one code keeps at most
1,000 findings (an index naming a million missing shards): the rest are counted, in one finding with that
code and no file, and in the report's `omitted` (code -> count), so the report's memory and its JSON stay
bounded however many there are.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from streamctl.checkpoint.safetensors import DEFAULT_SPECULATIVE_BYTES, PROBLEMS_KEPT_PER_CODE, HeaderProblem
from streamctl.errors import UsageError

Severity = Literal["error", "warning"]
Layout = Literal["indexed", "single", "sharded"]

SHARD_INCOMPLETE_CODE = "shard-incomplete"
TRANSFER_INCOMPLETE_CODE = "transfer-incomplete"
FINDINGS_PER_CODE_AND_FILE = PROBLEMS_KEPT_PER_CODE  # the header parser keeps as many and counts the rest
# Findings kept of one code over all files; the rest only counted (1,000 of ~200 bytes each in the JSON).
FINDINGS_PER_CODE = 1000


@dataclass(frozen=True)
class Finding:
    severity: Severity
    code: str
    file: str | None
    tensor: str | None
    message: str
    # A summary finding (no file) standing for this many of its code that were counted, not kept.
    omitted: int = 0


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
    def omitted(self) -> dict[str, int]:
        """code -> findings counted but not listed (beyond FINDINGS_PER_CODE of one code)."""
        return {finding.code: finding.omitted for finding in self.findings if finding.omitted}

    @property
    def error_count(self) -> int:
        """Errors found, those counted but not listed included (a summary finding stands for its `omitted`)."""
        return sum(finding.omitted or 1 for finding in self.errors)

    @property
    def warning_count(self) -> int:
        return sum(finding.omitted or 1 for finding in self.warnings)

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
            "omitted": self.omitted,
            "stats": {
                "files": self.stats.files,
                "tensors": self.stats.tensors,
                "total_bytes": self.stats.total_bytes,
                "bytes_read": self.stats.bytes_read,
                "requests": self.stats.requests,
                "seconds": round(self.stats.seconds, 3),
            },
        }


@dataclass
class Findings:
    """Collects findings in bounded memory: caps each (code, file) at FINDINGS_PER_CODE_AND_FILE and sums up
    the rest per file; caps each code at FINDINGS_PER_CODE over all files and only counts the rest. Every
    finding is kept, summed up in its file's count, or counted in `omitted` (code -> count)."""

    kept: list[Finding] = field(default_factory=list)
    counts: Counter[tuple[str, str | None]] = field(default_factory=Counter)  # only files with a kept finding
    kept_per_code: Counter[str] = field(default_factory=Counter)
    omitted: Counter[str] = field(default_factory=Counter)
    severities: dict[tuple[str, str | None], Severity] = field(default_factory=dict)
    code_severities: dict[str, Severity] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the index and config are read in threads

    def _count(self, severity: Severity, code: str, file: str | None, count: int) -> bool:
        """Count `count` findings; True when one of them may be kept. Call with the lock held."""
        key = (code, file)
        self.code_severities.setdefault(code, severity)
        if key not in self.counts and self.kept_per_code[code] >= FINDINGS_PER_CODE:
            self.omitted[code] += count
            return False
        self.counts[key] += count
        self.severities.setdefault(key, severity)
        return (
            count == 1
            and self.counts[key] <= FINDINGS_PER_CODE_AND_FILE
            and self.kept_per_code[code] < FINDINGS_PER_CODE
        )

    def add(self, severity: Severity, code: str, file: str | None, tensor: str | None, message: str) -> None:
        with self.lock:
            if self._count(severity, code, file, 1):
                self.kept_per_code[code] += 1
                self.kept.append(Finding(severity, code, file, tensor, message))

    def add_unkept(self, severity: Severity, code: str, file: str | None, count: int) -> None:
        """Count `count` more findings that were dropped before they got here (the header parser's)."""
        with self.lock:
            self._count(severity, code, file, count)

    def error(self, code: str, file: str | None, message: str, tensor: str | None = None) -> None:
        self.add("error", code, file, tensor, message)

    def warning(self, code: str, file: str | None, message: str, tensor: str | None = None) -> None:
        self.add("warning", code, file, tensor, message)

    def problem(self, file: str, problem: HeaderProblem) -> None:
        self.add(problem.severity, problem.code, file, problem.tensor, problem.message)

    def result(self) -> tuple[Finding, ...]:
        findings = list(self.kept)
        kept_per_key = Counter((finding.code, finding.file) for finding in self.kept)
        for (code, file), count in self.counts.items():
            more = count - kept_per_key[(code, file)]
            if more > 0:
                findings.append(
                    Finding(self.severities[(code, file)], code, file, None, f"... and {more:,} more {code} findings")
                )
        for code, count in self.omitted.items():
            message = f"... and {count:,} more {code} findings in other files (not listed: over {FINDINGS_PER_CODE:,})"
            findings.append(Finding(self.code_severities[code], code, None, None, message, omitted=count))
        # Stable order: location-wide findings first, then by file, code and tensor.
        findings.sort(key=lambda item: (item.file or "", item.code, item.tensor or "", item.message))
        return tuple(findings)
