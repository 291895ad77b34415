"""The range of every numeric option, in one place; checked before any planning or I/O.

The upper bounds are far beyond any real use and low enough that nothing downstream (rank loops, buffer
arithmetic, the streamer's environment) can blow up on them:

| option | range | why |
|---|---|---|
| `-tp` / `--tensor-parallel-size` | 1..1,024 | vLLM's largest deployments use TP 8-72 (one NVL72 rack) |
| `-pp` / `--pipeline-parallel-size` | 1..1,024 | a stage holds at least one layer; no released model has 1,024 layers |
| TP x PP | up to 4,096 ranks | more GPUs than any one vLLM instance spans |
| `--concurrency` / `-j` | 1..256 | parallel reads or parts in flight; more only queues at the server |
| `--part-size` | 1 B..5 GiB | S3's largest part (GCS and Azure allow no more); small values are raised to the store's minimum |
| `--max-buffer` | up to 1 TiB | and at least `--part-size` |
| `--max-part-size` (shard) | 1 B..5 TiB | the largest object S3 and GCS store |
| `--memory-limit`, `--cpu-memory-limit` | -1, 0, or 1 B..64 TiB | the largest servers have 32 TiB of RAM |
| `--vllm-version` | up to 6 numbers of up to 9 digits | `0.33.0` |
"""

from __future__ import annotations

from streamctl.common.sizes import GiB, TiB
from streamctl.errors import UsageError

MAX_PARALLEL_SIZE = 1024
MAX_RANKS = 4096
MAX_CONCURRENCY = 256
MAX_PART_SIZE = 5 * GiB
MAX_BUFFER = 1 * TiB
MAX_OBJECT_SIZE = 5 * TiB
MAX_MEMORY_LIMIT = 64 * TiB


def shown_number(value: int) -> str:
    """`value` for a message; Python refuses to print integers of more than 4,300 digits."""
    return f"{value:,}" if value.bit_length() <= 128 else ("-" if value < 0 else "") + "a number over 2**128"


def check_count(option: str, value: int, maximum: int, minimum: int = 1) -> None:
    """UsageError (exit 2) unless minimum <= value <= maximum."""
    if not minimum <= value <= maximum:
        raise UsageError(
            f"{option} must be between {minimum:,} and {maximum:,}, got {shown_number(value)}",
            code="bad-option-value",
        )


def check_parallel_sizes(tensor_parallel_size: int | None, pipeline_parallel_size: int | None) -> None:
    """TP and PP each within MAX_PARALLEL_SIZE, their product within MAX_RANKS."""
    if tensor_parallel_size is not None:
        check_count("--tensor-parallel-size", tensor_parallel_size, MAX_PARALLEL_SIZE)
    if pipeline_parallel_size is not None:
        check_count("--pipeline-parallel-size", pipeline_parallel_size, MAX_PARALLEL_SIZE)
    ranks = (tensor_parallel_size or 1) * (pipeline_parallel_size or 1)
    if ranks > MAX_RANKS:
        raise UsageError(
            f"TP {tensor_parallel_size:,} x PP {pipeline_parallel_size:,} is {ranks:,} ranks; at most {MAX_RANKS:,}",
            code="bad-option-value",
        )
