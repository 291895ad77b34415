"""The shard tests' tiny Hugging Face checkpoints and their independent reading of the spec.

`write_model` writes real config.json fields (the shared ones from tiny_models) over seeded numpy weights;
`expected_rank` computes every rank's names, shapes and bytes from `docs/specs/sharded-state.md` with plain
numpy, without calling the library's layout code; `assert_rank_matches` compares that with what was written.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from streamctl.checkpoint.safetensors import parse_safetensors_bytes, safetensors_bytes
from streamctl.shard.plan import ShardOptions
from streamctl.shard.run import shard_checkpoint
from streamctl.storage import open_location
from tiny_models import COMMON_FIELDS, LLAMA_FIELDS, hf_tensor_shapes

SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
ONE_F32 = struct.pack("<f", 1.0)

# ---------------------------------------------------------------------------------------------------
# Tiny Hugging Face checkpoints with real config.json fields

# The oracle's fields (tiny_models), at half its width: the offline writer's tests shard many of these.
_BASE: dict[str, Any] = {**COMMON_FIELDS, "hidden_size": 32, "intermediate_size": 64, "torch_dtype": "bfloat16"}
_LLAMA = LLAMA_FIELDS
KINDS: dict[str, dict[str, Any]] = {
    # 8 heads, 2 KV heads: TP 1-2 partition the KV heads, TP 4 and 8 replicate them
    "llama-gqa": {**_BASE, **_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 2},
    # 8 KV heads: every TP up to 8 partitions them
    "llama-mha": {**_BASE, **_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 8},
    "llama-tied": {**_BASE, **_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True},
    "llama-head-dim": {**_BASE, **_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "llama-bias": {
        **_BASE,
        **_LLAMA,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_bias": True,
        "mlp_bias": True,
    },
    "mistral": {
        **_BASE,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "sliding_window": None,
    },
    "qwen2": {
        **_BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "use_sliding_window": False,
        "max_window_layers": 3,
    },
    "qwen3": {
        **_BASE,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "attention_bias": False,
    },
}


def qkv_bias_of(config: Mapping[str, Any]) -> bool:
    return config["model_type"] == "qwen2" or bool(config.get("attention_bias"))


NUMPY_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


def random_tensor(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Finite, distinct-per-tensor values; BF16 as the top half of float32 (truncated, not rounded)."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))
    values = rng.standard_normal(shape).astype(np.float32)
    if dtype == "BF16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(NUMPY_DTYPES[dtype])


def write_model(
    folder: Path, kind: str, *, dtype: str = "BF16", files: int = 2, extra_files: bool = True, **overrides: Any
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """config.json, weights in `files` indexed shards, and serving clutter; returns (config, HF tensors)."""
    config = {**KINDS[kind], **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: random_tensor(name, shape, dtype) for name, shape in hf_tensor_shapes(config).items()}
    names = list(tensors)
    per_file = -(-len(names) // files)
    weight_map = {}
    for index, start in enumerate(range(0, len(names), per_file)):
        file = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        group = names[start : start + per_file]
        data = safetensors_bytes(
            [(name, dtype, tensors[name].shape, tensors[name].tobytes()) for name in group], {"format": "pt"}
        )
        (folder / file).write_bytes(data)
        weight_map.update(dict.fromkeys(group, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if extra_files:
        (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
        (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
        (folder / "README.md").write_text("# tiny\n")
        (folder / "pytorch_model.bin").write_bytes(b"pickle")
        (folder / "original").mkdir(exist_ok=True)
        (folder / "original" / "consolidated.00.pth").write_bytes(b"meta")
    return config, tensors


# ---------------------------------------------------------------------------------------------------
# The spec, independently: what every rank must hold


def vllm_pp_layers(layers: int, pp: int) -> list[list[int]]:
    """Hard-coded reading of vLLM's get_pp_indices for the sizes used here."""
    counts = {(3, 1): [3], (3, 2): [2, 1], (5, 2): [3, 2], (5, 3): [2, 2, 1], (7, 3): [2, 3, 2], (4, 2): [2, 2]}[
        (layers, pp)
    ]
    starts = [sum(counts[:index]) for index in range(pp)]
    return [list(range(start, start + count)) for start, count in zip(starts, counts, strict=False)]


def rows(array: np.ndarray, parts: int, index: int) -> np.ndarray:
    size = array.shape[0] // parts
    return array[index * size : (index + 1) * size]


