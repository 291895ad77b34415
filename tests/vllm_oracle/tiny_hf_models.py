"""Tiny random HF checkpoints of many architectures, written by transformers itself (vLLM oracle venv only).

    tiny_hf_models.py OUT_ROOT [KIND ...]     # writes OUT_ROOT/KIND/ (config.json + model.safetensors)

The architectures the offline table does not cover, and its four (bf16). hidden 64, 3 layers, 4 heads, 2 KV heads,
4 experts, vocab 128; bfloat16 (vLLM refuses float16 for Gemma 2/3).
"""

from __future__ import annotations

import sys
from typing import Any

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# DeepSeek-V2/V3: MLA (a compressed KV, a query compressed or not), a dense first layer, shared + routed experts
DEEPSEEK: dict[str, Any] = {
    **COMMON,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
}
# Qwen2-VL / Qwen2.5-VL: the M-RoPE text model and the special tokens both take
QWEN_VL_TEXT: dict[str, Any] = {
    **COMMON,
    "vocab_size": 160,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]},
}
QWEN_VL_TOKENS: dict[str, Any] = {
    "image_token_id": 151,
    "video_token_id": 152,
    "vision_start_token_id": 153,
    "vision_end_token_id": 154,
}
QWEN_VL_PATCHES: dict[str, Any] = {
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}


