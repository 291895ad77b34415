"""Build small, realistic test checkpoints into any Location (a local folder or a bucket prefix).

Tensors are tiny (a few hundred bytes) but carry real Llama names, so the same builders serve the local
and the object-store tests. Corruption helpers rewrite one object through the same Location.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamctl.checkpoint.safetensors import safetensors_bytes, tensor_nbits
from streamctl.checkpoint.sharded_names import default_pattern, format_name
from streamctl.storage.base import Location, ObjectInfo, Store

INDEX_NAME = "model.safetensors.index.json"

LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 32,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TOKENIZER_FILES: dict[str, Any] = {
    "tokenizer.json": {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}},
    "tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 512},
    "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>"},
}
GENERATION_CONFIG: dict[str, Any] = {"bos_token_id": 1, "eos_token_id": 2}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        bits = tensor_nbits(self.dtype, self.shape)
        assert bits is not None and bits % 8 == 0
        return bits // 8

    def data(self) -> bytes:
        """Deterministic bytes derived from the name, so a wrong offset shows up as wrong data."""
        seed = hashlib.sha256(self.name.encode()).digest()
        return (seed * (self.nbytes // len(seed) + 1))[: self.nbytes]


@dataclass(frozen=True)
class Checkpoint:
    """What a builder wrote: shard file names and which tensors went where."""

    location: Location
    files: tuple[str, ...]  # .safetensors files, in order
    tensors_by_file: Mapping[str, tuple[TensorSpec, ...]]

    @property
    def weight_map(self) -> dict[str, str]:
        return {spec.name: file for file, specs in self.tensors_by_file.items() for spec in specs}

    @property
    def tensor_count(self) -> int:
        return sum(len(specs) for specs in self.tensors_by_file.values())


# ---------------------------------------------------------------------------------------------------
# Tensor lists


def llama_tensors(
    layers: int = 2, *, hidden: int = 8, intermediate: int = 16, vocab: int = 32, dtype: str = "BF16"
) -> list[TensorSpec]:
    """HF names and shapes of a tiny Llama (one KV head, head_dim = hidden / 2)."""
    head_dim = hidden // 2
    specs = [TensorSpec("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        specs += [
            TensorSpec(f"{prefix}.input_layernorm.weight", dtype, (hidden,)),
            TensorSpec(f"{prefix}.self_attn.q_proj.weight", dtype, (hidden, hidden)),
            TensorSpec(f"{prefix}.self_attn.k_proj.weight", dtype, (head_dim, hidden)),
            TensorSpec(f"{prefix}.self_attn.v_proj.weight", dtype, (head_dim, hidden)),
            TensorSpec(f"{prefix}.self_attn.o_proj.weight", dtype, (hidden, hidden)),
            TensorSpec(f"{prefix}.post_attention_layernorm.weight", dtype, (hidden,)),
            TensorSpec(f"{prefix}.mlp.gate_proj.weight", dtype, (intermediate, hidden)),
            TensorSpec(f"{prefix}.mlp.up_proj.weight", dtype, (intermediate, hidden)),
            TensorSpec(f"{prefix}.mlp.down_proj.weight", dtype, (hidden, intermediate)),
        ]
    specs += [TensorSpec("model.norm.weight", dtype, (hidden,)), TensorSpec("lm_head.weight", dtype, (vocab, hidden))]
    return specs


def stage_layers(layers: int, pp: int) -> list[range]:
    """vLLM's `get_pp_indices`: even split, the remainder one each to the stages just before the last."""
    remainder = layers % pp
    counts = [layers // pp + (1 if pp - 1 - remainder <= stage < pp - 1 else 0) for stage in range(pp)]
    starts = [sum(counts[:stage]) for stage in range(pp)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def vllm_rank_tensors(
    layers: int,
    *,
    tp_rank: int,
    tp: int,
    pp_rank: int = 0,
    pp: int = 1,
    hidden: int = 8,
    intermediate: int = 16,
    vocab: int = 64,
) -> list[TensorSpec]:
    """vLLM's own names and per-rank shapes for one TP rank of one pipeline stage (Llama, 2 heads, 1 KV head)."""
    del tp_rank  # every rank of a stage has the same names and shapes; kept for readable call sites
    head_dim = hidden // 2
    heads_per_rank = max(1, 2 // tp)
    dtype = "BF16"
    specs: list[TensorSpec] = []
    if pp_rank == 0:
        specs.append(TensorSpec("model.embed_tokens.weight", dtype, (vocab // tp, hidden)))
    for layer in stage_layers(layers, pp)[pp_rank]:
        prefix = f"model.layers.{layer}"
        specs += [
            TensorSpec(f"{prefix}.input_layernorm.weight", dtype, (hidden,)),
            TensorSpec(f"{prefix}.self_attn.qkv_proj.weight", dtype, ((heads_per_rank + 2) * head_dim, hidden)),
            TensorSpec(f"{prefix}.self_attn.o_proj.weight", dtype, (hidden, heads_per_rank * head_dim)),
            TensorSpec(f"{prefix}.self_attn.attn._k_scale", "F32", ()),
            TensorSpec(f"{prefix}.self_attn.attn._v_scale", "F32", ()),
            TensorSpec(f"{prefix}.post_attention_layernorm.weight", dtype, (hidden,)),
            TensorSpec(f"{prefix}.mlp.gate_up_proj.weight", dtype, (2 * intermediate // tp, hidden)),
            TensorSpec(f"{prefix}.mlp.down_proj.weight", dtype, (hidden, intermediate // tp)),
        ]
    if pp_rank == pp - 1:
        specs += [
            TensorSpec("model.norm.weight", dtype, (hidden,)),
            TensorSpec("lm_head.weight", dtype, (vocab // tp, hidden)),
        ]
    return specs


def split_evenly(specs: Sequence[TensorSpec], parts: int) -> list[list[TensorSpec]]:
    """Contiguous, non-empty groups (the last ones may be smaller)."""
    parts = max(1, min(parts, len(specs)))
    size = -(-len(specs) // parts)
    return [list(specs[start : start + size]) for start in range(0, len(specs), size)]


# ---------------------------------------------------------------------------------------------------
# Writing objects


def put_bytes(location: Location, name: str, data: bytes) -> ObjectInfo:
    return location.store.put(location.key(name), data)


def put_json(location: Location, name: str, document: Any) -> ObjectInfo:
    return put_bytes(location, name, json.dumps(document, indent=2).encode())


def read_object(location: Location, name: str) -> bytes:
    key = location.key(name)
    return location.store.read_range(key, 0, location.store.stat(key).size)


def write_tensor_file(
    location: Location, name: str, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
) -> ObjectInfo:
    data = safetensors_bytes([(spec.name, spec.dtype, spec.shape, spec.data()) for spec in specs], metadata)
    return put_bytes(location, name, data)


def write_serving_files(
    location: Location, *, config: bool = True, tokenizer: bool = True, extra_config: Mapping[str, Any] | None = None
) -> None:
    if config:
        put_json(location, "config.json", {**LLAMA_CONFIG, **(extra_config or {})})
        put_json(location, "generation_config.json", GENERATION_CONFIG)
    if tokenizer:
        for name, document in TOKENIZER_FILES.items():
            put_json(location, name, document)


def hf_shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_index(location: Location, weight_map: Mapping[str, str], total_size: int, name: str = INDEX_NAME) -> None:
    put_json(location, name, {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))})


def write_hf_checkpoint(
    location: Location,
    *,
    shards: int = 2,
    layers: int = 2,
    config: bool = True,
    tokenizer: bool = True,
    index: bool = True,
    extra_config: Mapping[str, Any] | None = None,
    intermediate: int = 16,
) -> Checkpoint:
    """A sharded HF checkpoint: model-0000i-of-0000n.safetensors + index + config + tokenizer files.

    `intermediate` scales the MLP tensors, for tests that need files much larger than their headers.
    """
    groups = split_evenly(llama_tensors(layers, intermediate=intermediate), shards)
    tensors_by_file: dict[str, tuple[TensorSpec, ...]] = {}
    for position, group in enumerate(groups):
        name = hf_shard_name(position, len(groups))
        write_tensor_file(location, name, group, {"format": "pt"})
        tensors_by_file[name] = tuple(group)
    checkpoint = Checkpoint(location, tuple(tensors_by_file), tensors_by_file)
    if index:
        total = sum(spec.nbytes for specs in tensors_by_file.values() for spec in specs)
        write_index(location, checkpoint.weight_map, total)
    write_serving_files(location, config=config, tokenizer=tokenizer, extra_config=extra_config)
    return checkpoint


def write_single_file_checkpoint(location: Location, *, layers: int = 2, name: str = "model.safetensors") -> Checkpoint:
    """One model.safetensors, no index, plus config and tokenizer files."""
    specs = llama_tensors(layers)
    write_tensor_file(location, name, specs, {"format": "pt"})
    write_serving_files(location)
    return Checkpoint(location, (name,), {name: tuple(specs)})


def write_sharded_checkpoint(
    location: Location, *, tp: int = 2, pp: int = 1, parts: int = 2, layers: int = 2, pattern: str | None = None
) -> Checkpoint:
    """vLLM sharded state: per (pp_rank, tp_rank), `parts` part files named by `pattern`."""
    pattern = pattern or default_pattern(pp)
    tensors_by_file: dict[str, tuple[TensorSpec, ...]] = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            specs = vllm_rank_tensors(layers, tp_rank=tp_rank, tp=tp, pp_rank=pp_rank, pp=pp)
            for part, group in enumerate(split_evenly(specs, parts)):
                name = format_name(pattern, tp_rank=tp_rank, pp_rank=pp_rank, part=part)
                write_tensor_file(location, name, group)
                tensors_by_file[name] = tuple(group)
    write_serving_files(location)
    return Checkpoint(location, tuple(tensors_by_file), tensors_by_file)


# ---------------------------------------------------------------------------------------------------
# Corrupting


def split_file(data: bytes) -> tuple[bytes, bytes]:
    """(header JSON bytes, data section) of a well-formed safetensors file."""
    length = struct.unpack("<Q", data[:8])[0]
    return data[8 : 8 + length], data[8 + length :]


def header_of(location: Location, name: str) -> dict[str, Any]:
    header, _ = split_file(read_object(location, name))
    return json.loads(header)


def replace_header_bytes(location: Location, name: str, header_json: bytes, *, length: int | None = None) -> None:
    """Put `header_json` (raw, unpadded) in front of the file's existing data; `length` overrides N."""
    _, data = split_file(read_object(location, name))
    prefix = struct.pack("<Q", len(header_json) if length is None else length)
    put_bytes(location, name, prefix + header_json + data)


def rewrite_header(location: Location, name: str, mutate: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Decode the header, let `mutate` change it (in place or by returning a new dict), and re-encode it."""
    header = header_of(location, name)
    header = mutate(header) or header
    encoded = json.dumps(header, separators=(",", ":")).encode()
    replace_header_bytes(location, name, encoded.ljust(-(-len(encoded) // 8) * 8, b" "))


def set_header_length(location: Location, name: str, length: int) -> None:
    data = read_object(location, name)
    put_bytes(location, name, struct.pack("<Q", length) + data[8:])


def truncate_object(location: Location, name: str, drop: int = 1) -> None:
    data = read_object(location, name)
    put_bytes(location, name, data[:-drop])


def append_bytes(location: Location, name: str, extra: bytes = b"\0") -> None:
    put_bytes(location, name, read_object(location, name) + extra)


def delete_object(location: Location, name: str) -> None:
    location.store.delete(location.key(name))


# ---------------------------------------------------------------------------------------------------
# A store wrapper that counts what verify reads


@dataclass
class CountingStore:
    """Wraps any Store and counts ranged reads and their bytes (thread-safe)."""

    inner: Store
    # (key, start, bytes returned); `builtins.list` because the Store method `list` shadows it in here
    reads: builtins.list[tuple[str, int, int]] = field(default_factory=builtins.list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        data = self.inner.read_range(key, start, length)
        with self._lock:
            self.reads.append((key, start, len(data)))
        return data

    def reads_of(self, key: str) -> builtins.list[tuple[str, int, int]]:
        return [read for read in self.reads if read[0] == key]

    @property
    def bytes_read(self) -> int:
        return sum(read[2] for read in self.reads)


def counting(location: Location) -> tuple[Location, CountingStore]:
    store = CountingStore(location.store)
    return Location(store, location.prefix), store  # type: ignore[arg-type]
