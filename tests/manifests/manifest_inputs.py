"""The inputs of the byte-for-byte manifest tests: what a run hands to the manifest writers, fixed (clock and
version included), so that the bytes in golden/ (written by the code before streamctl.dest.manifests) can be
compared with what the writers write today."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from streamctl.dest.ownership import EARLIER_RUN, NOT_STREAMCTL, Cleanup, LeftAlone
from streamctl.dest.uploads import CopiedFile
from streamctl.shard.result import WrittenFile

VERSION = "9.8.7-golden"
NOW = datetime(2026, 12, 3, 9, 30, 15, 123456, tzinfo=UTC)


class FixedClock(datetime):
    """datetime with `now()` fixed at NOW (what the writers call for their stamp)."""

    @classmethod
    def now(cls, tz: Any = None) -> FixedClock:
        return cls.fromtimestamp(NOW.timestamp(), tz)


CLEANUP = Cleanup(
    to_remove=("stale.bin",),
    left_alone=(
        LeftAlone("notes.txt", NOT_STREAMCTL, False),
        LeftAlone("earlier-run.safetensors", EARLIER_RUN, True),
        LeftAlone("mod\u00e8le/\u00fcber.json", EARLIER_RUN, True),
    ),
)
COPIED = (
    CopiedFile("config.json", 612, "a" * 64),
    CopiedFile("model.safetensors", 123_456_789, "b" * 64, "skipped"),
    CopiedFile("mod\u00e8le/tokenizer \u2603.json", 7, "c" * 64),
)
TRANSFER_SOURCE = "hf://org/model"
TRANSFER_COMMIT = "0123456789abcdef0123456789abcdef01234567"
WORKER_PLAN = ("config.json", "model.safetensors", "mod\u00e8le/tokenizer \u2603.json", "z-last.bin")
WORKER_SHARES = ((COPIED[0], COPIED[2]), (COPIED[1], CopiedFile("z-last.bin", 1, "d" * 64)))
WORKER_DIGEST = "e" * 32


@dataclass(frozen=True)
class Dims:
    architecture: str


@dataclass(frozen=True)
class PlanFields:
    """The fields of a ShardPlan the manifest writer reads."""

    source: str
    dims: Dims
    tensor_parallel_size: int
    pipeline_parallel_size: int
    pattern: str
    vllm_version: str | None
    layout: str
    dtype: str
    max_part_size: int
    source_files: tuple[tuple[str, int, str | None], ...]
    left_alone: tuple[LeftAlone, ...]
    engine_settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResultFields:
    """The fields of a ShardResult the manifest writer reads."""

    plan: PlanFields
    engine: str
    files: tuple[WrittenFile, ...]
    copied: tuple[CopiedFile, ...]


PATTERN = "model-rank-{rank}-part-{part}.safetensors"
RANK_FILES = (
    WrittenFile("model-rank-1-part-0.safetensors", 0, 1, 0, 300, "1" * 64, (("w.q", "BF16", (4, 2)),)),
    WrittenFile(
        "model-rank-0-part-1.safetensors", 0, 0, 1, 200, "2" * 64, (("w.k", "F32", (2,)), ("scalar", "F32", ()))
    ),
    WrittenFile("model-rank-0-part-0.safetensors", 0, 0, 0, 100, "3" * 64, (("embed", "BF16", (8, 4)),)),
)
SOURCE_FILES = (("model-00001-of-00002.safetensors", 1000, '"etag-1"'), ("model-00002-of-00002.safetensors", 5, None))
SHARD_LEFT_ALONE = CLEANUP.left_alone


def shard_results() -> dict[str, ResultFields]:
    offline = PlanFields(
        "hf://org/llama@main", Dims("LlamaForCausalLM"), 2, 1, PATTERN, None, "llama", "bfloat16", 5 << 30,
        SOURCE_FILES, SHARD_LEFT_ALONE,
    )  # fmt: skip
    settings = {
        "served_dtype": "bfloat16",
        "enable_expert_parallel": False,
        "quantization": None,
        "shims": ["no-cuda"],
        "layerwise": True,
        "torch_version": "2.9.0+cpu",
    }
    cpu = PlanFields(
        "/models/qwen", Dims("Qwen3ForCausalLM"), 2, 2, PATTERN, "0.33.0", "vLLM 0.33.0 model code", "auto", 1 << 20,
        (), (), settings,
    )  # fmt: skip
    return {
        "offline": ResultFields(offline, "offline", RANK_FILES, COPIED[:1]),
        "vllm-cpu": ResultFields(cpu, "vllm-cpu", RANK_FILES[:1], ()),
    }


SHARD_STARTED = {
    "source": "hf://org/llama@main",
    "engine": "offline",
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 1,
    "pattern": PATTERN,
    "planned": ["model-rank-1-part-0.safetensors", "config.json", "model-rank-0-part-0.safetensors"],
    "older_files": ["z.bin", "earlier-run.safetensors"],
}