def configs() -> dict[str, Any]:
    from transformers import (
        BloomConfig,
        DeepseekV2Config,
        DeepseekV3Config,
        FalconConfig,
        Gemma2Config,
        Gemma3Config,
        Gemma3TextConfig,
        GemmaConfig,
        GPT2Config,
        GPTNeoXConfig,
        GptOssConfig,
        GraniteMoeConfig,
        JambaConfig,
        LlamaConfig,
        MambaConfig,
        MistralConfig,
        MixtralConfig,
        OlmoeConfig,
        Phi3Config,
        PhimoeConfig,
        Qwen2_5_VLConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen2VLConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
        SiglipVisionConfig,
        Starcoder2Config,
    )

    return {
        # the offline table's four architectures (bf16: dtype auto means the same to both engines)
        "llama": lambda: LlamaConfig(**COMMON),
        "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
        "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=False),
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
        "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen3-moe": lambda: Qwen3MoeConfig(**COMMON, **MOE, head_dim=16, decoder_sparse_step=1),
        "qwen2-moe": lambda: Qwen2MoeConfig(**COMMON, **MOE, shared_expert_intermediate_size=64),
        "deepseek-v2": lambda: DeepseekV2Config(**DEEPSEEK, q_lora_rank=None, topk_method="greedy"),
        "gemma2": lambda: Gemma2Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=16),
        "gemma3-text": lambda: Gemma3TextConfig(
            **{**COMMON, "tie_word_embeddings": True}, head_dim=16, sliding_window_pattern=2
        ),
        "gemma3-mm": lambda: Gemma3Config(
            text_config=Gemma3TextConfig(**COMMON, head_dim=16),
            vision_config=SiglipVisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
                vision_use_head=False,
            ),
            mm_tokens_per_image=4,
            image_token_index=127,
            boi_token_index=125,
            eoi_token_index=126,
        ),
        "phi3": lambda: Phi3Config(
            **{**COMMON, "num_key_value_heads": 4}, pad_token_id=0, bos_token_id=1, eos_token_id=2
        ),
        "qwen2-vl": lambda: Qwen2VLConfig(
            text_config=QWEN_VL_TEXT,
            vision_config={
                "depth": 2,
                "embed_dim": 32,
                "hidden_size": 64,
                "num_heads": 2,
                "mlp_ratio": 2,
                **QWEN_VL_PATCHES,
            },
            **QWEN_VL_TOKENS,
            tie_word_embeddings=False,
        ),
        # decoder layers under `transformer.h`, not `model.layers` (GPT-2 ties its head to the embedding)
        "gpt2": lambda: GPT2Config(n_embd=64, n_head=4, n_layer=3, n_positions=256, vocab_size=128),
        "falcon": lambda: FalconConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_hidden_layers=3,
            vocab_size=128,
            new_decoder_architecture=True,
            num_kv_heads=2,
        ),
        "gpt-oss": lambda: GptOssConfig(
            **{**COMMON, "intermediate_size": 64}, head_dim=16, num_local_experts=4, num_experts_per_tok=2
        ),
        "starcoder2": lambda: Starcoder2Config(**COMMON),
        "gemma": lambda: GemmaConfig(**COMMON, head_dim=16),
        "gptneox": lambda: GPTNeoXConfig(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_hidden_layers=3,
            vocab_size=128,
            max_position_embeddings=256,
        ),
        # MLA with a compressed query, routing with a score-correction bias (noaux_tc), shared experts
        "deepseek-v3": lambda: DeepseekV3Config(**DEEPSEEK, q_lora_rank=32, topk_method="noaux_tc"),
        "olmoe": lambda: OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2),
        "phimoe": lambda: PhimoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "granitemoe": lambda: GraniteMoeConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        # state-space layers: Mamba alone, and Jamba's attention / Mamba / expert layers interleaved
        "mamba": lambda: MambaConfig(hidden_size=64, num_hidden_layers=3, vocab_size=128, state_size=8, expand=2),
        "jamba": lambda: JambaConfig(
            **COMMON,
            num_experts=2,
            num_experts_per_tok=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_expand=2,
        ),
        # linear attention (gated delta net) and full attention layers, experts with a shared one
        "qwen3-next": lambda: Qwen3NextConfig(
            **{**COMMON, "num_hidden_layers": 4},
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
        "qwen2_5-vl": lambda: Qwen2_5_VLConfig(
            text_config=QWEN_VL_TEXT,
            vision_config={
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 64,
                "fullatt_block_indexes": [1],
                "window_size": 56,
                **QWEN_VL_PATCHES,
            },
            **QWEN_VL_TOKENS,
        ),
        # vLLM's BLOOM computes its ALiBi slopes while it is constructed: no meta-device build (a refusal)
        "bloom": lambda: BloomConfig(hidden_size=64, n_head=4, n_layer=3, vocab_size=128),
        # experts that TP 4 cannot slice (intermediate 66) and EP 2 cannot split evenly (3 experts)
        "mixtral-odd": lambda: MixtralConfig(
            **{**COMMON, "intermediate_size": 66}, num_local_experts=3, num_experts_per_tok=2
        ),
        # wide enough for FP8 blocks of [128, 128] (vLLM's CPU FP8 kernel wants K block 128)
        "llama-wide": lambda: LlamaConfig(
            **{
                **COMMON,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
            }
        ),
        # FP8 blocks of 128 at TP 2: q, o_proj and the MLP in whole blocks, but each rank's k and v 64 wide
        "llama-wide-hd64": lambda: LlamaConfig(
            **{
                **COMMON,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
            }
        ),
        # sizes vLLM's CPU int4 kernel refuses (CPUWNA16: every rank's input and output a multiple of 32):
        # qkv_proj's output is 64 + 8 + 8 = 80 at TP 1, 32 + 8 + 8 = 48 at TP 2 (the one KV head replicated);
        # every input a multiple of 32 per rank (int4 groups of 32), every output share a multiple of 8
        "llama-int4": lambda: LlamaConfig(
            **{
                **COMMON,
                "num_hidden_layers": 2,
                "intermediate_size": 64,
                "num_attention_heads": 8,
                "num_key_value_heads": 1,
                "head_dim": 8,
            }
        ),
        "mixtral-deep": lambda: MixtralConfig(
            **{**COMMON, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 32, "vocab_size": 1024},
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        # many thin layers: the bounded-memory measurement
        "llama-deep": lambda: LlamaConfig(
            **{
                **COMMON,
                "hidden_size": 512,
                "intermediate_size": 1536,
                "num_hidden_layers": 48,
                "num_attention_heads": 8,
                "num_key_value_heads": 8,
                "vocab_size": 1024,
            }
        ),
    }


def write(root: str, kind: str) -> str:
    import os

    import torch
    from transformers import (
        AutoModelForCausalLM,
        Gemma3ForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    torch.manual_seed(0)
    config = configs()[kind]()
    dtype = torch.float32 if kind.endswith("-deep") else torch.bfloat16
    classes = {
        "gemma3-mm": Gemma3ForConditionalGeneration,
        "qwen2-vl": Qwen2VLForConditionalGeneration,
        "qwen2_5-vl": Qwen2_5_VLForConditionalGeneration,
    }
    cls = classes.get(kind, AutoModelForCausalLM)
    model = cls._from_config(config, dtype=dtype) if hasattr(cls, "_from_config") else cls.from_config(config)
    model = model.to(dtype)
    out = os.path.join(root, kind)
    model.save_pretrained(out, safe_serialization=True)
    if kind == "gemma3-mm":  # transformers 5.20 saves `vision_tower.X`; Hub checkpoints (and vLLM) use
        from safetensors.torch import load_file, save_file  # `vision_tower.vision_model.X`

        path = os.path.join(out, "model.safetensors")
        tensors = load_file(path)
        renamed = {
            ("vision_tower.vision_model." + k.removeprefix("vision_tower.") if k.startswith("vision_tower.") else k): v
            for k, v in tensors.items()
        }
        save_file(renamed, path, metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    names = sys.argv[2:] or [k for k in configs() if not k.endswith(("-deep", "-wide", "-odd", "-int4"))]
    for name in names:
        try:
            print(write(sys.argv[1], name), flush=True)
        except Exception as error:  # noqa: BLE001
            print(f"{name}: FAILED {type(error).__name__}: {error}", flush=True)
