"""A tiny, valid Llama-shaped checkpoint, for the README's demo and for trying streamctl offline.

Deterministic: the same call always writes the same bytes, so demo output is reproducible.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping

from streamctl.checkpoint.safetensors import TensorData, safetensors_bytes
from streamctl.storage.base import Location

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
_BF16_BYTES = 2


def _size(config: Mapping[str, object], name: str) -> int:
    """One integer size from a config.json (what int() accepts: a number, or a string of digits)."""
    value = config[name]
    if not isinstance(value, (int, float, str)):
        raise TypeError(f"config {name!r} is not a number: {value!r}")
    return int(value)


def demo_tensors(config: Mapping[str, object] = DEMO_CONFIG) -> list[tuple[str, list[int]]]:
    """HF tensor names and shapes of a Llama model described by `config`."""
    hidden = _size(config, "hidden_size")
    heads = _size(config, "num_attention_heads")
    kv_heads = _size(config, "num_key_value_heads")
    head_dim = hidden // heads
    inter = _size(config, "intermediate_size")
    vocab = _size(config, "vocab_size")
    tensors: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, hidden])]
    for layer in range(_size(config, "num_hidden_layers")):
        prefix = f"model.layers.{layer}"
        tensors += [
            (f"{prefix}.input_layernorm.weight", [hidden]),
            (f"{prefix}.self_attn.q_proj.weight", [heads * head_dim, hidden]),
            (f"{prefix}.self_attn.k_proj.weight", [kv_heads * head_dim, hidden]),
            (f"{prefix}.self_attn.v_proj.weight", [kv_heads * head_dim, hidden]),
            (f"{prefix}.self_attn.o_proj.weight", [hidden, heads * head_dim]),
            (f"{prefix}.post_attention_layernorm.weight", [hidden]),
            (f"{prefix}.mlp.gate_proj.weight", [inter, hidden]),
            (f"{prefix}.mlp.up_proj.weight", [inter, hidden]),
            (f"{prefix}.mlp.down_proj.weight", [hidden, inter]),
        ]
    tensors += [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]
    return tensors


def _bf16_values(count: int, rng: random.Random) -> bytes:
    # Small normal-ish bf16 values: sign, exponent near 2^-4, random mantissa; no numpy needed.
    out = bytearray()
    for _ in range(count):
        out += ((rng.getrandbits(1) << 15) | (0x3D << 7) | rng.getrandbits(7)).to_bytes(2, "little")
    return bytes(out)


def _tokenizer_files() -> dict[str, bytes]:
    vocab = {f"<{i}>": i for i in range(256)}
    tokenizer = {
        "version": "1.0",
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<0>"},
        "pre_tokenizer": {"type": "Whitespace"},
        "added_tokens": [],
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<1>", "eos_token": "<2>", "unk_token": "<0>"}
    return {
        "tokenizer.json": json.dumps(tokenizer).encode(),
        "tokenizer_config.json": json.dumps(config, indent=2).encode(),
    }


def build_demo_checkpoint(location: Location, shards: int = 2, seed: int = 0) -> list[str]:
    """Write config, tokenizer, `shards` safetensors shards and their index; return the file names."""
    rng = random.Random(seed)
    tensors = demo_tensors()
    groups: list[list[TensorData]] = [[] for _ in range(shards)]
    for position, (name, shape) in enumerate(tensors):
        count = 1
        for dim in shape:
            count *= dim
        groups[position * shards // len(tensors)].append((name, "BF16", shape, _bf16_values(count, rng)))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    total = 0
    for name, group in zip(names, groups, strict=True):
        location.store.put(location.key(name), safetensors_bytes(group, {"format": "pt"}))
        for tensor_name, _, _, data in group:
            weight_map[tensor_name] = name
            total += len(data)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    files: dict[str, bytes] = {
        "config.json": json.dumps(DEMO_CONFIG, indent=2).encode(),
        "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": 2}).encode(),
        "model.safetensors.index.json": json.dumps(index, indent=2).encode(),
        **_tokenizer_files(),
    }
    for name, body in files.items():
        location.store.put(location.key(name), body)
    return sorted([*names, *files])
