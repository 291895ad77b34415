"""Real models' tensor names and shapes for bench/shard.py, generated from their published config.json values
(written here as data, with where each came from), at any depth (number of decoder layers).

A `RealShape` lists, in the order its checkpoint holds them, every tensor of the model with that many decoder
layers: the embeddings (and a vision tower) first, then each decoder layer, then the final norm and head. Its
files are cut so that a shallow checkpoint's files are a prefix of a deep one's plus the same last file
(`files`): one file for the non-layer tensors before the layers, one per decoder layer, one for those after;
bench/shard.py writes the deepest depth once and hard-links the shallower one's files from it, so both
depths cost the disk (and the page cache) once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Shapes = dict[str, tuple[int, ...]]

# meta-llama/Llama-3.1-8B, config.json as published (huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json).
LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
# Qwen/Qwen3-30B-A3B, config.json as published (huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json).
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# google/gemma-3-4b-it, config.json as published (huggingface.co/google/gemma-3-4b-it/blob/main/config.json).
# Its text_config leaves the rest to Gemma3TextConfig's defaults: 8 heads of 256, 4 KV heads, vocabulary
# 262208 (GEMMA3_TEXT_DEFAULTS, which the shapes below use; config.json keeps the published text only).
GEMMA_3_4B_IT: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}
GEMMA3_VOCAB = 262208  # Gemma3TextConfig's default vocab_size


def _attention(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int) -> Shapes:
    return {
        prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
        prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        prefix + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
    }


def _mlp(prefix: str, hidden: int, inter: int) -> Shapes:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def llama_layer(config: dict[str, Any], prefix: str) -> Shapes:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    return {
        prefix + "input_layernorm.weight": (hidden,),
        **_mlp(prefix + "mlp.", hidden, config["intermediate_size"]),
        prefix + "post_attention_layernorm.weight": (hidden,),
        **_attention(prefix, hidden, heads, config["num_key_value_heads"], head_dim),
    }


def qwen3_moe_layer(config: dict[str, Any], prefix: str) -> Shapes:
    hidden, experts, inter = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    head_dim = config["head_dim"]
    shapes: Shapes = {prefix + "input_layernorm.weight": (hidden,), prefix + "mlp.gate.weight": (experts, hidden)}
    for expert in range(experts):
        shapes |= _mlp(f"{prefix}mlp.experts.{expert}.", hidden, inter)
    return shapes | {
        prefix + "post_attention_layernorm.weight": (hidden,),
        **_attention(prefix, hidden, config["num_attention_heads"], config["num_key_value_heads"], head_dim),
        prefix + "self_attn.q_norm.weight": (head_dim,),
        prefix + "self_attn.k_norm.weight": (head_dim,),
    }


def gemma3_layer(config: dict[str, Any], prefix: str) -> Shapes:
    text = {**GEMMA3_TEXT_DEFAULTS, **config["text_config"]}
    hidden, head_dim = text["hidden_size"], text["head_dim"]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    return {
        **{f"{prefix}{norm}.weight": (hidden,) for norm in norms},
        **_mlp(prefix + "mlp.", hidden, text["intermediate_size"]),
        **_attention(prefix, hidden, text["num_attention_heads"], text["num_key_value_heads"], head_dim),
        prefix + "self_attn.q_norm.weight": (head_dim,),
        prefix + "self_attn.k_norm.weight": (head_dim,),
    }


def siglip_tower(vision: dict[str, Any], prefix: str) -> Shapes:
    """SigLIP's vision model as Gemma 3's checkpoints name it (`vision_tower.vision_model.`), no head."""
    hidden, inter, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    positions = (vision["image_size"] // patch) ** 2
    shapes: Shapes = {
        prefix + "embeddings.patch_embedding.weight": (hidden, 3, patch, patch),
        prefix + "embeddings.patch_embedding.bias": (hidden,),
        prefix + "embeddings.position_embedding.weight": (positions, hidden),
    }
    for layer in range(vision["num_hidden_layers"]):
        at = f"{prefix}encoder.layers.{layer}."
        for norm in ("layer_norm1", "layer_norm2"):
            shapes |= {f"{at}{norm}.weight": (hidden,), f"{at}{norm}.bias": (hidden,)}
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{at}self_attn.{proj}.weight": (hidden, hidden), f"{at}self_attn.{proj}.bias": (hidden,)}
        shapes |= {
            at + "mlp.fc1.weight": (inter, hidden),
            at + "mlp.fc1.bias": (inter,),
            at + "mlp.fc2.weight": (hidden, inter),
            at + "mlp.fc2.bias": (hidden,),
        }
    return shapes | {prefix + "post_layernorm.weight": (hidden,), prefix + "post_layernorm.bias": (hidden,)}


def _causal_lm_ends(config: dict[str, Any]) -> tuple[Shapes, Shapes]:
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head: Shapes = {"model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings"):
        head["lm_head.weight"] = (vocab, hidden)
    return {"model.embed_tokens.weight": (vocab, hidden)}, head


def _gemma3_ends(config: dict[str, Any]) -> tuple[Shapes, Shapes]:
    text, vision = config["text_config"], config["vision_config"]
    before: Shapes = {
        "language_model.model.embed_tokens.weight": (GEMMA3_VOCAB, text["hidden_size"]),
        "multi_modal_projector.mm_input_projection_weight": (vision["hidden_size"], text["hidden_size"]),
        "multi_modal_projector.mm_soft_emb_norm.weight": (vision["hidden_size"],),
        **siglip_tower(vision, "vision_tower.vision_model."),
    }
    return before, {"language_model.model.norm.weight": (text["hidden_size"],)}  # the head is tied


@dataclass(frozen=True)
class RealShape:
    """A real model: its published config, its decoder layer's tensors, the tensors before and after them."""

    name: str  # the Hub repository the config comes from
    kind: str  # dense, MoE, multimodal
    config: dict[str, Any]
    layer_prefix: str  # what a decoder layer's names start with, before the index
    layer: Callable[[dict[str, Any], str], Shapes]
    ends: Callable[[dict[str, Any]], tuple[Shapes, Shapes]]

    def config_at(self, layers: int) -> dict[str, Any]:
        """config.json as published, with `layers` decoder layers."""
        if "text_config" in self.config:
            return {**self.config, "text_config": {**self.config["text_config"], "num_hidden_layers": layers}}
        return {**self.config, "num_hidden_layers": layers}

    def files(self, layers: int) -> list[tuple[str, Shapes]]:
        """(file name, its tensors in order): what precedes the layers, one file per layer, what follows."""
        before, after = self.ends(self.config)
        layer_files = [
            (f"model-layer-{index:03d}.safetensors", self.layer(self.config, f"{self.layer_prefix}{index}."))
            for index in range(layers)
        ]
        return [("model-head.safetensors", before), *layer_files, ("model-tail.safetensors", after)]


LLAMA_8B = RealShape("meta-llama/Llama-3.1-8B", "dense", LLAMA_3_1_8B, "model.layers.", llama_layer, _causal_lm_ends)
QWEN3_MOE = RealShape("Qwen/Qwen3-30B-A3B", "MoE", QWEN3_30B_A3B, "model.layers.", qwen3_moe_layer, _causal_lm_ends)
GEMMA3_MM = RealShape(
    "google/gemma-3-4b-it", "multimodal", GEMMA_3_4B_IT, "language_model.model.layers.", gemma3_layer, _gemma3_ends
)
REAL_SHAPES = {"llama-8b": LLAMA_8B, "qwen3-moe": QWEN3_MOE, "gemma3": GEMMA3_MM}
