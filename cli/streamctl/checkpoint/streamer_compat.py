"""What the Run:ai Model Streamer 0.17 (the reader behind `--load-format runai_streamer`) can read.

Measured, not assumed: the streamer maps safetensors dtypes to torch dtypes (safetensors_pytorch.py,
`get_safetensors_dtype_map`) and sizes every tensor as elements x `torch_dtype.itemsize`. With the torch
vLLM 0.33 pins (2.13) that leaves four dtypes of the safetensors list it refuses outright ("Unsupported
dtype"), and F4, which it maps to `float4_e2m1fn_x2` (two values per byte, itemsize 1) while counting
one byte per *element*: a spec-sized F4 tensor (4 bits per element) is "Corrupted Tensor" to it unless it
has no elements. tests/checkpoint/test_streamer_agreement.py runs the real streamer on a file per dtype and holds
this table to it.

Other loaders (safetensors itself, vLLM's default loader) read all of these, so `verify-index` reports
them as warnings; `serve`, which launches the streamer, treats them as errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamctl.checkpoint.safetensors import DTYPE_BITS, TensorInfo, tensor_nbits

# Bytes per element as the streamer counts them; a dtype absent here is one it refuses.
STREAMER_ELEMENT_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "F4": 1,  # float4_e2m1fn_x2: one byte per element in the streamer's arithmetic
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
STREAMER_UNREADABLE_DTYPES = frozenset(DTYPE_BITS) - frozenset(STREAMER_ELEMENT_BYTES)

UNSUPPORTED_DTYPE = "streamer-unsupported-dtype"
SIZE_DISAGREES = "streamer-size-mismatch"
STREAMER_CODES = frozenset({UNSUPPORTED_DTYPE, SIZE_DISAGREES})


@dataclass(frozen=True)
class StreamerProblem:
    code: str
    message: str


def _elements(shape: Sequence[int]) -> int:
    count = 1
    for dimension in shape:
        count *= dimension
    return count


def streamer_problem(tensor: TensorInfo) -> StreamerProblem | None:
    """Why the streamer 0.17 refuses this (otherwise well-formed) tensor, or None when it reads it."""
    element_bytes = STREAMER_ELEMENT_BYTES.get(tensor.dtype)
    if element_bytes is None:
        return StreamerProblem(
            UNSUPPORTED_DTYPE,
            f'dtype {tensor.dtype}: the Run:ai streamer 0.17 cannot read it ("Unsupported dtype"); '
            "vLLM's default loader can",
        )
    expected = _elements(tensor.shape) * element_bytes
    spec_bits = tensor_nbits(tensor.dtype, tensor.shape)
    spec_sized = spec_bits is not None and spec_bits == tensor.nbytes * 8  # else `size-mismatch` says it
    if expected != tensor.nbytes and spec_sized:
        return StreamerProblem(
            SIZE_DISAGREES,
            f"{tensor.dtype} {list(tensor.shape)} takes {tensor.nbytes:,} bytes, but the Run:ai streamer 0.17 "
            f"counts {element_bytes} byte(s) per element ({expected:,}) and refuses the file",
        )
    return None
