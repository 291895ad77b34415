"""The checkpoint index (`model.safetensors.index.json`): its names, and one parse that every verb shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from streamctl.checkpoint.safetensors import decode_json_strictly, printable
from streamctl.errors import UsageError

INDEX_NAME = "model.safetensors.index.json"
MISTRAL_INDEX_NAME = "consolidated.safetensors.index.json"
INDEX_NAMES = (INDEX_NAME, MISTRAL_INDEX_NAME)  # in the order vLLM looks for them
MAX_INDEX_BYTES = 100_000_000


class InvalidIndex(UsageError):
    """The index is not JSON, or not an object with a `weight_map` of tensor name -> file name."""

    code = "index-invalid"

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class IndexDuplicate:
    """A tensor named again in weight_map. vLLM and transformers read the index with json.load (the last
    entry wins) and load every file its values name, so they agree: only `file` counts."""

    tensor: str  # printable
    earlier: str  # the file an earlier entry named (printable; repr of a non-string)
    file: str  # the file the last entry names, the one readers use (printable)


@dataclass(frozen=True)
class CheckpointIndex:
    name: str
    weight_map: Mapping[str, str]  # tensor name -> shard file name
    total_size: int | None  # metadata.total_size when it is an integer
    duplicate_tensors: tuple[IndexDuplicate, ...] = ()  # tensors that appear more than once in weight_map
    total_size_problem: str | None = None  # why metadata.total_size was ignored

    @property
    def files(self) -> list[str]:
        """The shard files the index names, sorted, each once."""
        return sorted(set(self.weight_map.values()))


def parse_index(name: str, data: bytes) -> CheckpointIndex:
    """Parse an index as strictly as the reference readers would; raises InvalidIndex."""
    document = decode_json_strictly(data, what="index")
    if document.error is not None:
        raise InvalidIndex(name, document.error.message)
    value = document.value
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise InvalidIndex(name, 'the index must be an object with "weight_map": {tensor: file name}')
    duplicates = tuple(
        IndexDuplicate(
            printable(duplicate.key),
            printable(duplicate.earlier) if isinstance(duplicate.earlier, str) else repr(duplicate.earlier)[:100],
            printable(weight_map[duplicate.key]),
        )
        for duplicate in document.duplicate_keys
        if duplicate.owner is weight_map
    )
    metadata = value.get("metadata")
    total_size = metadata.get("total_size") if isinstance(metadata, dict) else None
    problem = None
    if total_size is not None and (not isinstance(total_size, int) or isinstance(total_size, bool)):
        problem = f"metadata.total_size is not an integer: {total_size!r}"[:200]
        total_size = None
    return CheckpointIndex(name, weight_map, total_size, duplicates, problem)
