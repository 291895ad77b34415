"""What a safetensors header is: the format's limits and dtypes, and the values its checks return.

Shared by the strict JSON decoder (header_json), the rules on entries (header_rules), the compact scanner
(header_scan) and the reader and writer (safetensors); rules are numbered as in
`docs/specs/safetensors-and-index.md`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Severity = Literal["error", "warning"]

HEADER_LENGTH_BYTES = 8
# Rule 2: the reference reader and the Run:ai streamer refuse larger headers; huggingface_hub refuses
# headers above 25,000,000 bytes, so those only get a warning.
MAX_HEADER_BYTES = 100_000_000
HF_MAX_HEADER_BYTES = 25_000_000
DEFAULT_SPECULATIVE_BYTES = 100_000  # what huggingface_hub reads first ("97% of headers are smaller")
U64_MAX = 2**64 - 1  # the reference reader stores shapes and offsets as usize (64-bit)
# Each dimension must also fit a signed 64-bit integer: the reference reader's numpy and torch back ends,
# vLLM and the Run:ai streamer build the tensor with it and fail past 2**63-1 ("Overflow when unpacking
# long long", numpy's "Maximum allowed dimension exceeded"), even when the tensor holds no element.
MAX_DIM = 2**63 - 1

# Rule 7: bits per element.
DTYPE_BITS: Mapping[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F4": 4,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}
# The order `safetensors.save_file` lays tensors out in a file: descending alignment, then name. Its Dtype
# enum is declared in increasing alignment order; a dtype's rank is its position there.
_ALIGNMENT_ORDER_TEXT = (
    "BOOL F4 F6_E2M3 F6_E3M2 U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ I16 U16 F16 BF16 I32 U32 F32 "
    "C64 F64 I64 U64"
)
DTYPE_ALIGNMENT_ORDER: tuple[str, ...] = tuple(_ALIGNMENT_ORDER_TEXT.split())
DTYPE_ALIGNMENT_RANK: Mapping[str, int] = {name: rank for rank, name in enumerate(DTYPE_ALIGNMENT_ORDER)}

METADATA_KEY = "__metadata__"
TENSOR_FIELDS = ("dtype", "shape", "data_offsets")


@dataclass(frozen=True, slots=True)  # slots: a header may hold a million of them
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data buffer, which starts at 8 + N
    end: int  # exclusive

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class HeaderProblem:
    code: str
    tensor: str | None
    message: str
    severity: Severity = "error"

    def describe(self) -> str:
        """The message with the tensor it is about, for a one-line error outside a findings table."""
        return self.message if self.tensor is None else f"tensor {self.tensor}: {self.message}"


@dataclass(frozen=True)
class ParsedHeader:
    """What a header says, and every rule it breaks. `tensors` holds only well-formed entries."""

    header_length: int  # N
    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str] | None
    problems: tuple[HeaderProblem, ...]
    # True when the JSON parsed and every tensor entry was well-formed, so `tensors` lists all of them.
    complete: bool = False
    # Problems not kept in `problems` (PROBLEMS_KEPT_PER_CODE per code), counted by code.
    dropped: Mapping[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(problem.severity == "error" for problem in self.problems)

    @property
    def data_bytes(self) -> int:
        return max((tensor.end for tensor in self.tensors), default=0)


def header_error(code: str, message: str, tensor: str | None = None) -> HeaderProblem:
    return HeaderProblem(code, tensor, message, "error")


def header_warning(code: str, message: str, tensor: str | None = None) -> HeaderProblem:
    return HeaderProblem(code, tensor, message, "warning")


def printable(text: str) -> str:
    """`text` with lone surrogates escaped, so it can be printed and encoded as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
