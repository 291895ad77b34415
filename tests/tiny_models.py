"""Tiny, real Hugging Face checkpoints (config.json + safetensors) for tests that need real model math.

Unlike tests/checkpoints.py (realistic names over arbitrary bytes, for the storage tests), these carry
finite, seeded weights and the config fields vLLM and transformers read, so vLLM 0.33 can build the model
and load them (tests/vllm_oracle/). Pure Python on purpose: it runs in the torch-free main test venv (to
feed `streamctl shard`) and in the vLLM oracle venv alike.

Kinds (all with 3 layers, so PP = 2 splits them unevenly, 2 + 1; vocab 100, so vLLM pads it to 128):
  llama-gqa       Llama, 8 heads / 2 KV heads: TP 1-2 partitions KV heads, TP 4 replicates them
  llama-tied      Llama, tie_word_embeddings (the checkpoint has no lm_head.weight)
  llama-head-dim  Llama, head_dim 32 != hidden/heads (16)
  qwen2           Qwen2, qkv bias, 4 heads / 4 KV heads (TP 2: KV heads partitioned, nkv > TP)
  mistral         Mistral, 8 heads / 4 KV heads

Example:
    from tiny_models import write_tiny_checkpoint
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", "llama-gqa", dtype="bfloat16")
"""

from __future__ import annotations

import array
import json
import random
import struct
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from streamctl.checkpoint.safetensors import TensorData, parse_safetensors_bytes, safetensors_bytes

SAFETENSORS_DTYPE = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}

COMMON_FIELDS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "vocab_size": 100,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": True,
    "tie_word_embeddings": False,
}
LLAMA_FIELDS: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rope_scaling": None,
}
KINDS: dict[str, dict[str, Any]] = {
    "llama-gqa": {**COMMON_FIELDS, **LLAMA_FIELDS, "num_attention_heads": 8, "num_key_value_heads": 2},
    "llama-tied": {
        **COMMON_FIELDS,
        **LLAMA_FIELDS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
    "llama-head-dim": {
        **COMMON_FIELDS,
        **LLAMA_FIELDS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "qwen2": {
        **COMMON_FIELDS,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 3,
        "rope_scaling": None,
    },
    "mistral": {
        **COMMON_FIELDS,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "sliding_window": None,
        "attention_dropout": 0.0,
    },
}


def tiny_config(kind: str, dtype: str = "bfloat16", **overrides: Any) -> dict[str, Any]:
    """The config.json of a kind (see KINDS), with its dtype and any field overridden."""
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(KINDS)}")
    if dtype not in SAFETENSORS_DTYPE:
        raise ValueError(f"dtype must be one of {', '.join(SAFETENSORS_DTYPE)}, not {dtype!r}")
    # transformers 5 reads "dtype"; older readers (and vLLM's fallbacks) read "torch_dtype": write both.
    return {**KINDS[kind], "torch_dtype": dtype, "dtype": dtype, **overrides}


def hf_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor names and full (unsharded) shapes of a Llama-family config, in checkpoint order: Llama and
    Mistral (with attention_bias and mlp_bias), Qwen2 (qkv bias) and Qwen3 (q/k norms)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    qkv_bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))
    o_bias = config["model_type"] in ("llama", "mistral") and bool(config.get("attention_bias"))
    mlp_bias = bool(config.get("mlp_bias"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        for proj, rows in (
            ("q_proj", heads * head_dim),
            ("k_proj", kv_heads * head_dim),
            ("v_proj", kv_heads * head_dim),
        ):
            shapes[f"{p}.self_attn.{proj}.weight"] = (rows, hidden)
            if qkv_bias:
                shapes[f"{p}.self_attn.{proj}.bias"] = (rows,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if o_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (hidden,)
        if config["model_type"] == "qwen3":
            shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        for proj, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            shapes[f"{p}.mlp.{proj}.weight"] = shape
            if mlp_bias:
                shapes[f"{p}.mlp.{proj}.bias"] = shape[:1]
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _encode(values: list[float], dtype: str) -> bytes:
    """Little-endian bytes of `values` in `dtype`; bfloat16 is float32's upper half (all values finite)."""
    if dtype == "float16":
        return struct.pack(f"<{len(values)}e", *values)
    as_f32 = array.array("f", values)
    if sys.byteorder != "little":
        as_f32.byteswap()
    raw = as_f32.tobytes()
    if dtype == "float32":
        return raw
    out = bytearray(len(values) * 2)
    out[0::2] = raw[2::4]
    out[1::2] = raw[3::4]
    return bytes(out)


def tensor_bytes(name: str, shape: tuple[int, ...], dtype: str, seed: int = 0) -> bytes:
    """Deterministic, finite, distinct-per-tensor data, so a misplaced slice never compares equal."""
    count = 1
    for dim in shape:
        count *= dim
    rng = random.Random(f"{seed}:{name}")
    if name.endswith("norm.weight"):
        values = [1.0 + rng.uniform(-0.25, 0.25) for _ in range(count)]
    else:
        values = [rng.uniform(-0.5, 0.5) for _ in range(count)]
    return _encode(values, dtype)


def _split(names: list[str], files: int) -> Iterator[list[str]]:
    per_file = -(-len(names) // files)
    for start in range(0, len(names), per_file):
        yield names[start : start + per_file]


def write_tiny_checkpoint(
    directory: str | Path,
    kind: str,
    *,
    dtype: str = "bfloat16",
    files: int = 1,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write config.json, generation_config.json and the weights of a tiny model into `directory`.

    files > 1 splits the weights into `model-0000i-of-0000n.safetensors` with a
    `model.safetensors.index.json`, like a real multi-file HF checkpoint. Returns the directory.
    """
    config = tiny_config(kind, dtype, **overrides)
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    shapes = hf_tensor_shapes(config)
    groups = list(_split(list(shapes), max(1, files)))
    weight_map: dict[str, str] = {}
    total = 0
    for number, group in enumerate(groups, start=1):
        file_name = "model.safetensors" if len(groups) == 1 else f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        tensors = [(n, SAFETENSORS_DTYPE[dtype], shapes[n], tensor_bytes(n, shapes[n], dtype, seed)) for n in group]
        (target / file_name).write_bytes(safetensors_bytes(tensors, {"format": "pt"}))
        weight_map.update(dict.fromkeys(group, file_name))
        total += sum(len(data) for *_, data in tensors)
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return target


def read_safetensors(path: str | Path) -> dict[str, TensorData]:
    """name -> (name, dtype, shape, bytes) of a small safetensors file, in file order (no torch needed)."""
    data = Path(path).read_bytes()
    parsed = parse_safetensors_bytes(data)
    if not parsed.ok:
        raise ValueError(f"{path}: {[problem.message for problem in parsed.problems]}")
    start = 8 + parsed.header_length
    return {
        info.name: (info.name, info.dtype, info.shape, data[start + info.begin : start + info.end])
        for info in parsed.tensors
    }


def write_safetensors_file(path: str | Path, tensors: Mapping[str, TensorData] | list[TensorData]) -> None:
    """Write tensors (as read_safetensors returns them) back to a file, e.g. after corrupting one."""
    items = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    Path(path).write_bytes(safetensors_bytes(items))


if __name__ == "__main__":  # python tests/tiny_models.py OUT_DIR KIND [DTYPE]
    print(write_tiny_checkpoint(sys.argv[1], sys.argv[2], dtype=sys.argv[3] if len(sys.argv) > 3 else "bfloat16"))