def vocab_rows(array: np.ndarray, tp: int, rank: int) -> np.ndarray:
    padded_rows = -(-array.shape[0] // 64) * 64
    padding = np.zeros((padded_rows - array.shape[0], *array.shape[1:]), array.dtype)
    return rows(np.concatenate([array, padding]), tp, rank)


def expected_rank(
    config: Mapping[str, Any],
    hf: Mapping[str, np.ndarray],
    tp: int,
    rank: int,
    pp: int = 1,
    stage: int = 0,
    scales: bool = True,
) -> list[tuple[str, np.ndarray]]:
    """(vLLM name, contents) of one rank in state-dict order, built straight from the spec's table."""
    kv_heads = config["num_key_value_heads"]
    tied = bool(config.get("tie_word_embeddings"))
    first, last = stage == 0, stage == pp - 1
    out: list[tuple[str, np.ndarray]] = []
    if last and tied:
        out.append(("lm_head.weight", vocab_rows(hf["model.embed_tokens.weight"], tp, rank)))
    elif first:
        out.append(("model.embed_tokens.weight", vocab_rows(hf["model.embed_tokens.weight"], tp, rank)))

    def kv(array: np.ndarray) -> np.ndarray:
        # Each rank holds kv_heads/tp heads, or (tp > kv_heads) the one head rank * kv_heads // tp.
        return rows(array, tp, rank) if tp <= kv_heads else rows(array, kv_heads, rank * kv_heads // tp)

    for layer in vllm_pp_layers(config["num_hidden_layers"], pp)[stage]:
        p = f"model.layers.{layer}."
        attn = p + "self_attn."
        q, k, v = (hf[f"{attn}{name}_proj.weight"] for name in "qkv")
        out.append((attn + "qkv_proj.weight", np.concatenate([rows(q, tp, rank), kv(k), kv(v)])))
        if qkv_bias_of(config):
            qb, kb, vb = (hf[f"{attn}{name}_proj.bias"] for name in "qkv")
            out.append((attn + "qkv_proj.bias", np.concatenate([rows(qb, tp, rank), kv(kb), kv(vb)])))
        out.append((attn + "o_proj.weight", np.split(hf[attn + "o_proj.weight"], tp, axis=1)[rank]))
        if attn + "o_proj.bias" in hf:
            out.append((attn + "o_proj.bias", hf[attn + "o_proj.bias"]))
        scale_entries = [(f"{attn}attn.{name}", np.array(1.0, np.float32)) for name in SCALES] if scales else []
        norms = (
            [(attn + "q_norm.weight", hf[attn + "q_norm.weight"]), (attn + "k_norm.weight", hf[attn + "k_norm.weight"])]
            if config["model_type"] == "qwen3"
            else []
        )
        out += scale_entries + norms
        gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
        out.append((p + "mlp.gate_up_proj.weight", np.concatenate([rows(gate, tp, rank), rows(up, tp, rank)])))
        if config.get("mlp_bias"):
            bias = np.concatenate(
                [rows(hf[p + "mlp.gate_proj.bias"], tp, rank), rows(hf[p + "mlp.up_proj.bias"], tp, rank)]
            )
            out.append((p + "mlp.gate_up_proj.bias", bias))
        out.append((p + "mlp.down_proj.weight", np.split(hf[p + "mlp.down_proj.weight"], tp, axis=1)[rank]))
        if config.get("mlp_bias"):
            out.append((p + "mlp.down_proj.bias", hf[p + "mlp.down_proj.bias"]))
        out.append((p + "input_layernorm.weight", hf[p + "input_layernorm.weight"]))
        out.append((p + "post_attention_layernorm.weight", hf[p + "post_attention_layernorm.weight"]))
    if last:
        out.append(("model.norm.weight", hf["model.norm.weight"]))
        if not tied:
            out.append(("lm_head.weight", vocab_rows(hf["lm_head.weight"], tp, rank)))
    return out


def dtype_name(array: np.ndarray) -> str:
    return {np.dtype(np.uint16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}[array.dtype]


# ---------------------------------------------------------------------------------------------------
# Reading what was written


def read_file(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, bytes) in file order, with our own strict parser."""
    data = path.read_bytes()
    parsed = parse_safetensors_bytes(data)
    assert parsed.ok, [problem.message for problem in parsed.problems]
    assert parsed.header_length % 8 == 0
    start = 8 + parsed.header_length
    return {t.name: (t.dtype, t.shape, data[start + t.begin : start + t.end]) for t in parsed.tensors}


def rank_files(folder: Path, pattern_prefix: str) -> list[Path]:
    return sorted(folder.glob(f"{pattern_prefix}*.safetensors"), key=lambda path: int(path.stem.rsplit("-", 1)[1]))


def read_rank(
    folder: Path, tp_rank: int, pp: int = 1, pp_rank: int = 0
) -> list[tuple[str, tuple[str, tuple[int, ...], bytes]]]:
    prefix = f"model-rank-{tp_rank}-part-" if pp == 1 else f"model-pp-{pp_rank}-tp-{tp_rank}-part-"
    tensors: list[tuple[str, tuple[str, tuple[int, ...], bytes]]] = []
    for path in rank_files(folder, prefix):
        tensors += list(read_file(path).items())
    return tensors


def assert_rank_matches(
    folder: Path, config: Mapping[str, Any], hf: Mapping[str, np.ndarray], tp: int, pp: int = 1, scales: bool = True
) -> None:
    for stage in range(pp):
        for rank in range(tp):
            expected = expected_rank(config, hf, tp, rank, pp, stage, scales)
            written = dict(read_rank(folder, rank, pp, stage))
            where = f"PP stage {stage}, TP rank {rank}"
            assert sorted(written) == sorted(name for name, _ in expected), where
            for name, array in expected:
                dtype, shape, data = written[name]
                assert (dtype, shape) == (dtype_name(array), array.shape), f"{where}: {name}"
                assert data == np.ascontiguousarray(array).tobytes(), f"{where}: {name} bytes differ"


def shard(source: Path | str, dest: Path | str, **options: Any) -> Any:
    return shard_checkpoint(open_location(str(source)), open_location(str(dest)), ShardOptions(**options))
